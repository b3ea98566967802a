"""``luna-convert compare``: several methods on one case, the same budget, one table.

Each (method, seed) is an ordinary run (``pipeline.run_conversion``) in its own
folder under the comparison folder, so a comparison that stops part-way is
continued by running the same command again: finished runs are read back, not
re-run. The control row (``softmax``) is the original model finetuned with the
same budget unconverted: scores above 100 % recovered then show up as the extra
training, not as a better attention.
"""

from __future__ import annotations

import copy
import math
from dataclasses import fields, replace
from pathlib import Path

from ..errors import LunaConvertError
from ..fileio import atomic_write_json, atomic_write_text
from ..folder_layout import COMPARE_FILE, PLOT_FILE, RESULTS_FILE, TABLE_FILE
from .config import AUTO_LAYERS, CONTROL_METHOD, CONVERT_KEYWORD_OPTIONS, RunConfig
from .pipeline import run_conversion
from .results import RunResults
from ..linear_methods.base import AttentionOptions
from ..linear_methods.registry import get_method

# Options every method takes (the layer's own: dwc, eps, window, ...; and convert's keywords): a compare
# gives them to every method, the rest of method_options only to the configured method.
SHARED_OPTIONS = frozenset(f.name for f in fields(AttentionOptions)) | frozenset(CONVERT_KEYWORD_OPTIONS)

STAGES = ("after_conversion", "after_distillation", "final")


def run_dir_for(folder: Path, method: str, seed: int) -> Path:
    return folder / f"{method}-seed{seed}"


def options_for(config: RunConfig, method: str) -> dict:
    """The method options of ``method``'s run: all of ``config.method_options`` for the configured method,
    only the shared ones (``SHARED_OPTIONS``) for another method, none for the softmax control."""
    if method == CONTROL_METHOD:
        return {}
    if method == config.method:
        return copy.deepcopy(config.method_options)
    return {k: copy.deepcopy(v) for k, v in config.method_options.items() if k in SHARED_OPTIONS}


def run_compare(config: RunConfig, methods: list[str], seeds: list[int], folder: Path, control: bool = True,
                console=None) -> dict:
    """Run every method (and the control) for every seed into ``folder``; returns compare.json's content."""

    if config.keep_softmax_layers == AUTO_LAYERS:
        raise LunaConvertError("compare runs every method with the same layers kept softmax: choose them per method "
                               "with `luna-convert run --keep-softmax-layers auto`, then pass the list")
    checked = {}  # method -> its runs' config, its options validated once here (each run gets a copy)
    for method in methods:
        get_method(method)  # an unknown name fails before any run starts
        # so does an option the method refuses (e.g. a window for a kernel method): its run's config is checked
        checked[method] = replace(copy.deepcopy(config), method=method, method_options=options_for(config, method))
        checked[method].validate()
    if not seeds:
        raise LunaConvertError("compare needs at least one seed (--seeds 0,1,2)")
    say = console.print if console is not None else (lambda *a, **k: None)
    runs: dict[str, list[RunResults]] = {}
    order = ([CONTROL_METHOD] if control else []) + list(methods)
    for seed in seeds:
        for method in order:
            run_dir = run_dir_for(folder, method, seed)
            if (run_dir / RESULTS_FILE).is_file():
                say(f"{method} seed {seed}: finished earlier, read from {run_dir}")
                results = RunResults.read(run_dir / RESULTS_FILE)
            else:
                # a copy: each run fills in its own settings (the method's recipe, own-data choices)
                cfg = config.control() if method == CONTROL_METHOD else copy.deepcopy(checked[method])
                cfg.seed, cfg.run_dir, cfg.overwrite = seed, str(run_dir), True
                dropped = sorted(set(config.method_options) - set(cfg.method_options))
                if dropped and method != CONTROL_METHOD:
                    say(f"{method}: method_options {', '.join(dropped)} are {config.method}'s own, not given to "
                        f"{method} (set them with --methods {config.method} alone)")
                say(f"[bold]{method}[/] seed {seed} -> {run_dir}")
                results = run_conversion(cfg, console=console)
            runs.setdefault(method, []).append(results)
    summary = {"case": config.name or config.model, "seeds": seeds, "methods": order,
               "rows": [summarise(method, runs[method]) for method in order],
               "runs": {m: [r.run_dir for r in rs] for m, rs in runs.items()}}
    control_final = next((r["final"]["mean"] for r in summary["rows"] if r["method"] == CONTROL_METHOD), None)
    for row in summary["rows"]:
        row["pct_of_control"] = (100 * row["final"]["mean"] / control_final
                                 if control_final and row["final"]["mean"] is not None else None)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / COMPARE_FILE, summary)
    atomic_write_text(folder / TABLE_FILE, markdown_table(summary) + "\n")
    write_plot(summary, folder / PLOT_FILE)
    return summary


