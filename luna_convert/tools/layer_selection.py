"""``keep_softmax_layers: auto``: the fewest attention layers left softmax whose hybrid keeps a target score.

The search, each step an ordinary run (``pipeline``) in its own folder under ``RUN/selection/``, trained on
the training data less a seeded held-out part (``layer_selection.holdout``) and scored on that part, never on
the split the run reports:

1. the control: the unconverted model finetuned with the same budget (``softmax``);
2. every attention layer converted (``keep-none``);
3. the layers ranked: that model scored with each converted layer alone restored to exact softmax
   (``AttentionMode.SOFTMAX``, no training), the layer whose restoring helps most first;
4. candidates growing in rank order ({r1}, {r1, r2}, ...) until one reaches ``target_pct`` % of the control's
   score on the held-out part.

Then the chosen set's full run (all the training data, the reported split) in ``RUN`` itself, checked against
the control's full run (``selection/softmax-full``): below the target there, the next layer in rank order is
added and the full run repeated, and the console says so. The frontier (each set: layers kept, held-out score,
% of control, forward time against the original at the run's length and at ``layer_selection.time_lengths``,
timed on randomly initialised copies of the architecture with enough positions, as ``luna-convert bench``
does) goes to ``layer_selection.json`` and ``.md`` and to results.json's ``layer_selection``.

A search that stops part-way continues with ``luna-convert run --resume RUN``: finished runs are read back
(as ``compare`` does), an unfinished one is run again.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Callable

from ..adapters.registry import find_adapter
from ..conversion import convert
from ..engine.scoring import score
from ..errors import LunaConvertError
from ..fileio import atomic_write_json, atomic_write_text
from ..folder_layout import CONFIG_FILE, MODEL_DIR, RESULTS_FILE, SELECTION_DIR, SELECTION_FILE, SELECTION_TABLE
from ..layers.attention import AttentionMode, attention_mode
from ..metrics import headline_metric, recovered_pct
from ..model_building import TIMM_ARGS_ATTR, create_timm_model, timm_create_args
from ..run.config import AUTO_LAYERS, RunConfig
from ..run.model_card import write_model_card
from ..run import pipeline
from ..task_kinds import kind_of
from ..run.pipeline import check_run_folder, clear_run_folder, distill_steps, evaluate_model, new_run_dir
from ..run.results import RunResults
from ..serialization import load
from .bench.models import inference_fn
from .bench.timing import Clock, median_ms, round_robin

CONTROL, CONTROL_FULL, NONE_KEPT = "softmax", "softmax-full", "keep-none"


def wants_selection(config: RunConfig | None, resume) -> bool:
    """Whether this run is a layer selection: ``keep_softmax_layers: auto``, or a resumed folder holding one."""
    if resume is not None:
        return (Path(resume) / SELECTION_DIR / CONFIG_FILE).is_file()
    return config is not None and config.keep_softmax_layers == AUTO_LAYERS


def candidate_name(kept: list[int]) -> str:
    return "keep-" + "-".join(map(str, kept)) if kept else NONE_KEPT


def pct_of(value: float | None, control: float | None, metric: str) -> float | None:
    return None if value is None or control is None else recovered_pct(value, control, metric)


class Selection:
    """One search: its settings, folder and console, and the runs it has made (read back when finished)."""

    def __init__(self, config: RunConfig, run_dir: Path, say: Callable, run_one: Callable):
        self.config, self.run_dir, self.say, self.run = config, run_dir, say, run_one
        self.settings = config.layer_selection
        self.folder = run_dir / SELECTION_DIR
        self.record_path = run_dir / SELECTION_FILE
        self.record = _read(self.record_path) if self.record_path.is_file() else {}

    # ------------------------------------------------------------ runs
    def candidate_config(self, kept: list[int] | None, name: str, full: bool = False) -> RunConfig:
        """A copy of the search's config for one run: ``kept`` None is the softmax control."""
        if kept is None:
            cfg = self.config.control()
        else:
            cfg = replace(copy.deepcopy(self.config), keep_softmax_layers=list(kept))
        cfg.run_dir, cfg.overwrite = str(self.folder / name), True
        cfg.selection = None if full else {"role": "candidate", "holdout": self.settings.holdout}
        return cfg

    def results_of(self, name: str, cfg: RunConfig, what: str) -> RunResults:
        """The run ``name``: read back when it finished earlier, else run now (from the start)."""
        done = self.folder / name / RESULTS_FILE
        if done.is_file():
            self.say(f"{what}: finished earlier, read from {done.parent}")
            return RunResults.read(done)
        self.say(f"[bold]{what}[/] -> {done.parent}")
        return self.run(cfg, None)

    def candidate(self, kept: list[int], step: str) -> RunResults:
        name = candidate_name(kept)
        return self.results_of(name, self.candidate_config(kept, name), f"{step} keep softmax {kept or 'none'}")

    # ------------------------------------------------------------ steps
    def state_cost(self, layers: int | None) -> None:
        t = self.config.train
        finetune = f"{t.max_steps} finetuning steps" if t.max_steps is not None else f"{t.epochs:g} epochs"
        held = f"{100 * self.settings.holdout:g} %"
        most = "L + 1 (L: the model's attention layers)" if layers is None else str(layers + 1)
        self.say(f"layer selection, target {self.settings.target_pct:g} % of the softmax control: the control "
                 f"and up to {most} candidate runs ({distill_steps(self.config)} distillation steps + {finetune} "
                 f"each, on the training data less a held-out {held}), one scoring pass of the held-out part per "
                 f"converted layer, then the control's and the chosen set's full runs (one more full run for each "
                 f"layer added if the chosen set misses the target on the reported split)")

    def rank_layers(self, none_kept: RunResults) -> list[dict]:
        """Each converted layer's held-out score with it alone restored to softmax, best first (kept in the
        record: the scoring passes are not repeated on resume)."""
        if "ranking" in self.record:
            return self.record["ranking"]
        self.say("ranking the layers: the all-linear model scored with each layer alone restored to softmax")
        restored = evaluate_model(none_kept.run_dir, max_examples=self.config.train.max_eval_examples,
                                  inspect=restored_layer_scores)["inspected"]
        base = none_kept.converted_score
        ranking = [{"layer": int(layer), "restored_score": s, "gain": pct_of(s, base, none_kept.headline_metric)}
                   for layer, s in restored.items()]
        ranking.sort(key=lambda r: -(r["gain"] if r["gain"] is not None else float("-inf")))
        self.record["ranking"] = ranking
        self.save()
        for r in ranking:
            self.say(f"  layer {r['layer']}: {none_kept.headline_metric} {r['restored_score']:.4f} restored")
        return ranking

    def search(self) -> dict:
        """Steps 1-4 of the module docstring; returns the record with the frontier and the chosen set."""
        self.state_cost(self.record.get("layers"))
        control = self.results_of(CONTROL, self.candidate_config(None, CONTROL), "[1] control (softmax)")
        metric, target = control.headline_metric, self.settings.target_pct
        self.record.update(target_pct=target, holdout=self.settings.holdout, headline_metric=metric,
                           control_score=control.converted_score)
        self.say(f"the original model scores {control.teacher_score:.4f} on the held-out part: a model finetuned on "
                 "this training data has seen it, so scores there read high; the full run checks on the reported "
                 "split")
        frontier = []

        def add(results: RunResults, kept: list[int]) -> bool:
            pct = pct_of(results.converted_score, control.converted_score, metric)
            frontier.append({"kept": kept, "score": results.converted_score, "pct_of_control": pct,
                             "run_dir": results.run_dir})
            self.record["frontier"] = frontier
            self.save()
            self.say(f"  keep softmax {kept or 'none'}: {metric} {results.converted_score:.4f}, "
                     f"{_pct(pct)} of control (target {target:g} %)")
            return pct is not None and pct >= target

        none_kept = self.candidate([], "[2]")
        conv = none_kept.conversion
        self.record["layers"] = layers = len(conv.modules) + len(conv.kept_local) + len(conv.kept_softmax)
        self.say(f"{layers} attention layers, {len(conv.modules)} converted: at most {len(conv.modules) - 1} more "
                 f"candidate runs")
        reached = add(none_kept, [])
        ranking = [] if reached else self.rank_layers(none_kept)
        kept: list[int] = []
        for i, row in enumerate(ranking[:len(conv.modules) - 1]):  # at least one layer stays linear
            if reached:
                break
            kept = sorted(kept + [row["layer"]])
            reached = add(self.candidate(kept, f"[{3 + i}]"), kept)
        if not reached:
            self.say(f"no candidate reached {target:g} % of the control on the held-out part; going on with "
                     f"the last one tried, keep softmax {kept or 'none'}")
        self.record.update(chosen=kept, reached_on_held_out=reached)
        self.save()
        return self.record

    def verify(self, chosen: list[int]) -> RunResults:
        """The chosen set's full run in RUN, against the control's full run; below the target, the next ranked
        layer is added and the full run repeated."""
        control = self.results_of(CONTROL_FULL, self.candidate_config(None, CONTROL_FULL, full=True),
                                  "control (softmax), full run")
        metric, target = control.headline_metric, self.settings.target_pct
        self.record["control_full_score"] = control.converted_score
        attempts = self.record.setdefault("attempts", [])
        kept = list(self.record.get("trying", chosen))  # a resumed search goes on with the set it was running
        while True:
            self.record["trying"] = kept
            self.save()
            results = self.final_run(kept)
            pct = pct_of(results.converted_score, control.converted_score, metric)
            if not attempts or attempts[-1]["kept"] != kept:
                attempts.append({"kept": kept, "score": results.converted_score, "pct_of_control": pct})
            self.say(f"full run, keep softmax {kept or 'none'}: {metric} {results.converted_score:.4f}, "
                     f"{_pct(pct)} of the control's full run {control.converted_score:.4f} (target {target:g} %)")
            reached = pct is not None and pct >= target
            left = [] if reached or len(kept) + 1 >= self.record["layers"] else [
                r["layer"] for r in self.rank_layers(RunResults.read(self.folder / NONE_KEPT / RESULTS_FILE))
                if r["layer"] not in kept]
            if not left:
                self.record.update(chosen=kept, verified=reached)
                if not self.record["verified"]:
                    self.say(f"the full run misses {target:g} % and no layer is left to add: kept {kept}")
                self.save()
                return results
            kept = sorted(kept + [left[0]])
            self.say(f"[bold]below the target on the reported split[/]: adding layer {left[0]}, full run again "
                     f"with keep softmax {kept}")
            self.save()

    def final_run(self, kept: list[int]) -> RunResults:
        """The full run of ``kept`` in RUN: read back if it finished with that set, resumed if it was stopped
        with it, else run (replacing an earlier attempt's files, never the search's)."""
        done, config_file = self.run_dir / RESULTS_FILE, self.run_dir / CONFIG_FILE
        saved = _read(config_file) if config_file.is_file() else {}
        same = saved.get("keep_softmax_layers") == kept and (saved.get("selection") or {}).get("role") == "final"
        if same and done.is_file():
            return RunResults.read(done)
        if same:
            self.say(f"resuming the full run with keep softmax {kept}")
            return self.run(None, self.run_dir)
        cfg = replace(copy.deepcopy(self.config), keep_softmax_layers=kept, run_dir=str(self.run_dir), overwrite=True)
        cfg.selection = {"role": "final", "target_pct": self.settings.target_pct, "kept": kept,
                         "file": SELECTION_FILE}
        return self.run(cfg, None)

    def save(self) -> None:
        atomic_write_json(self.record_path, self.record)
        atomic_write_text(self.run_dir / SELECTION_TABLE, markdown(self.record) + "\n")


