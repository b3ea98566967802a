"""``luna-convert lra TASK``: train the small LRA encoder from scratch with one attention method.

The run folder is a conversion run's: config.json (written first), train_log.jsonl, checkpoints/ with
trainer_state.json (``--resume``), curves.png, model/ and results.json last (it marks the run finished), with
the keys ``luna-convert report`` and ``compare`` read. The loop is the conversions' (``engine.training.finetune``:
AdamW, warmup and schedule, gradient clipping, accelerate checkpoints), and so is the scoring
(``engine.scoring.score``). LRA has no original model: the "teacher" score of these results is the
majority-class accuracy on the reported split (what a model that learned nothing scores), and % recovered is
None.
"""

from __future__ import annotations

import json
import resource
import shutil
import time
from datetime import datetime
from pathlib import Path

import torch

from ..engine.scoring import score
from ..engine.training import finetune, read_trainer_state
from ..errors import LunaConvertError
from ..fileio import atomic_write_json, keep_log_entries
from ..folder_layout import CONFIG_FILE, CURVES_FILE, LOG_FILE, MODEL_DIR, RESULTS_FILE, STATE_FILE, WEIGHTS_FILE
from ..run.plots import write_curves
from ..run.results import RunResults, StepCounts, Timings
from ..serialization import library_versions
from ..task_kinds import kind_of
from ..tasks import TaskSpec
from .config import LRAConfig
from .data import build_splits, default_cache_dir, make_loader, split_summary, task_info
from .model import LRAEncoder

ENCODER_FILE = "lra_encoder.json"  # beside the weights in model/: what rebuilds the encoder
RUN_ARTEFACTS = (RESULTS_FILE, CONFIG_FILE, LOG_FILE, STATE_FILE, MODEL_DIR, "checkpoints", CURVES_FILE)


def peak_rss_mb() -> float:
    """The process's peak resident set size so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def lra_task_spec(task: str, num_classes: int) -> TaskSpec:
    """Scored as an image task (accuracy, and top-5 with five classes or more)."""
    return TaskSpec(f"lra-{task}", "image", num_labels=num_classes)


def majority_accuracy(train_labels, eval_labels) -> float:
    """Accuracy of always answering the training split's most common class."""
    import numpy as np

    majority = int(np.bincount(train_labels).argmax())
    return float(np.mean(np.asarray(eval_labels) == majority))


def prepare_run_dir(config: LRAConfig, resume: Path | None) -> tuple[Path, LRAConfig]:
    """The run folder (and, on resume, the config saved there); bad folders are refused before any work."""
    if resume is not None:
        run_dir = Path(resume)
        if not (run_dir / CONFIG_FILE).is_file():
            raise LunaConvertError(f"cannot resume {run_dir}: no {CONFIG_FILE} there; pass an LRA run folder")
        if (run_dir / RESULTS_FILE).is_file():
            raise LunaConvertError(f"{run_dir} already finished (it has {RESULTS_FILE}); nothing to resume")
        if not (run_dir / STATE_FILE).is_file():
            raise LunaConvertError(f"nothing to resume in {run_dir}: no checkpoint was written "
                                   "(set train.checkpoint_every); start a new run")
        try:
            saved = json.loads((run_dir / CONFIG_FILE).read_text())
        except (OSError, ValueError) as e:
            raise LunaConvertError(f"run config {run_dir / CONFIG_FILE} is unreadable ({type(e).__name__})") from None
        return run_dir, LRAConfig.from_dict(saved)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(config.run_dir or Path(config.output_dir) / f"lra-{config.task}-{config.method}-{stamp}")
    if run_dir.exists() and not run_dir.is_dir():
        raise LunaConvertError(f"{run_dir} is a file; choose another run folder")
    if run_dir.is_dir() and any(run_dir.iterdir()):
        if not config.overwrite:
            raise LunaConvertError(f"{run_dir} already exists and is not empty; pass --overwrite to replace that run "
                                   "or choose another folder")
        foreign = sorted(p.name for p in run_dir.iterdir() if p.name not in RUN_ARTEFACTS and not p.name.startswith("."))
        if foreign:
            raise LunaConvertError(f"{run_dir} is not an LRA run folder (it holds {', '.join(foreign[:3])}); "
                                   "--overwrite only replaces a previous run")
    return run_dir, config


def clear_run_folder(run_dir: Path) -> None:
    for name in RUN_ARTEFACTS:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def forget_after_checkpoint(run_dir: Path, step: int) -> None:
    """On resume: drop log lines of steps after the last checkpoint (and a line torn by a kill)."""
    keep_log_entries(run_dir / LOG_FILE, lambda entry: entry.get("step", 0) <= step)


def build_model(config: LRAConfig, vocab: int, num_classes: int, max_length: int, pair: bool) -> LRAEncoder:
    return LRAEncoder(config.encoder, vocab, num_classes, max_length, config.method, config.attention_options(), pair)