def mean_std(values: list[float | None]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "std": None, "n": 0}
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return {"mean": mean, "std": std, "n": len(values)}


def summarise(method: str, results: list[RunResults]) -> dict:
    """One table row: mean and spread over seeds of every stage score, % recovered and seconds per step."""
    row = {"method": method, "headline_metric": results[0].headline_metric,
           "teacher": mean_std([r.teacher_score for r in results]),
           "recovered_pct": mean_std([r.recovered_pct for r in results])}
    for stage in STAGES:
        row[stage] = mean_std([r.stage_score(stage) for r in results])
    row["distill_steps"] = results[0].steps.distill
    row["finetune_steps"] = results[0].steps.finetune
    row["s_per_finetune_step"] = mean_std([r.timings.finetune_s / max(1, r.steps.finetune)
                                           if r.timings.finetune_s is not None else None for r in results])
    # Runs written before the per-head fit was recorded have none (`luna-convert eval RUN --heads` computes it).
    row["attention_kl"] = mean_std([r.attention_kl for r in results])
    return row


def _fmt(stat: dict, digits: int = 4) -> str:
    if stat["mean"] is None:
        return "-"
    if stat["n"] > 1:
        return f"{stat['mean']:.{digits}f} ± {stat['std']:.{digits}f}"
    return f"{stat['mean']:.{digits}f}"


def markdown_table(summary: dict) -> str:
    metric = summary["rows"][0]["headline_metric"] if summary["rows"] else "score"
    head = (f"| method | teacher {metric} | right after conversion | after distillation | final | % recovered "
            f"| % of control | attention KL | distil + finetune steps | s / finetune step |")
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in summary["rows"]:
        control = "-" if row["pct_of_control"] is None else f"{row['pct_of_control']:.1f}"
        lines.append(
            f"| {row['method']} | {_fmt(row['teacher'])} | {_fmt(row['after_conversion'])} | "
            f"{_fmt(row['after_distillation'])} | {_fmt(row['final'])} | {_fmt(row['recovered_pct'], 1)} | {control} | "
            f"{_fmt(row['attention_kl'], 3)} | {row['distill_steps']} + {row['finetune_steps']} | {_fmt(row['s_per_finetune_step'], 2)} |")
    n = len(summary["seeds"])
    lines.append("")
    lines.append(f"{n} seed{'s' if n > 1 else ''} ({', '.join(map(str, summary['seeds']))}); mean ± sample std where "
                 "several. % of control: final / the softmax control's final score. attention KL: "
                 "KL(softmax || linear) per attention row, mean over heads, after training (the per-head table: "
                 "`luna-convert eval RUN --heads`).")
    return "\n".join(lines)


def write_plot(summary: dict, path: Path) -> None:
    """Bars of % recovered per method, with the seed spread as error bars."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [r for r in summary["rows"] if r["recovered_pct"]["mean"] is not None]
    fig = Figure(figsize=(1.2 + 0.9 * len(rows), 3.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.bar([r["method"] for r in rows], [r["recovered_pct"]["mean"] for r in rows],
           yerr=[r["recovered_pct"]["std"] for r in rows], color="#4c72b0", capsize=3)
    ax.axhline(100, color="black", lw=0.8, ls="--")
    low = min([r["recovered_pct"]["mean"] for r in rows] + [100])
    ax.set_ylim(max(0, low - 10), None)
    ax.set_ylabel("% of the teacher recovered")
    ax.set_title(f"{summary['case']}: {len(summary['seeds'])} seed(s)")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)