def run_selection(config: RunConfig | None, resume=None, console=None) -> RunResults:
    """The whole search, then the verified full run in the run folder (new, or ``resume``: a search's folder)."""
    say = console.print if console is not None else (lambda *a, **k: None)
    if resume is not None:
        run_dir = Path(resume)
        record = _read(run_dir / SELECTION_FILE) if (run_dir / SELECTION_FILE).is_file() else {}
        if (run_dir / RESULTS_FILE).is_file() and "verified" in record:
            raise LunaConvertError(f"{run_dir} already finished (it has {RESULTS_FILE}); nothing to resume: read its "
                                   f"{SELECTION_TABLE} and results")
        config = RunConfig.from_dict(_read(run_dir / SELECTION_DIR / CONFIG_FILE))
    else:
        if config.keep_softmax_layers != AUTO_LAYERS:
            raise LunaConvertError("keep_softmax_layers is a list here; auto chooses the layers itself")
        config.check_runnable()
        run_dir = Path(config.run_dir or new_run_dir(config))
        if check_run_folder(run_dir, config.overwrite):
            clear_run_folder(run_dir)
        config = replace(copy.deepcopy(config), run_dir=str(run_dir))
        (run_dir / SELECTION_DIR).mkdir(parents=True, exist_ok=True)
        atomic_write_json(run_dir / SELECTION_DIR / CONFIG_FILE, config.to_dict())
    say(f"layer selection in {run_dir}", soft_wrap=True)
    selection = Selection(config, run_dir, say, lambda cfg, again: pipeline.run_conversion(cfg, resume=again,
                                                                                      console=console))
    record = selection.record if "trying" in selection.record else selection.search()
    results = selection.verify(record["chosen"])
    if "timing" not in selection.record:
        say("timing every set tried: its forward against the original's (random weights)")
        selection.record["timing"] = time_frontier(config, selection.record)
    selection.save()
    results = replace(results, layer_selection=summary(selection.record))
    results.write(run_dir / RESULTS_FILE)
    write_model_card(run_dir, results)
    say(markdown(selection.record), soft_wrap=True, highlight=False)
    say(f"layer selection: keep softmax {record['chosen'] or 'none'}; frontier in {run_dir / SELECTION_TABLE}",
        soft_wrap=True)
    return results


