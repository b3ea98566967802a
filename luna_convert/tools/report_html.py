"""``luna-convert report DIR... --html OUT.html``: the report as one self-contained page.

Nothing is fetched when the page is viewed: the CSS is inline, the bar chart is inline SVG and
the images (each run's ``curves.png``, a bench folder's ``bench.png``) are base64 data URIs.
The table is :func:`luna_convert.tools.report.table_rows` of :func:`~luna_convert.tools.report.build_report`,
the same cells as report.md and the terminal table.
"""

from __future__ import annotations

import base64
import json
from html import escape
from pathlib import Path

from ..errors import LunaConvertError
from ..fileio import atomic_write_text
from ..run.plots import CURVES_FILE
from ..run.results import RunResults
from .report import RESULTS_FILE, build_report, find_runs, table_rows, task_column

BENCH_FILE, BENCH_PLOT = "bench.json", "bench.png"
# One colour per method, in the report's (sorted) method order; cycled past ten methods.
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1100px;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table.results { border-collapse: collapse; margin: 1em 0; }
table.results th, table.results td { border: 1px solid #ccc; padding: 0.35em 0.7em; text-align: right; }
table.results th:first-child, table.results td:first-child { text-align: left; }
table.results thead th { background: #f0f3f7; }
table.results tr.original td { background: #fafafa; font-style: italic; }
.note { color: #555; font-size: 0.9em; }
figure { margin: 1em 0 2em; } figcaption { color: #555; font-size: 0.9em; }
figure img { max-width: 100%; border: 1px solid #eee; }
svg text { font-size: 12px; fill: #333; }
"""


def write_html_report(paths: list[Path], html_path: str | Path, rep: dict | None = None) -> Path:
    """Write the HTML page for the runs (and bench folders) under ``paths``; ``rep`` is
    :func:`build_report`'s result when the caller has it already."""
    html_path = check_html_path(html_path)
    paths = [Path(p) for p in paths]
    rep = rep if rep is not None else build_report(paths)
    runs = [(run, run_folder(run, paths)) for run in sorted(find_runs(paths), key=lambda r: r.run_dir)]
    atomic_write_text(html_path, html_report(rep, runs, bench_folders(paths)))
    return html_path


def check_html_path(html_path: str | Path) -> Path:
    """Refuse a page name that cannot be written as a file (before anything else is written)."""
    html_path = Path(html_path)
    if html_path.is_dir():
        raise LunaConvertError(f"--html {html_path} is a folder; give the page's file name, "
                               f"e.g. {html_path / 'report.html'}")
    return html_path


def run_folder(run: RunResults, paths: list[Path]) -> Path:
    """Where a found run's folder is now: among ``paths`` (as find_runs looks: the path itself or
    one level down) by its name, else where results.json says it was written."""
    name = Path(run.run_dir).name
    for path in paths:
        for candidate in (path, path / name):
            if candidate.name == name and (candidate / RESULTS_FILE).is_file():
                return candidate
    return Path(run.run_dir)


def bench_folders(paths: list[Path]) -> list[Path]:
    """``luna-convert bench`` output folders among ``paths`` (the path itself or one level down)."""
    found = []
    for path in paths:
        files = [path / BENCH_FILE] if (path / BENCH_FILE).is_file() else sorted(path.glob(f"*/{BENCH_FILE}"))
        found += [f.parent for f in files]
    return found


def html_report(rep: dict, runs: list[tuple[RunResults, Path]], benches: list[Path]) -> str:
    """The page: table, bar chart of % recovered, each run's curves, each bench plot."""
    parts = [
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        "<title>luna-convert report</title>", f"<style>{STYLE}</style>", "</head>", "<body>",
        "<h1>luna-convert report</h1>",
        f'<p class="note">{len(runs)} run(s), {len(rep["rows"])} method(s), {len(rep["tasks"])} task(s).</p>',
        "<h2>% of the original score recovered</h2>", results_table(rep),
        '<p class="note">Cells: converted score x100 (% of the original recovered). ratio of means = 100 x '
        "mean(converted) / mean(original); mean of ratios = mean over tasks of % recovered.</p>",
        "<h2>% recovered per method and task</h2>", recovered_chart(rep),
        "<h2>Training curves</h2>",
    ]
    for run, folder in runs:
        caption = escape(f"{run.method} on {task_column(run)}: {run.headline_metric} "
                         f"{run.converted_score:.4f} (teacher {run.teacher_score:.4f}), {folder.name}")
        parts.append(_figure(folder / CURVES_FILE, f"training curves of {folder.name}", caption,
                             missing=f"no {CURVES_FILE} in {folder}"))
    if benches:
        parts.append("<h2>Benchmark</h2>")
    for folder in benches:
        meta = json.loads((folder / BENCH_FILE).read_text()).get("meta") or {}
        where = ", ".join(f"{k} {meta[k]}" for k in ("device", "gpu", "cpu", "threads", "torch", "timer") if k in meta)
        parts.append(_figure(folder / BENCH_PLOT, f"benchmark {folder.name}", f"{folder.name}: {escape(where)}",
                             missing=f"no {BENCH_PLOT} in {folder}"))
    parts += ["</body>", "</html>", ""]
    return "\n".join(parts)


def results_table(rep: dict) -> str:
    header, body = table_rows(rep)
    head = "".join(f'<th scope="col">{escape(h)}</th>' for h in header)
    rows = []
    for i, cells in enumerate(body):
        css = ' class="original"' if i == 0 else ""  # table_rows puts the original's scores first
        rows.append(f"<tr{css}>" + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr>")
    return (f'<table class="results" id="results"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table>")


def recovered_chart(rep: dict) -> str:
    """Grouped bars as inline SVG: one group per task, one bar per method, a line at 100 %."""
    methods = [row["method"] for row in rep["rows"]]
    values = {(row["method"], task): cell["recovered_pct"] for row in rep["rows"] for task, cell in row["tasks"].items()}
    top = max([110.0] + [v * 1.08 for v in values.values() if v is not None])
    bar, gap, left, plot_h, pad_top = 26, 30, 50, 260, 20
    group_w = bar * len(methods) + gap
    width = left + group_w * len(rep["tasks"]) + 160
    height = pad_top + plot_h + 60

    def y(v: float) -> float:
        return pad_top + plot_h * (1 - v / top)

    out = [f'<svg id="recovered-chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           'role="img" aria-label="% recovered per method and task">']
    for tick in range(0, int(top) + 1, 20):
        out.append(f'<line x1="{left}" x2="{width - 160}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" stroke="#eee"/>'
                   f'<text x="{left - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick}</text>')
    out.append(f'<line x1="{left}" x2="{width - 160}" y1="{y(100):.1f}" y2="{y(100):.1f}" stroke="#888" '
               'stroke-dasharray="4 3"/>')
    for g, task in enumerate(rep["tasks"]):
        x0 = left + gap / 2 + g * group_w
        for m, method in enumerate(methods):
            v = values.get((method, task))
            x = x0 + m * bar
            if v is None:
                continue
            out.append(f'<rect class="bar" data-method="{escape(method)}" data-task="{escape(task)}" '
                       f'data-value="{v:.1f}" x="{x:.1f}" y="{y(v):.1f}" width="{bar - 3}" '
                       f'height="{plot_h + pad_top - y(v):.1f}" fill="{COLOURS[m % len(COLOURS)]}">'
                       f"<title>{escape(method)} / {escape(task)}: {v:.1f} %</title></rect>"
                       f'<text x="{x + (bar - 3) / 2:.1f}" y="{y(v) - 3:.1f}" text-anchor="middle" '
                       f'style="font-size:10px">{v:.0f}</text>')
        out.append(f'<text x="{x0 + bar * len(methods) / 2:.1f}" y="{pad_top + plot_h + 18}" '
                   f'text-anchor="middle">{escape(task)}</text>')
    out.append(f'<text x="14" y="{pad_top + plot_h / 2}" transform="rotate(-90 14 {pad_top + plot_h / 2})" '
               'text-anchor="middle">% recovered</text>')
    for m, method in enumerate(methods):
        ly = pad_top + 10 + 18 * m
        out.append(f'<rect x="{width - 150}" y="{ly - 10}" width="12" height="12" fill="{COLOURS[m % len(COLOURS)]}"/>'
                   f'<text x="{width - 132}" y="{ly}">{escape(method)}</text>')
    out.append("</svg>")
    return "".join(out)


def _figure(image: Path, alt: str, caption: str, missing: str) -> str:
    if not image.is_file():
        return f'<p class="note">{escape(missing)}</p>'
    data = base64.b64encode(image.read_bytes()).decode("ascii")
    return (f'<figure><img alt="{escape(alt)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{caption}</figcaption></figure>")
