"""What a user meets first: `run --help` names every task the command takes, every page of the manual is reached
from the README, the repository names no path of the machine it was written on, README commands that read the
development data say what they read without it, and a model card names the data the run was scored on."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from luna_convert.cli import app
from luna_convert.tasks import TASKS

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_run_help_lists_every_task_of_the_registry():
    result = CliRunner().invoke(app, ["run", "--help"])
    assert result.exit_code == 0, result.output
    text = re.sub(r"(?<=\w)- (?=\w)", "-", " ".join(result.output.replace("│", " ").split()))  # lines wrap at "-"
    missing = [name for name in TASKS if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)]
    assert not missing, f"`luna-convert run --help` does not name the tasks {missing}"


# ------------------------------------------------------------------ every page reachable from the README
def linked_pages(page: Path) -> set[Path]:
    """The repository's markdown files that ``page`` links to (relative links, anchors dropped)."""
    found = set()
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if path.suffix == ".md" and path.is_file() and ROOT in path.parents:
            found.add(path)
    return found


def reachable_from(start: Path) -> set[Path]:
    seen, todo = {start}, [start]
    while todo:
        for page in linked_pages(todo.pop()) - seen:
            seen.add(page)
            todo.append(page)
    return seen


def test_every_doc_page_is_reachable_from_the_readme():
    pages = {*(ROOT / "docs").glob("*.md"), ROOT / "CONTRIBUTING.md"}
    unreached = sorted(p.relative_to(ROOT).as_posix() for p in pages - reachable_from(ROOT / "README.md"))
    assert not unreached, f"pages no link path from README.md reaches: {unreached}"


def test_the_link_walk_can_fail(tmp_path):
    (tmp_path / "README.md").write_text("[a](a.md)\n")
    (tmp_path / "a.md").write_text("[b](b.md#x) [web](https://example.org/c.md)\n")
    (tmp_path / "b.md").write_text("back to [a](a.md)\n")
    (tmp_path / "c.md").write_text("unlinked\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path.resolve()
    try:
        assert reachable_from(ROOT / "README.md") == {ROOT / name for name in ("README.md", "a.md", "b.md")}
    finally:
        ROOT = saved


# ------------------------------------------------------------------ no path of the development machine
# Roots of home and work folders, and wherever this checkout sits: a path under them names one machine.
MACHINE_ROOTS = ("/" + "work/", "/" + "home/", "/" + "Users/", "/" + "root/", "/" + "mnt/", "/" + "scratch/")


def tracked_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = [ROOT / name for name in listed.stdout.split("\0") if name]
    return [f for f in files if f.is_file() and f.suffix not in {".png", ".safetensors", ".bin", ".pt", ".npz", ".ico"}]


def machine_paths(text: str, checkout: Path) -> list[str]:
    roots = (*MACHINE_ROOTS, f"{checkout.parent}/")
    pattern = re.compile(r"(?<![\w.~-])(?:" + "|".join(re.escape(r) for r in roots) + r")[\w./-]*")
    return pattern.findall(text)


def test_no_absolute_path_of_the_development_machine_in_the_repository():
    found = []
    for path in tracked_text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{path.relative_to(ROOT)}: {hit}" for hit in machine_paths(text, ROOT)]
    assert not found, "absolute paths of one machine (describe the file, or give a relative path):\n" + "\n".join(found)


def test_the_machine_path_check_can_fail():
    checkout = Path("/srv/ci/checkout")
    assert machine_paths("see `/" + "work/shared/notes/methods.md`.", checkout) == ["/" + "work/shared/notes/methods.md"]
    assert machine_paths("data in /srv/ci/shared/x and ../shared/y and https://h/home/z", checkout) == ["/srv/ci/shared/x"]


# ------------------------------------------------------------------ README commands on the development data
def test_readme_commands_reading_the_development_data_say_what_they_read_without_it():
    """`../shared` is the development machine's data beside the checkout: a README block that reads it is followed
    by what the command reads without `--data-dir` (and so what a user runs)."""
    text = (ROOT / "README.md").read_text()
    blocks = list(re.finditer(r"```[a-z]*\n(.*?)```", text, re.S))
    reading = [b for b in blocks if "../shared" in b.group(1)]
    assert reading, "the check found no block reading ../shared (update it if the README no longer has one)"
    for block in reading:
        after = re.split(r"\n#+ |\n```", text[block.end():], maxsplit=1)[0]
        assert "without `--data-dir`" in after and "hub" in after, (block.group(1), after[:300])


# ------------------------------------------------------------------ the model card's data
@pytest.mark.parametrize("data_dir, name, kind", [
    (None, "GLUE SST2", "nyu-mll/glue"),
    ("some/where/SST-2", "SST-2 (local files)", "SST-2"),
    ("hf:stanfordnlp/sst2", "stanfordnlp/sst2", "stanfordnlp/sst2"),
])
def test_the_model_card_names_the_data_the_run_was_scored_on(tmp_path, data_dir, name, kind):
    from huggingface_hub import ModelCard

    from luna_convert.run.model_card import write_model_card
    from test_results_view import fake_run

    results = fake_run(tmp_path / "run", "luna", "sst2", teacher=0.9, converted=0.88)
    results["config"]["data_dir"] = data_dir
    (tmp_path / "run" / "results.json").write_text(json.dumps(results))
    found = {(r.dataset_name, r.dataset_type, r.dataset_split) for r in
             ModelCard.load(write_model_card(tmp_path / "run")).data.eval_results}
    assert found == {(name, kind, "validation")}