def run(config: RunConfig | None, resume=None, console=None) -> RunResults:
    """``luna-convert run``: a layer selection where asked for (or resumed), else one ordinary run."""
    if wants_selection(config, resume):
        return run_selection(config, resume, console)
    return pipeline.run_conversion(config, resume=resume, console=console)  # looked up now: what tests patch


def summary(record: dict) -> dict:
    """results.json's ``layer_selection``: the target, the chosen set, whether the full run reached it, the
    frontier (what the file holds, less the run folders)."""
    keys = ("target_pct", "holdout", "headline_metric", "chosen", "verified", "control_score",
            "control_full_score", "ranking", "frontier", "attempts", "timing")
    out = {k: record.get(k) for k in keys}
    out["frontier"] = [{k: v for k, v in row.items() if k != "run_dir"} for row in record.get("frontier", [])]
    out["file"] = SELECTION_FILE
    return out


# ---------------------------------------------------------------- layers
def restored_layer_scores(accelerator, model, eval_loaders: dict, task) -> dict[int, float]:
    """Per converted attention layer (its keep_softmax_layers index): the headline score with that layer alone
    computing exact softmax (``evaluate_model``'s ``inspect``)."""
    import torch

    attention = [m for _, m in model.named_modules() if getattr(m, "linear_attn", None) is not None
                 or find_adapter(m) is not None]
    out = {}
    for index, module in enumerate(attention):
        layer = getattr(module, "linear_attn", None)
        if layer is None:
            continue  # left softmax already (a local layer)
        with torch.no_grad(), attention_mode([layer], AttentionMode.SOFTMAX):
            metrics, _ = score(accelerator, model, eval_loaders, task, kind_of(task))
        out[index] = metrics[headline_metric(task)]
    return out


