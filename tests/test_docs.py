"""The README and docs/ stay honest: every `luna-convert ...` command in their fenced code blocks parses
(run in-process through the CLI with --help appended), and every relative link points to an existing file.
They describe the product as it is: no development history in the pages, the code, the tests, the scripts
or the benchmarks; a README of at most 10,000 characters that keeps CI's test command; docs/ within its
budget; and one package map, CONTRIBUTING.md's, checked against the tree."""

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


# ------------------------------------------------------------------ the docs describe the product as it is
# Development history has no place in the project: numbered work sessions, rounds or issues, and the
# emphasised session titles of the old work log (`[*]`, so that this file does not match itself).
HISTORY = re.compile(r"\b[Ss]essions? \d+|\b[Rr]ound \d+|[*]Session|\b[Ii]ssues? #?\d+")


def history_scanned_files() -> list[Path]:
    """The pages, and every source, test, script and benchmark file (comments and strings are read with
    the code: no identifier can match the patterns, which need a space before the number)."""
    package = ROOT / "luna_convert"
    files = [*PAGES, ROOT / "CONTRIBUTING.md", *sorted(package.rglob("*.py")), *sorted(package.rglob("*.c")),
             *sorted((ROOT / "tests").glob("*.py"))]
    for folder in ("scripts", "benchmarks"):
        files += sorted(path for path in (ROOT / folder).iterdir() if path.is_file())
    return [path for path in files if "__pycache__" not in path.parts]


def history_hits(text: str) -> list[tuple[int, str]]:
    return [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1) if HISTORY.search(line)]


def test_history_pattern_catches_the_old_wording():
    """The scan is not vacuous: each form the old pages used is caught, and the words the rule allows are not."""
    # written as templates, so that this file passes its own scan
    for template in ("measured in {s}ession 12", "{S}essions 23 and 24", "(docs/x.md, {star}{S}ession 19{star})",
                     "{r}ound 5's defaults", "{R}ound 4 gave", "(audit {i}ssue 15, item 2)", "{i}ssue #14"):
        wording = template.format(s="s", S="S", r="r", R="R", i="i", star="*")
        assert history_hits(wording), wording
    for allowed in ("def pytest_sessionstart(session):", "ort.InferenceSession(path)", "around 5 ms",
                    "round(x, 2)", "one session of training", "this issue of the docs"):
        assert not history_hits(allowed), allowed
    assert len(history_scanned_files()) > 100


def test_no_development_history_in_docs_code_or_tests():
    found = []
    for path in history_scanned_files():
        for number, line in history_hits(path.read_text(errors="replace")):
            found.append(f"{path.relative_to(ROOT)}:{number}: {line[:120]}")
    assert not found, "development history (say what holds now, and cite a command):\n" + "\n".join(found)


README_TEST_COMMAND = ".venv/bin/pip install -e '.[test]' && HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q"


def test_readme_is_short_and_keeps_the_test_command_and_the_links():
    text = (ROOT / "README.md").read_text()
    assert len(text) <= 10_000, f"README.md is {len(text)} characters (at most 10,000)"
    assert README_TEST_COMMAND in text.splitlines()  # CI runs this line
    assert "](CONTRIBUTING.md#package-map)" in text
    assert "](docs/benchmarks.md)" in text and "](docs/quality.md)" in text


def test_docs_fit_their_budget():
    """docs/ stays a product manual: at most 150 KB in all, one design-decisions page of at most 15 KB,
    and no work log."""
    sizes = {path.name: path.stat().st_size for path in (ROOT / "docs").iterdir() if path.is_file()}
    assert sum(sizes.values()) <= 150_000, sizes
    assert sizes["design-decisions.md"] <= 15_000
    assert "performance-log.md" not in sizes


# ------------------------------------------------------------------ one package map (CONTRIBUTING.md)
PACKAGE = ROOT / "luna_convert"
MAP_ROW_NAMES = re.compile(r"`([^`]+)`")


def package_map_rows(text: str) -> list[str]:
    """The names in the first cell of each table row of CONTRIBUTING.md's *Package map* section."""
    section = text.split("\n## Package map\n", 1)[1].split("\n## ", 1)[0]
    names = []
    for line in section.splitlines():
        if line.startswith("| `"):
            names += MAP_ROW_NAMES.findall(line.split("|")[1])
    return names


