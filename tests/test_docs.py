"""The README and docs/ stay honest: every `luna-convert ...` command in their fenced code blocks parses
(run in-process through the CLI with --help appended), and every relative link points to an existing file."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from luna_convert.cli import app

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# How a command line can start the tool: the script, a venv's script, or the module.
LAUNCHERS = (["luna-convert"], [".venv/bin/luna-convert"], ["python", "-m", "luna_convert"],
             ["accelerate", "launch", "-m", "luna_convert"])
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
FENCE = re.compile(r"^```(\S*)\s*$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def fenced_blocks(text: str):
    """(language, lines) of every ``` fenced block."""
    blocks, language, lines = [], None, []
    for line in text.splitlines():
        match = FENCE.match(line)
        if match and language is None:
            language, lines = match.group(1), []
        elif line.startswith("```") and language is not None:
            blocks.append((language, lines))
            language = None
        elif language is not None:
            lines.append(line)
    assert language is None, "unclosed ``` block"
    return blocks


def tool_arguments(words: list[str]) -> list[str] | None:
    """The arguments after the launcher, if these shell words run luna-convert; else None."""
    while words and ENV_ASSIGNMENT.match(words[0]):
        words = words[1:]
    for launcher in LAUNCHERS:
        if words[:len(launcher)] == launcher:
            return words[len(launcher):]
    return None


def shell_words(line: str) -> list[list[str]] | None:
    """The simple commands of one shell line (split at `&&`, `;`, `|`), or None if it is not shell
    (e.g. program output with an unbalanced quote)."""
    lexer = shlex.shlex(line.strip().removeprefix("$ "), posix=True, punctuation_chars=";&|")
    lexer.whitespace_split, lexer.commenters = True, "#"
    try:
        tokens = list(lexer)
    except ValueError:
        return None
    simple, current = [], []
    for token in tokens:
        if set(token) <= set(";&|"):
            simple.append(current)
            current = []
        elif not current and token in ("do", "then"):  # a loop or if body starts with its command
            continue
        else:
            current.append(token)
    return [*simple, current]


def commands(path: Path) -> list[tuple[str, list[str]]]:
    """(source line, arguments) of each luna-convert invocation in the page's shell-like fenced blocks."""
    found = []
    for language, lines in fenced_blocks(path.read_text()):
        if language == "python":
            continue
        for line in lines:
            parsed = shell_words(line)
            if parsed is None:
                words = line.strip().removeprefix("$ ").split()
                assert tool_arguments(words) is None, f"{path.name}: `{line.strip()}` is not valid shell"
                continue
            for words in parsed:
                arguments = tool_arguments(words)
                if arguments is not None:
                    found.append((line.strip(), arguments))
    return found


ALL_COMMANDS = [(path, line, arguments) for path in PAGES for line, arguments in commands(path)]


def test_pages_have_commands():
    """The extraction finds the commands (a broken pattern would make the parse test vacuous)."""
    per_page = {path.name: sum(1 for p, _, _ in ALL_COMMANDS if p == path) for path in PAGES}
    assert per_page["README.md"] >= 8, per_page
    assert per_page["training.md"] >= 8 and per_page["benchmarks.md"] >= 5, per_page


@pytest.mark.parametrize("path, line, arguments", ALL_COMMANDS,
                         ids=[f"{p.name}:{' '.join(a)[:60]}" for p, _, a in ALL_COMMANDS])
def test_command_parses(path, line, arguments):
    args = list(arguments)
    if "--debug" in args[1:]:  # cli.main accepts it anywhere and moves it to the group
        args.remove("--debug")
        args.insert(0, "--debug")
    result = CliRunner().invoke(app, [*args, "--help"])
    assert result.exit_code == 0 and "Usage:" in result.output, (
        f"{path.name}: `{line}` does not parse:\n{result.output}")


def test_no_command_outside_fences():
    """An indented (unfenced) code block with a command would escape the parse test."""
    for path in PAGES:
        inside = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("```"):
                inside = not inside
            elif not inside and line.startswith("    ") and tool_arguments(line.strip().removeprefix("$ ").split()) is not None:
                pytest.fail(f"{path.name}:{number}: command in an indented block; fence it with ```bash")


def test_parse_check_can_fail():
    """A misspelt option is caught: the check is not vacuous."""
    result = CliRunner().invoke(app, ["bench", "--lenghts", "1024", "--help"])
    assert result.exit_code != 0


@pytest.mark.parametrize("path", [*PAGES, ROOT / "CONTRIBUTING.md"], ids=lambda p: p.name)
def test_relative_links_exist(path):
    missing = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or a link within the page
        file = target.split("#", 1)[0]
        if not (path.parent / file).exists():
            missing.append(target)
    assert not missing, f"{path.name} links to missing files: {missing}"