# ---------------------------------------------------------------- timing
def long_copies(model, tokens: int):
    """(a randomly initialised copy of ``model``'s architecture that takes about ``tokens`` tokens, its inputs
    [batch 1], the tokens it takes), as ``luna-convert bench`` builds them: positions (text) or image size (ViT,
    timm ViT) raised; None for an architecture it cannot rebuild."""
    import torch

    if type(model).__module__.startswith("timm.") or hasattr(model, TIMM_ARGS_ATTR):
        args = timm_create_args(model)
        patch = model.patch_embed.patch_size[0]
        side = max(1, round(math.sqrt(tokens)))
        torch.manual_seed(0)
        copied = create_timm_model(**{**args, "img_size": side * patch}).eval()
        return copied, {"x": torch.randn(1, 3, side * patch, side * patch)}, side * side + copied.num_prefix_tokens
    cfg = copy.deepcopy(getattr(model, "config", None))
    if cfg is None or not hasattr(cfg, "to_dict"):
        return None
    if hasattr(cfg, "image_size") and hasattr(cfg, "patch_size"):
        side = max(1, round(math.sqrt(tokens)))
        cfg.image_size = side * cfg.patch_size
        inputs = {"pixel_values": torch.randn(1, getattr(cfg, "num_channels", 3), cfg.image_size, cfg.image_size)}
        tokens = side * side + 1
    elif hasattr(cfg, "max_position_embeddings"):
        cfg.max_position_embeddings = max(cfg.max_position_embeddings, tokens + 2)  # + 2: RoBERTa's offset
        inputs = {"input_ids": torch.randint(5, cfg.vocab_size, (1, tokens))}
    else:
        return None
    torch.manual_seed(0)
    return type(model)(cfg).eval(), inputs, tokens