def package_modules() -> set[str]:
    """Every Python and C module of the package, relative to it; a subpackage's ``__init__.py`` is its
    folder, whose docstring points to the map instead of repeating it."""
    modules = set()
    for path in [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.c")]:
        relative = path.relative_to(PACKAGE)
        if "__pycache__" in relative.parts or (path.name == "__init__.py" and len(relative.parts) > 1):
            continue
        modules.add(relative.as_posix())
    return modules


def test_the_package_map_names_every_module_and_only_modules_that_exist():
    named = package_map_rows((ROOT / "CONTRIBUTING.md").read_text())
    assert len(named) > 50, "the map's rows were not found"
    missing = sorted(package_modules() - set(named))
    assert not missing, f"modules without a row in CONTRIBUTING.md's Package map: {missing}"
    gone = [name for name in named if not (PACKAGE / name).exists()]
    assert not gone, f"CONTRIBUTING.md's Package map names files that do not exist: {gone}"
    assert len(named) == len(set(named)), "a module has two rows"


def test_the_map_check_can_fail():
    """A module without a row, and a row without a module, are both seen."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    first_row = next(line for line in text.split("\n## Package map\n", 1)[1].splitlines() if line.startswith("| `"))
    assert len(package_map_rows(text.replace(first_row + "\n", ""))) == len(package_map_rows(text)) - 1
    assert "ops/no_such_module.py" in package_map_rows(text.replace(
        first_row, first_row + "\n| `ops/no_such_module.py` | nothing |"))


def listed_modules(docstring: str, stems: set[str]) -> set[str]:
    """Module names a docstring lists: quoted (``name``, `name`, name.py) or at the start of an indented
    "name   description" line."""
    quoted = set(re.findall(r"`+(\w+)(?:\.py|\.c)?`+", docstring))
    listed = set(re.findall(r"^\s+(\w+)\s{2,}\S", docstring, re.MULTILINE))
    return (quoted | listed) & stems


@pytest.mark.parametrize("init", sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.glob("*/__init__.py")))
def test_subpackage_docstrings_point_to_the_map_instead_of_repeating_it(init):
    import ast

    path = PACKAGE / init
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    stems = {p.stem for p in path.parent.iterdir() if p.suffix in (".py", ".c") and p.stem != "__init__"}
    listed = listed_modules(docstring, stems)
    assert len(listed) < 3, (f"{init}'s docstring lists modules {sorted(listed)}: say what the package is and "
                             "point to CONTRIBUTING.md's Package map, the one map")


def test_the_docstring_check_can_fail():
    assert listed_modules("One concern a module: ``splits``, ``labels`` and ``tables``.", {"splits", "labels", "tables"})
    assert len(listed_modules("Tensor math.\n\n    dtypes     the rule\n    linear     the core\n"
                              "    reference  N x N\n", {"dtypes", "linear", "reference"})) == 3


def test_no_second_package_map_in_the_readme_or_docs():
    """A table whose rows start with the package's modules or folders lives only in CONTRIBUTING.md."""
    for path in PAGES:
        rows = [line for line in path.read_text().splitlines()
                if re.match(r"^\| `[\w/]+(\.py|/)`", line)]
        assert len(rows) < 3, f"{path.name} holds a package map ({rows[:3]}); link CONTRIBUTING.md#package-map"


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.*)$", path.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("path", [*PAGES, ROOT / "CONTRIBUTING.md"], ids=lambda p: p.name)
def test_links_to_a_section_find_its_heading(path):
    missing = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or "#" not in target:
            continue
        file, anchor = target.split("#", 1)
        page = path.parent / file if file else path
        if page.suffix == ".md" and page.exists() and anchor not in heading_anchors(page):
            missing.append(target)
    assert not missing, f"{path.name} links to sections that do not exist: {missing}"


def test_the_anchor_rule_matches_githubs():
    assert {"lunas-defaults-start-at-hedgehogs-kernel", "a-busy-machine---background-load-n"} <= {
        re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-")
        for h in ("LUNA's defaults start at Hedgehog's kernel", "A busy machine: `--background-load N`")}


# ------------------------------------------------------------------ every figure with its command and date
MEASURED_PAGES = ["README.md", "docs/benchmarks.md", "docs/quality.md", "docs/design-decisions.md", "docs/results.md"]
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
COMMAND = re.compile(r"```bash|`(luna-convert|python|\.venv/bin/|/usr/bin/time)[^`]*`")
FIGURE_ROW = re.compile(r"^\|.*\b\d+\.\d+\b.*\|\s*$", re.MULTILINE)


def sections_without_provenance(text: str) -> list[str]:
    """Titles of the ``##`` sections that hold a table of measured figures (a decimal number outside code)
    but name no date or no command."""
    missing = []
    for section in re.split(r"\n(?=## )", text):
        figures = FIGURE_ROW.search(re.sub(r"`[^`\n]*`", "", section))
        if figures and not (DATE.search(section) and COMMAND.search(section)):
            missing.append(section.splitlines()[0])
    return missing


@pytest.mark.parametrize("name", MEASURED_PAGES)
def test_every_table_of_figures_names_its_command_and_date(name):
    missing = sections_without_provenance((ROOT / name).read_text())
    assert not missing, f"{name}: sections with measured figures but no command or date: {missing}"


def test_the_provenance_check_can_fail():
    table = "| method | ms |\n| --- | ---: |\n| luna | 43.3 |\n"
    assert sections_without_provenance(f"## Speed\n\n{table}") == ["## Speed"]
    assert sections_without_provenance(f"## Speed\n\n2026-12-04:\n\n```bash\nluna-convert bench\n```\n\n{table}") == []
    assert sections_without_provenance("## Options\n\n| option | default |\n| --- | --- |\n| `--set a=0.5` | off |\n") == []
