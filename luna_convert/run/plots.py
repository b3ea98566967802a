"""A run's training curves (``curves.png``): loss per step for each stage in its log, and the
evaluation score (converted, with the teacher's for reference) marked at the end of training."""

from __future__ import annotations

import io
import json
from pathlib import Path

from ..fileio import atomic_write_bytes
from ..folder_layout import CURVES_FILE, RESULTS_FILE
from .results import RunResults

STAGE_TITLES = {"distill": "attention distillation (feature maps only)", "finetune": "finetuning (task loss)"}


def loss_series(log_file: str | Path) -> dict[str, tuple[list[int], list[float]]]:
    """Per stage in log order: (steps, losses) as logged. Lines without a loss (or torn by a kill) are skipped."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for line in Path(log_file).read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict) or entry.get("loss") is None or "stage" not in entry:
            continue
        steps, losses = series.setdefault(entry["stage"], ([], []))
        steps.append(int(entry["step"]))
        losses.append(float(entry["loss"]))
    return series


def curves_png(log_file: str | Path, results: RunResults | None = None) -> bytes | None:
    """The curves of the steps in ``log_file`` as PNG bytes (the scores of ``results`` marked),
    or None when the log holds no step."""
    series = loss_series(log_file) if Path(log_file).is_file() else {}
    return _render(series, results) if series else None


def write_curves(run_dir: str | Path, log_file: str | Path, results: RunResults | None = None) -> Path | None:
    """Write ``run_dir/curves.png`` (atomically) from the run's step log, scores from ``results``
    (default: the run's results.json, if any); None (nothing written) when the log holds no step."""
    run_dir = Path(run_dir)
    results_file = run_dir / RESULTS_FILE
    if results is None and results_file.is_file():
        results = RunResults.read(results_file)
    png = curves_png(log_file, results)
    if png is None:
        return None
    path = run_dir / CURVES_FILE
    atomic_write_bytes(path, png)
    return path


def _render(series: dict, results: RunResults | None) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    stages = list(series)
    fig = Figure(figsize=(5.2 * len(stages), 3.6))
    FigureCanvasAgg(fig)  # the Agg canvas, without pyplot's global state or a display
    axes = fig.subplots(1, len(stages), squeeze=False)[0]
    for ax, stage in zip(axes, stages):
        steps, losses = series[stage]
        ax.plot(steps, losses, color="#1f77b4", linewidth=1.2, marker="." if len(steps) < 30 else None)
        ax.set_title(STAGE_TITLES.get(stage, stage), fontsize=10)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
    if results is not None:
        _mark_score(axes[-1], series[stages[-1]][0][-1], results)
        fig.suptitle(f"{results.method} on {results.task}", fontsize=11)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    return buffer.getvalue()


def _mark_score(ax, last_step: int, results: RunResults) -> None:
    """The evaluation after the last step, on a second y axis: the converted score as a star, the teacher's as a line."""
    metric, teacher, converted = results.headline_metric, results.teacher_score, results.converted_score
    score_ax = ax.twinx()
    score_ax.axhline(teacher, color="#888888", linestyle="--", linewidth=1, label=f"teacher {metric} {teacher:.4f}")
    score_ax.plot([last_step], [converted], marker="*", markersize=14, color="#d62728",
                  linestyle="none", label=f"converted {metric} {converted:.4f}")
    score_ax.margins(y=0.25)  # neither mark on the frame
    score_ax.set_ylabel(f"eval {metric}", color="#d62728")
    score_ax.legend(loc="center right", fontsize=8)
