"""``luna-convert report``: runs gathered into the papers' methods x tasks table."""

from __future__ import annotations

import csv
import io
import json
from datetime import datetime, timezone
from pathlib import Path

from ..run.autoconfig import OWN_DATA_TASKS
from ..run.results import RunResults
from ..errors import LunaConvertError
from ..fileio import atomic_write_text
from ..folder_layout import RESULTS_FILE
from ..metrics import LOWER_IS_BETTER



def find_runs(paths: list[Path]) -> list[RunResults]:
    """Every run's results, oldest finish first."""
    finished = []
    for path in paths:
        files = [path / RESULTS_FILE] if (path / RESULTS_FILE).is_file() else sorted(path.glob(f"*/{RESULTS_FILE}"))
        for f in files:
            run = RunResults.read(f)
            finished.append((finish_time(run, f), run))
    if not finished:
        raise LunaConvertError(f"no {RESULTS_FILE} found in {', '.join(map(str, paths))}; pass run folders under outputs/")
    finished.sort(key=lambda pair: pair[0])
    return [run for _, run in finished]


def finish_time(run: RunResults, results_file: Path) -> datetime:
    """When the run finished: its recorded ``finished_at``, else (runs written before it was recorded)
    the results file's modification time. Folder names do not order runs: they start with the recipe's name."""
    stamp = run.finished_at
    if stamp is None:
        return datetime.fromtimestamp(results_file.stat().st_mtime, tz=timezone.utc)
    try:
        when = datetime.fromisoformat(str(stamp))
    except ValueError:
        raise LunaConvertError(f"{results_file}: finished_at {stamp!r} is not an ISO time "
                               "(e.g. 2025-01-31T12:00:00+00:00); fix or remove it") from None
    return when if when.tzinfo is not None else when.astimezone()  # no zone: local time, as datetime.now() writes


def task_column(run: RunResults) -> str:
    """A benchmark task by its name; a run on the user's own data by its data folder and task,
    so that two own-data sets of the same kind get two columns."""
    data_dir = run.config.get("data_dir")  # the raw record: old runs' configs need not validate today
    if run.task in OWN_DATA_TASKS and data_dir:
        return f"{Path(str(data_dir).rstrip('/')).name} ({run.task})"
    return run.task


def build_report(paths: list[Path], output: Path | None = None) -> dict:
    """Per (method, task): the latest run's scores; per method: both averages of % recovered.

    ratio of means  = 100 * mean(converted scores) / mean(original scores)   (Hedgehog's 99.3 %)
    mean of ratios  = mean over tasks of 100 * converted / original
    """
    cells: dict[tuple[str, str], RunResults] = {}
    for run in find_runs(paths):  # oldest first: the last finished run per cell wins
        cells[(run.method, task_column(run))] = run
    tasks = sorted({t for _, t in cells})
    methods = sorted({m for m, _ in cells})
    rows = []
    for method in methods:
        row = {"method": method, "tasks": {}}
        teacher, converted, ratios = [], [], []
        for task in tasks:
            run = cells.get((method, task))
            if run is None:
                continue
            row["tasks"][task] = {"teacher": run.teacher_score, "converted": run.converted_score,
                                  "recovered_pct": run.recovered_pct}
            if run.headline_metric not in LOWER_IS_BETTER:  # error metrics do not average with scores
                teacher.append(run.teacher_score)
                converted.append(run.converted_score)
            if run.recovered_pct is not None:
                ratios.append(run.recovered_pct)
        mean_t = sum(teacher) / len(teacher) if teacher else 0.0
        row["ratio_of_means_pct"] = 100 * (sum(converted) / len(converted)) / mean_t if mean_t > 0 else None
        row["mean_of_ratios_pct"] = sum(ratios) / len(ratios) if ratios else None
        rows.append(row)
    rep = {"tasks": tasks, "rows": rows}
    if output is not None:
        output = Path(output)
        atomic_write_text(output / "report.md", to_markdown(rep))
        atomic_write_text(output / "report.csv", to_csv(rep))
        atomic_write_text(output / "report.json", json.dumps(rep, indent=2) + "\n")
    return rep


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def table_rows(rep: dict) -> tuple[list[str], list[list[str]]]:
    """Header and text cells of the methods x tasks table (the original's scores first), for every view of it."""
    header = ["method", *rep["tasks"], "ratio of means %", "mean of ratios %"]
    body = []
    for row in rep["rows"]:
        cells = [row["method"]]
        for task in rep["tasks"]:
            c = row["tasks"].get(task)
            cells.append("-" if c is None else f"{100 * c['converted']:.1f} ({_fmt(c['recovered_pct'])}%)")
        body.append(cells + [_fmt(row["ratio_of_means_pct"]), _fmt(row["mean_of_ratios_pct"])])
    teacher_row = ["original"]
    for task in rep["tasks"]:
        scores = [r["tasks"][task]["teacher"] for r in rep["rows"] if task in r["tasks"]]
        teacher_row.append(f"{100 * scores[0]:.1f}" if scores else "-")
    return header, [teacher_row + ["", ""]] + body


def to_markdown(rep: dict) -> str:
    header, body = table_rows(rep)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    note = ("\nCells: converted score x100 (% of the original recovered). ratio of means = 100 x mean(converted) / "
            "mean(original); mean of ratios = mean over tasks of % recovered.\n")
    return "\n".join(lines) + "\n" + note


def to_csv(rep: dict) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["method", "task", "original", "converted", "recovered_pct"])
    for row in rep["rows"]:
        for task, c in row["tasks"].items():
            writer.writerow([row["method"], task, c["teacher"], c["converted"], c["recovered_pct"]])
        writer.writerow([row["method"], "ratio_of_means", "", "", row["ratio_of_means_pct"]])
        writer.writerow([row["method"], "mean_of_ratios", "", "", row["mean_of_ratios_pct"]])
    return buf.getvalue()


def render_table(rep: dict):
    from rich.table import Table

    header, body = table_rows(rep)
    table = Table(title="% of the original score recovered")
    for h in header:
        table.add_column(h, justify="left" if h == "method" else "right")
    for r in body:
        table.add_row(*r)
    return table
