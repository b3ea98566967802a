"""``luna-convert lra TASK --methods A,B --seeds 0,1``: several methods on one task with the same recipe and budget.

Each (method, seed) is an ordinary LRA run in its own folder under the comparison folder, started as its own
process: its peak resident set size is then its own (a process's peak only grows, so runs in one process
would each report the largest so far). Finished runs are read back, not re-run, so a comparison that stops
part-way continues when the same command is run again. The table (compare.md, compare.json) gives the mean
and sample spread over seeds of the reported split's accuracy, the dev split's, seconds per step and peak RSS.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from ..errors import LunaConvertError
from ..fileio import atomic_write_json, atomic_write_text
from ..folder_layout import COMPARE_FILE, RESULTS_FILE, TABLE_FILE
from ..run.compare import mean_std
from ..run.results import RunResults
from .config import LRAConfig


def recipe_file(config: LRAConfig, path: Path) -> Path:
    """``config`` as a recipe file (what the run's process reads)."""
    import yaml

    data = {k: v for k, v in config.to_dict().items() if k not in ("run_dir", "overwrite")}
    atomic_write_text(path, yaml.safe_dump(data, sort_keys=False))
    return path


def run_one(config: LRAConfig, run_dir: Path, say) -> RunResults:
    if (run_dir / RESULTS_FILE).is_file():
        say(f"{config.method} seed {config.seed}: finished earlier, read from {run_dir}")
        return RunResults.read(run_dir / RESULTS_FILE)
    say(f"[bold]{config.method}[/] seed {config.seed} -> {run_dir}")
    recipe = recipe_file(config, run_dir.parent / f".{run_dir.name}.yaml")
    command = [sys.executable, "-m", "luna_convert", "lra", config.task, "--recipe", str(recipe),
               "--run-dir", str(run_dir), "--overwrite"]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or ["no output"])[-1]
        raise LunaConvertError(f"the {config.method} run (seed {config.seed}) in {run_dir} failed: {last}")
    recipe.unlink(missing_ok=True)
    return RunResults.read(run_dir / RESULTS_FILE)


def summarise(method: str, runs: list[RunResults]) -> dict:
    lra = [r.extra.get("lra", {}) for r in runs]
    dev_key = next(k for k in runs[0].stage_scores if k != "final")
    return {"method": method, "split": lra[0].get("eval_split", "test"),
            "accuracy": mean_std([r.converted_score for r in runs]),
            "other_split": dev_key.removesuffix("_accuracy"),
            "other_accuracy": mean_std([r.stage_scores.get(dev_key) for r in runs]),
            "majority": runs[0].teacher_score, "steps": runs[0].steps.finetune,
            "s_per_step": mean_std([x.get("s_per_step") for x in lra]),
            "peak_rss_mib": mean_std([x.get("peak_rss_mb") for x in lra]),
            "runs": [r.run_dir for r in runs]}


def fmt(stat: dict, digits: int = 4) -> str:
    if stat["mean"] is None:
        return "-"
    return f"{stat['mean']:.{digits}f}" + (f" ± {stat['std']:.{digits}f}" if stat["n"] > 1 else "")


def markdown_table(summary: dict) -> str:
    rows = summary["rows"]
    split, other = rows[0]["split"], rows[0]["other_split"]
    lines = [f"| method | {split} accuracy | {other} accuracy | steps | s / step | peak RSS MiB |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        lines.append(f"| {row['method']} | {fmt(row['accuracy'])} | {fmt(row['other_accuracy'])} | {row['steps']} | "
                     f"{fmt(row['s_per_step'], 2)} | {fmt(row['peak_rss_mib'], 0)} |")
    n = len(summary["seeds"])
    lines += ["", f"lra {summary['task']} ({summary['recipe']}); {n} seed{'s' if n > 1 else ''} "
              f"({', '.join(map(str, summary['seeds']))}), mean ± sample std where several; majority class "
              f"{rows[0]['majority']:.4f}."]
    return "\n".join(lines)


def run_lra_compare(config: LRAConfig, methods: list[str], seeds: list[int], folder: Path, console=None) -> dict:
    """Every method for every seed into ``folder``; returns compare.json's content."""
    if not methods or not seeds:
        raise LunaConvertError("an LRA comparison needs methods and seeds (--methods softmax,luna --seeds 0,1)")
    for method in methods:  # an unknown method or a bad option fails before any run starts
        replace(copy.deepcopy(config), method=method).check()
    say = console.print if console is not None else (lambda *a, **k: None)
    folder.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[RunResults]] = {}
    for seed in seeds:
        for method in methods:
            cfg = replace(copy.deepcopy(config), method=method, seed=seed, run_dir=None, overwrite=None)
            runs.setdefault(method, []).append(run_one(cfg, folder / f"{method}-seed{seed}", say))
    summary = {"task": config.task, "recipe": config.name, "seeds": seeds, "methods": methods,
               "rows": [summarise(m, runs[m]) for m in methods]}
    atomic_write_json(folder / COMPARE_FILE, summary)
    atomic_write_text(folder / TABLE_FILE, markdown_table(summary) + "\n")
    return summary