def own_length(model, config: RunConfig) -> int:
    """The tokens of the run's inputs: patches of its images (a ViT), else ``train.max_length``."""
    grid = getattr(getattr(model, "patch_embed", None), "grid_size", None)  # timm
    if grid is not None:
        return int(grid[0] * grid[1])
    cfg = getattr(model, "config", None)
    if getattr(cfg, "image_size", None) and getattr(cfg, "patch_size", None):
        return (cfg.image_size // cfg.patch_size) ** 2
    return config.train.max_length


def time_frontier(config: RunConfig, record: dict, repeats: int = 3, warmup: int = 1) -> list[dict]:
    """Per length (the run's, then ``layer_selection.time_lengths``): the original's forward and that of each set
    tried (the frontier's, then the full runs'), median ms, timed round-robin on one copy of the architecture
    (random weights)."""
    import torch

    frontier = record.get("frontier") or []
    if not frontier:
        return []
    sets: list[list[int]] = []
    for kept in [row["kept"] for row in frontier] + [a["kept"] for a in record.get("attempts") or []]:
        if kept not in sets:
            sets.append(kept)
    model = load(Path(frontier[0]["run_dir"]) / MODEL_DIR)
    own_tokens = own_length(model, config)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # On the CPU: one thread and its CPU time, as `luna-convert bench --threads 1 --timer cpu` (a shared machine's
    # other work leaves the figures alone)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        return _time_sets(config, model, sets, own_tokens, device, repeats, warmup)
    finally:
        torch.set_num_threads(threads)


def _time_sets(config: RunConfig, model, sets: list[list[int]], own_tokens: int, device, repeats: int,
               warmup: int) -> list[dict]:
    rows = []
    for n in [own_tokens, *config.layer_selection.time_lengths]:
        built = long_copies(model, n)
        if built is None:
            return [{"skipped": f"{type(model).__name__}: no transformers config or timm arguments to build a long "
                                "copy from"}]
        original, inputs, tokens = built
        fns = {"original": inference_fn(original.to(device), {k: v.to(device) for k, v in inputs.items()})}
        for kept in sets:
            hybrid = copy.deepcopy(original)
            convert(hybrid, config.method, keep_softmax_layers=kept, options=config.attention_options(),
                    **config.convert_keywords())
            fns[candidate_name(kept)] = inference_fn(hybrid.to(device), {k: v.to(device) for k, v in inputs.items()})
        times = round_robin(fns, Clock(device, cpu_time=True), repeats, warmup)
        base = median_ms(times["original"])
        clock = "CUDA events" if device.type == "cuda" else "one CPU thread, its CPU time"
        rows.append({"tokens": tokens, "original_ms": base, "device": str(device), "clock": clock,
                     "sets": {name: {"ms": median_ms(t), "ratio": median_ms(t) / base}
                              for name, t in times.items() if name != "original"}})
        del fns, original
    return rows


# ---------------------------------------------------------------- the table
def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} %"