def save_encoder(model: LRAEncoder, folder: Path, record: dict) -> None:
    from safetensors.torch import save_model

    tmp = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(model, str(tmp / WEIGHTS_FILE))
    atomic_write_json(tmp / ENCODER_FILE, record)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def run_lra(config: LRAConfig | None, resume: str | Path | None = None, console=None) -> RunResults:
    """Train and score one method on one LRA task; returns the results record (results.json's content)."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    t_start = time.perf_counter()
    run_dir, config = prepare_run_dir(config, Path(resume) if resume is not None else None)
    config.check()
    say = console.print if console is not None else (lambda *a, **k: None)
    info = task_info(config.task)
    t0 = time.perf_counter()
    cache = Path(config.cache_dir).expanduser() if config.cache_dir else default_cache_dir()
    splits = build_splits(config.task, config.data, config.data_dir, cache)
    data_s = time.perf_counter() - t0
    num_classes = info.num_classes or len(splits["train"].class_names)
    longest = max(max(len(s) for s in split.sequences + (split.pairs or [])) for split in splits.values())
    say(f"lra {config.task}: {', '.join(f'{len(s)} {n}' for n, s in splits.items())} examples, up to {longest} "
        f"tokens ({data_s:.1f} s)")
    accelerator = Accelerator(mixed_precision=config.train.mixed_precision,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(config.seed)
    model = build_model(config, info.vocab, num_classes, longest, info.pair)
    if resume is None:
        if config.overwrite and run_dir.is_dir():
            clear_run_folder(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(run_dir / CONFIG_FILE, config.to_dict())
    state = read_trainer_state(run_dir) if resume is not None else None
    start = state["step"] if state else 0
    if resume is not None:
        forget_after_checkpoint(run_dir, start)
    say(f"{'resuming' if start else 'run folder'} {run_dir}", soft_wrap=True)

    def log(entry: dict) -> None:
        with open(run_dir / LOG_FILE, "a") as f:
            f.write(json.dumps({"time": round(time.time(), 3), **entry}) + "\n")

    t = config.train
    params = sum(p.numel() for p in model.parameters())
    say(f"{config.method}: {params:,} parameters; training {t.max_steps} steps" + (f" from step {start}" if start else ""))
    train_loader = make_loader(splits["train"], t.batch_size, shuffle=True, seed=config.seed)
    set_seed(config.seed + 1)
    model, stage = finetune(accelerator, model, train_loader, steps=t.max_steps, lr=t.lr, weight_decay=t.weight_decay,
                            schedule=t.schedule, warmup_ratio=t.warmup_steps / t.max_steps,
                            max_grad_norm=t.max_grad_norm, run_dir=run_dir, checkpoint_every=t.checkpoint_every,
                            start_step=start, log=log)
    peak_train_mb = peak_rss_mb()
    order = [config.eval_split] + [s for s in ("test", "dev") if s != config.eval_split]
    loaders = {s: make_loader(splits[s], t.eval_batch_size, shuffle=False, seed=0) for s in order}
    t0 = time.perf_counter()
    task = lra_task_spec(config.task, num_classes)
    metrics, counted = score(accelerator, model, loaders, task, kind_of(task))
    eval_s = time.perf_counter() - t0
    unwrapped = accelerator.unwrap_model(model)
    baseline = majority_accuracy(splits["train"].labels, splits[config.eval_split].labels)
    other = order[1]
    steps_run = stage.steps - start
    lra = {"task": config.task, "eval_split": config.eval_split, "baseline": "majority class of train",
           "parameters": params, "max_positions": longest, "peak_rss_mb": peak_train_mb, "data_s": data_s,
           "s_per_step": stage.seconds / max(1, steps_run), "threads": torch.get_num_threads(),
           "attention_options": unwrapped.attention_options(),
           "data": {name: split_summary(split) for name, split in splits.items()},
           "class_names": splits["train"].class_names}
    results = RunResults(
        method=config.method, task=f"lra-{config.task}", headline_metric="accuracy", teacher_score=baseline,
        converted_score=metrics["accuracy"], run_dir=str(run_dir), recipe=config.name, model="lra-encoder",
        recovered_pct=None, stage_scores={f"{other}_accuracy": metrics[f"{other}/accuracy"], "final": metrics["accuracy"]},
        teacher_metrics={"accuracy": baseline}, converted_metrics=metrics, eval_examples=counted,
        steps=StepCounts(distill=0, finetune=stage.steps), final_loss=stage.final_loss,
        timings=Timings(finetune_s=stage.seconds, eval_s=eval_s, total_s=time.perf_counter() - t_start),
        seed=config.seed, num_processes=accelerator.num_processes, device=str(accelerator.device),
        config=config.to_dict(), versions=library_versions(), finished_at=datetime.now().astimezone().isoformat(),
        extra={"lra": lra})
    record = {"task": config.task, "method": config.method, "vocab": info.vocab, "num_classes": num_classes,
              "max_length": longest, "pair": info.pair, "encoder": results.config["encoder"],
              "method_options": unwrapped.attention_options()}
    save_encoder(unwrapped, run_dir / MODEL_DIR, record)
    write_curves(run_dir, run_dir / LOG_FILE, results)
    results.write(run_dir / RESULTS_FILE)  # last: it marks the run finished
    accelerator.end_training()
    return results


def summary_line(results: RunResults) -> str:
    """One line of a finished LRA run: its scores beside the majority-class baseline, its speed and memory."""
    lra = results.extra.get("lra", {})
    other = next((k for k in results.stage_scores if k != "final"), None)
    beside = f", {other.replace('_', ' ')} {results.stage_scores[other]:.4f}" if other else ""
    return (f"{results.task} {results.method}: {lra.get('eval_split', 'test')} accuracy "
            f"{results.converted_score:.4f}{beside} (majority class {results.teacher_score:.4f}); "
            f"{results.steps.finetune} steps, {lra.get('s_per_step', 0):.3f} s/step, peak RSS "
            f"{lra.get('peak_rss_mb', 0):.0f} MiB; {results.run_dir}")