def _time_cells(kept: list[int], timing: list[dict]) -> str:
    name = candidate_name(kept)
    return "".join(f" {t['sets'][name]['ms']:.1f} ms ({t['sets'][name]['ratio']:.2f}) |" if name in t["sets"]
                   else " - |" for t in timing)


def markdown(record: dict) -> str:
    """layer_selection.md: the frontier (held-out scores and forward times), then the full runs."""
    metric = record.get("headline_metric", "score")
    timing = [t for t in record.get("timing") or [] if "sets" in t]
    head = "| kept softmax | held-out " + metric + " | % of control |" + "".join(
        f" forward at {t['tokens']:,} tokens (x original) |" for t in timing)
    lines = [f"Target: {record.get('target_pct', '-')} % of the softmax control's {metric} "
             f"(held-out part of the training data: {record.get('control_score', float('nan')):.4f}).", "",
             head, "| --- | ---: | ---: |" + " ---: |" * len(timing)]
    for row in record.get("frontier", []):
        lines.append(f"| {row['kept'] or 'none'} | {row['score']:.4f} | {_pct(row['pct_of_control'])} |"
                     + _time_cells(row["kept"], timing))
    if timing:
        lines += ["", "Original: " + ", ".join(f"{t['original_ms']:.1f} ms at {t['tokens']:,} tokens" for t in timing)
                  + f" ({timing[0]['device']}, {timing[0].get('clock', 'wall clock')}, random weights, median of 3)."]
    skipped = [t["skipped"] for t in record.get("timing") or [] if "skipped" in t]
    lines += [f"Not timed: {skipped[0]}."] if skipped else []
    if record.get("ranking"):
        lines += ["", "Layers ranked by the held-out score of the all-linear model with that layer alone softmax: "
                  + ", ".join(f"{r['layer']} ({r['restored_score']:.4f})" for r in record["ranking"]) + "."]
    if record.get("attempts"):
        lines += ["", f"Full runs (reported split; the control's full run: {record.get('control_full_score', 0):.4f}):",
                  "", f"| kept softmax | {metric} | % of control |" + "".join(
                      f" forward at {t['tokens']:,} tokens (x original) |" for t in timing),
                  "| --- | ---: | ---: |" + " ---: |" * len(timing)]
        lines += [f"| {a['kept'] or 'none'} | {a['score']:.4f} | {_pct(a['pct_of_control'])} |"
                  + _time_cells(a["kept"], timing) for a in record["attempts"]]
    if "verified" in record:
        lines += ["", f"Chosen: keep softmax {record['chosen'] or 'none'}; "
                  + ("reaches" if record["verified"] else "misses") + " the target on the reported split."]
    return "\n".join(lines)


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise LunaConvertError(f"{path} is unreadable ({type(e).__name__}); restore it or start a new run") from None
