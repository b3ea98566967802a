"""The conversion job as named stages: resolve, pre-flight, load (and the original's score), convert, distil,
finetune, score, save (``STAGES``; each a function of the run and what the stages before it handed on).

``run_conversion(config)`` is what ``luna-convert RECIPE`` calls; ``evaluate_model``
is ``luna-convert eval``. Both work unchanged under ``accelerate launch``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from .autoconfig import needs_resolution, task_for
from ..conversion import ConversionReport, convert, feature_map_parameters, is_converted
from ..errors import LunaConvertError, RunInterrupted
from ..fileio import atomic_write_json, keep_log_entries
from ..folder_layout import (CONFIG_FILE, CONVERSION_FILE, CURVES_FILE, DISTILLED_DIR, LOG_FILE, MODEL_CARD_FILE,
                             MODEL_DIR, RESULTS_FILE, SELECTION_DIR, SELECTION_FILE, SELECTION_TABLE, STAGES_FILE,
                             STATE_FILE, TEACHER_FILE, WEIGHTS_FILE)
from ..linear_methods.registry import get_method
from ..metrics import headline_metric, recovered_pct
from .config import AUTO_LAYERS, CONTROL_METHOD, RunConfig
from .model_card import write_model_card
from .plots import write_curves
from .results import ConversionSummary, RunResults, StepCounts, Timings
from ..serialization import library_versions, save
from ..engine.head_fit import head_fit
from ..engine.hybrid_check import describe as describe_hybrid_check, hybrid_check
from ..engine.lora import add_lora, merge_lora
from ..engine.training import distill_attention, finetune, read_trainer_state
from ..task_kinds import TaskKind, kind_of
from ..tasks import get_task
from .models import check_model_folder, load_model, missing_local_folder
from .preflight import Checked, preflight
from .teachers import ensure_builtin
from ..engine.scoring import score
from .task_data import TaskData, holdout_of, steps_for


# --------------------------------------------------------------------- set-up
def frozen_copy(model):
    """A copy of ``model`` that never trains: eval mode (no dropout), no gradients."""
    import copy

    teacher = copy.deepcopy(model).eval()
    teacher.requires_grad_(False)
    return teacher


def make_accelerator(config: RunConfig):
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    return Accelerator(
        mixed_precision=config.train.mixed_precision,
        gradient_accumulation_steps=config.train.grad_accum,
        # A seeded sampler makes the data order a function of (seed, epoch): what resume relies on.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )


def new_run_dir(config: RunConfig) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(config.output_dir) / f"{config.name or 'run'}-{config.method}-{stamp}"
    path, n = base, 1
    while path.exists():  # two runs started in the same second never share (or overwrite) a folder
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


# What a run writes into its folder: removed (only these) before --overwrite reuses a folder.
RUN_ARTEFACTS = (RESULTS_FILE, CONFIG_FILE, TEACHER_FILE, LOG_FILE, STAGES_FILE, STATE_FILE, MODEL_DIR,
                 "checkpoints", MODEL_CARD_FILE, CURVES_FILE)
# What a layer selection writes beside its chosen set's run (tools/layer_selection.py): kept when that run is
# replaced by the search's next attempt, removed with the rest by any other run.
SELECTION_ARTEFACTS = (SELECTION_DIR, SELECTION_FILE, SELECTION_TABLE)


def _check_replaceable(run_dir: Path) -> None:
    """--overwrite deletes a previous run, never anything else: refuse folders holding other files."""
    foreign = sorted(p.name for p in run_dir.iterdir()
                     if p.name not in RUN_ARTEFACTS + SELECTION_ARTEFACTS and not p.name.startswith("."))
    config_file = run_dir / CONFIG_FILE
    if not foreign and config_file.is_file():
        try:
            old = json.loads(config_file.read_text())
        except (OSError, ValueError):
            old = None
        if not (isinstance(old, dict) and "method" in old and "train" in old):
            foreign = [CONFIG_FILE]
    if foreign:
        raise LunaConvertError(f"{run_dir} is not a luna-convert run folder (it holds {', '.join(foreign[:3])}); "
                               "--overwrite only replaces a previous run: choose an empty or new --run-dir")


def clear_run_folder(run_dir: Path, keep_selection: bool = False) -> None:
    """Remove a previous run's files (only those; a layer selection's too unless ``keep_selection``)."""
    import shutil

    for name in RUN_ARTEFACTS + (() if keep_selection else SELECTION_ARTEFACTS):
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def check_run_folder(run_dir: Path, overwrite: bool | None) -> bool:
    """Whether a new run in ``run_dir`` replaces an earlier one (allowed with ``overwrite``, and only a run's
    files); a file, or a non-empty folder without ``overwrite``: LunaConvertError."""
    if run_dir.exists() and not run_dir.is_dir():
        raise LunaConvertError(f"{run_dir} is a file; choose another run folder")
    reuse = run_dir.exists() and any(run_dir.iterdir())
    if reuse and not overwrite:
        raise LunaConvertError(f"{run_dir} already exists and is not empty; pass --overwrite to replace that run "
                               "or choose another folder")
    if reuse:
        _check_replaceable(run_dir)
    return reuse


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise LunaConvertError(f"{what} {path} is unreadable ({type(e).__name__}); restore it or start a new run") from None


def _distilled_stage(distilled_dir: Path) -> dict | None:
    """The finished distillation stage ({steps, seconds}) saved in ``distilled_dir``, or None.

    The stage record lives in the saved folder's metadata, which appears in the same rename as the
    weights: a folder without it (a run killed mid-write) does not count.
    """
    meta = distilled_dir / CONVERSION_FILE
    if not (meta.is_file() and (distilled_dir / WEIGHTS_FILE).is_file()):
        return None
    stage = _read_json(meta, "distillation checkpoint").get("distill_stage")
    if stage is None and (distilled_dir / "stage.json").is_file():  # folders written before the record moved
        stage = _read_json(distilled_dir / "stage.json", "distillation checkpoint")
    return stage


def _forget_after_checkpoint(run_dir: Path, finetune_step: int, distilled: bool) -> None:
    """On resume: drop log lines of work the crashed attempt did after its last checkpoint (and a line
    torn by the kill), and temporary files it left, so the resumed run's folder reads as one run."""
    import shutil

    def before_checkpoint(entry: dict) -> bool:
        stage = entry.get("stage")
        return not (stage == "distill" and not distilled or stage == "finetune" and entry.get("step", 0) > finetune_step)

    keep_log_entries(run_dir / LOG_FILE, before_checkpoint)
    for folder in (run_dir, run_dir / "checkpoints"):
        for tmp in folder.glob(".*.tmp") if folder.is_dir() else ():
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)


def apply_method_recipe(config: RunConfig) -> dict:
    """Fill the run settings the method recommends (``Method.recipe``, e.g. ``train.added_lr``) where the
    config leaves them unset (None); returns what was filled in (recorded in results.json)."""
    if config.method == CONTROL_METHOD:
        return {}
    applied = {}
    for key, value in get_method(config.method).recipe.items():
        if config.setting(key) is None:
            config.set_setting(key, value)
            applied[key] = value
    return applied


def distill_steps(config: RunConfig) -> int:
    steps = config.distill.steps
    if config.method == CONTROL_METHOD:
        return 0
    if steps is None:
        steps = config.distill.default_steps if get_method(config.method).distill else 0
    return int(steps)


# ------------------------------------------------------------------------ run
def run_conversion(config: RunConfig | None, resume: str | Path | None = None, console=None) -> RunResults:
    """Convert the configured model and train it back; returns the run's record (what results.json holds).
    Interrupted (Ctrl-C): :class:`~luna_convert.errors.RunInterrupted`, naming the run folder once it exists."""
    started: list[Path] = [Path(resume)] if resume is not None else []
    try:
        return _run_conversion(config, resume, console, started)
    except KeyboardInterrupt as e:
        raise RunInterrupted(started[-1] if started and started[-1].is_dir() else None) from e


# --------------------------------------------------------------------- stages
# A run is these stages in order, each a function of the run and of what the stages before it handed on.
STAGES = ("resolve", "preflight", "load", "convert", "distil", "finetune", "score", "save")


@dataclass
class Run:
    """What every stage reads: the settings, the folder, the accelerator and how to report. Stages add the
    seconds they took to ``timings`` and the scores they took along the way to ``stage_scores``."""

    config: RunConfig
    accelerator: Any
    run_dir: Path
    resuming: bool
    task: Any  # the TaskSpec; None for own data until pre-flight resolves it
    method_recipe: dict = field(default_factory=dict)
    reuse: bool = False  # a new run in a non-empty folder (allowed with --overwrite)
    say: Callable = field(default=lambda *a, **k: None)
    log: Callable = field(default=lambda entry: None)
    started_at: float = field(default_factory=time.perf_counter)
    timings: dict = field(default_factory=dict)
    stage_scores: dict = field(default_factory=dict)

    @property
    def control(self) -> bool:
        return self.config.method == CONTROL_METHOD

    @property
    def headline(self) -> str:
        return headline_metric(self.task)

    @property
    def kind(self) -> TaskKind:
        """The task's kind, whose hooks the stages call."""
        return kind_of(self.task)


@dataclass
class Loaded:
    """The load stage's hand-on: the model on the device, the frozen original for ``train.teacher_kd``, and the
    original's score (``{"metrics", "seconds"}``)."""

    model: Any
    kd_teacher: Any
    teacher: dict


@dataclass
class Converted:
    """The convert stage's hand-on: its report (None for the control), the distillation steps left to take,
    and what an interrupted attempt finished (the distillation record, the trainer state)."""

    report: ConversionReport | None
    distill_steps: int
    distilled: dict | None
    trainer_state: dict | None


@dataclass
class Trained:
    model: Any  # as the accelerator prepared it
    finetuned: Any  # engine.training's record of the stage: steps, seconds, final loss
    lora: Any


def resolve_stage(config: RunConfig | None, resume=None, console=None) -> Run:
    """The run's settings and folder: a resumed run's from its config.json, a new run's checked and the method's
    recommended settings filled in. Nothing is written."""
    started_at = time.perf_counter()
    if resume is not None:
        run_dir = Path(resume)
        if not run_dir.is_dir():
            raise LunaConvertError(f"cannot resume {run_dir}: no such folder; pass a run folder under outputs/")
        if not (run_dir / CONFIG_FILE).is_file():
            raise LunaConvertError(f"cannot resume {run_dir}: no {CONFIG_FILE} there; pass a run folder under outputs/")
        if (run_dir / RESULTS_FILE).is_file():
            raise LunaConvertError(f"{run_dir} already finished (it has {RESULTS_FILE}); nothing to resume: read its "
                                   f"results, `luna-convert eval {run_dir}`, or start a new run")
        config = RunConfig.from_dict(_read_json(run_dir / CONFIG_FILE, "run config"))
    if config.keep_softmax_layers == AUTO_LAYERS:
        raise LunaConvertError("keep_softmax_layers auto is a search over several runs: start it with "
                               "`luna-convert run ... --keep-softmax-layers auto` (tools.layer_selection.run_selection)")
    config.check_runnable()
    method_recipe = apply_method_recipe(config) if resume is None else {}  # a resumed config has them already
    accelerator = make_accelerator(config)
    task = None if needs_resolution(config) else task_for(config)  # own data: pre-flight resolves the task
    reuse = False
    if resume is None:
        run_dir = Path(config.run_dir or new_run_dir(config))
        if accelerator.num_processes > 1:  # one folder for all ranks (their clocks may read different seconds)
            from accelerate.utils import broadcast_object_list

            run_dir = Path(broadcast_object_list([str(run_dir)], from_process=0)[0])
        reuse = check_run_folder(run_dir, config.overwrite)
    say = (console.print if console is not None and accelerator.is_main_process else (lambda *a, **k: None))
    return Run(config, accelerator, run_dir, resume is not None, task, method_recipe, reuse, say,
               _logger(accelerator, run_dir), started_at)


def load_stage(run: Run, checked: Checked, started: list[Path] | None = None) -> Loaded:
    """The run folder made (a replaced run's files removed first), the model on the device, the frozen original
    for teacher_kd copied before anything converts or trains it, and the original's score."""
    accelerator, run_dir = run.accelerator, run.run_dir
    run.task = checked.data.task  # a token task's tag names come with the model, the embedding task's headline with the data
    if accelerator.is_main_process:
        if run.reuse:  # --overwrite: nothing of the old run may leak into this one
            clear_run_folder(run_dir, keep_selection=(run.config.selection or {}).get("role") == "final")
        run_dir.mkdir(parents=True, exist_ok=True)
        if not run.resuming:
            atomic_write_json(run_dir / CONFIG_FILE, run.config.to_dict())
    if started is not None:
        started.append(run_dir)  # from here on, an interrupted run can be resumed
    accelerator.wait_for_everyone()
    run.say(f"{'resuming' if run.resuming else 'run folder'} {run_dir}", soft_wrap=True)
    model = checked.loaded.model.to(accelerator.device)
    kd_teacher = frozen_copy(model) if run.config.train.teacher_kd else None
    return Loaded(model, kd_teacher, score_original(run, model, checked.eval_loaders))


def score_original(run: Run, model, eval_loaders: dict) -> dict:
    """The original model's score, taken once and kept across resumes (it never changes)."""
    teacher_file = run.run_dir / TEACHER_FILE
    if teacher_file.is_file():
        teacher = _read_json(teacher_file, "teacher score")
    else:
        run.say(f"scoring the original model on the {' and '.join(eval_loaders)} split")
        t0 = time.perf_counter()
        metrics, _ = score(run.accelerator, model, eval_loaders, run.task, run.kind)
        teacher = {"metrics": metrics, "seconds": time.perf_counter() - t0}
        if run.accelerator.is_main_process:
            atomic_write_json(teacher_file, teacher)
    run.timings["teacher_eval_s"] = teacher["seconds"]
    run.say(f"teacher {run.headline}: {teacher['metrics'][run.headline]:.4f}")
    return teacher


def stage_score(run: Run, model, eval_loaders: dict, name: str) -> None:
    """The headline score of the model as it is now, once per run (kept across resumes in stage_scores.json)."""
    if not run.config.train.score_stages or name in run.stage_scores:
        return
    import torch

    # Scoring must not move the run's RNG stream: a resumed run skips it.
    devices = [run.accelerator.device] if run.accelerator.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        stage_metrics, _ = score(run.accelerator, model, eval_loaders, run.task, run.kind)
    run.stage_scores[name] = stage_metrics[run.headline]
    run.say(f"{name.replace('_', ' ')} {run.headline}: {run.stage_scores[name]:.4f}")
    if run.accelerator.is_main_process:
        atomic_write_json(run.run_dir / STAGES_FILE, run.stage_scores)


def convert_stage(run: Run, model, eval_loaders: dict) -> Converted:
    """Seeded conversion (a resumed run rebuilds the same feature maps), after reading what an interrupted
    attempt finished and dropping what it did past its last checkpoint."""
    from accelerate.utils import set_seed

    config, accelerator = run.config, run.accelerator
    n_distill = distill_steps(config)
    state = read_trainer_state(run.run_dir) if run.resuming else None
    distilled = _distilled_stage(run.run_dir / DISTILLED_DIR) if n_distill else None
    if run.resuming and accelerator.is_main_process:
        _forget_after_checkpoint(run.run_dir, state["step"] if state and state["stage"] == "finetune" else 0,
                                 distilled is not None)
    set_seed(config.seed)
    report = None
    if run.control:
        run.say("control run: the original softmax model is finetuned with the same budget, unconverted")
    else:
        report = convert(model, config.method, keep_softmax_layers=config.keep_softmax_layers,
                         options=config.attention_options(), **config.convert_keywords())
        model.to(accelerator.device)
        kept = f"; {len(report.kept_softmax)} kept softmax" if report.kept_softmax else ""
        run.say(f"converted {len(report.modules)} attention modules to {config.method} "
                f"(+{report.params_added:,} parameters){kept}")
        if n_distill and not feature_map_parameters(model):
            # Same budget for every method (compare): a map without parameters has nothing to distil.
            run.say(f"{config.method} has no trainable feature map: its {n_distill} distillation steps are skipped")
            n_distill = 0
    stages_file = run.run_dir / STAGES_FILE
    run.stage_scores = _read_json(stages_file, "stage scores") if stages_file.is_file() else {}
    if not run.control:
        stage_score(run, model, eval_loaders, "after_conversion")
    return Converted(report, n_distill, distilled, state)


def distil_stage(run: Run, model, checked: Checked, converted: Converted) -> None:
    """Attention distillation (if the method's recipe or the config asks for it), saved as a checkpoint folder
    that a resumed run loads instead of distilling again."""
    n_distill, accelerator = converted.distill_steps, run.accelerator
    distilled_dir = run.run_dir / DISTILLED_DIR
    if n_distill and converted.distilled is not None:
        from safetensors.torch import load_model as load_weights

        load_weights(model, str(distilled_dir / WEIGHTS_FILE))
        run.timings["distill_s"] = converted.distilled["seconds"]
    elif n_distill:
        run.say(f"distilling attention for {n_distill} steps: each linear attention learns to match its softmax "
                "attention")
        d = run.config.distill
        stage = distill_attention(accelerator, model, accelerator.prepare_data_loader(
            checked.data.train_loader(d.batch_size)), steps=n_distill, lr=d.lr, log=run.log, target=d.target,
            span_logits=run.kind.span_logits)
        run.timings["distill_s"] = stage.seconds
        if accelerator.is_main_process:
            save(model, distilled_dir, overwrite=True,
                 extra={"distill_stage": {"steps": stage.steps, "seconds": stage.seconds}})
        accelerator.wait_for_everyone()
    if n_distill:
        stage_score(run, model, checked.eval_loaders, "after_distillation")


def finetune_stage(run: Run, loaded: Loaded, checked: Checked, converted: Converted) -> Trained:
    """Finetuning on the task (LoRA if configured), from the last checkpoint when resuming."""
    from accelerate.utils import set_seed

    config, accelerator, t = run.config, run.accelerator, run.config.train
    total = steps_for(config, checked.train_loader, accelerator)
    state = converted.trainer_state
    start = state["step"] if state and state["stage"] == "finetune" else 0
    lora = None
    if config.lora.rank:
        lora = add_lora(loaded.model, rank=config.lora.rank, alpha=config.lora.alpha, dropout=config.lora.dropout)
        run.say(f"LoRA rank {lora.rank} on {lora.adapted_layers} linear layers: {lora.trainable_params:,} of "
                f"{lora.total_params:,} parameters train (adapters, the task head, what conversion added)")
    run.say(f"finetuning on the task for {total} steps" + (f" (from step {start})" if start else "") if total else
            "no finetuning (train.max_steps 0): the model is scored as it is now")
    set_seed(config.seed + 1)
    model, stage = finetune(accelerator, loaded.model, checked.train_loader, steps=total, lr=t.lr,
                            weight_decay=t.weight_decay, schedule=t.schedule, warmup_ratio=t.warmup_ratio,
                            max_grad_norm=t.max_grad_norm, run_dir=run.run_dir, checkpoint_every=t.checkpoint_every,
                            start_step=start, log=run.log, added_lr=t.added_lr,
                            loss_fn=run.kind.loss_fn(t), teacher=loaded.kd_teacher, teacher_weight=t.teacher_kd,
                            span_logits=run.kind.span_logits)
    loaded.kd_teacher = None  # its memory back before scoring
    run.timings["finetune_s"] = stage.seconds
    return Trained(model, stage, lora)


def score_stage(run: Run, trained: Trained, checked: Checked, loaded: Loaded, converted: Converted) -> RunResults:
    """The converted model's score and per-head fit, LoRA folded into the weights, and the run's record."""
    config, accelerator, eval_loaders, data = run.config, run.accelerator, checked.eval_loaders, checked.data
    run.say(f"scoring the converted model on the {' and '.join(eval_loaders)} split")
    t0 = time.perf_counter()
    metrics, counted = score(accelerator, trained.model, eval_loaders, run.task, run.kind)
    run.timings["eval_s"] = time.perf_counter() - t0
    # Which heads the kernel follows (per head: softmax entropy, KL to the linear rows).
    fit = None if run.control else head_fit(accelerator.unwrap_model(trained.model), next(iter(eval_loaders.values())),
                                            device=accelerator.device)
    # A window hybrid: what its linear part still adds (the score and each layer's output without it).
    check = None if run.control else hybrid_check(accelerator, trained.model, eval_loaders, run.task, run.kind,
                                                  run.headline, metrics[run.headline], counted)
    if check is not None:
        run.say(describe_hybrid_check(check, run.headline))
    if trained.lora is not None:  # the saved model is the plain architecture, adapters folded into its weights
        merge_lora(accelerator.unwrap_model(trained.model))
    run.timings["total_s"] = time.perf_counter() - run.started_at
    headline, stage = run.headline, trained.finetuned
    teacher_score, converted_score = loaded.teacher["metrics"][headline], metrics[headline]
    report = converted.report
    return RunResults(
        recipe=config.name, method=config.method, task=run.task.name, model=config.model, headline_metric=headline,
        teacher_score=teacher_score, converted_score=converted_score,
        recovered_pct=recovered_pct(converted_score, teacher_score, headline),
        stage_scores={**run.stage_scores, "final": converted_score}, head_fit=fit, hybrid_check=check,
        layer_selection=config.selection if (config.selection or {}).get("role") == "final" else None,
        lora=trained.lora.to_dict() if trained.lora is not None else None, method_recipe=run.method_recipe,
        teacher_metrics=loaded.teacher["metrics"], converted_metrics=metrics,
        eval_examples=counted, truncated_examples=data.truncated, truncated_by_split=data.truncated_by_split,
        resolved=config.resolved, steps=StepCounts(distill=converted.distill_steps, finetune=stage.steps),
        final_loss=stage.final_loss, timings=Timings(**run.timings), seed=config.seed,
        num_processes=accelerator.num_processes, device=str(accelerator.device),
        conversion=ConversionSummary(**report.to_dict()) if report else None, config=config.to_dict(),
        versions=library_versions(), run_dir=str(run.run_dir),
        finished_at=datetime.now().astimezone().isoformat(),  # orders runs in `report`
    )


def save_stage(run: Run, trained: Trained, checked: Checked, results: RunResults) -> None:
    """The model folder, the model card and curves, then results.json last: it is what marks the run finished."""
    accelerator, run_dir, loaded = run.accelerator, run.run_dir, checked.loaded
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        save(accelerator.unwrap_model(trained.model), run_dir / MODEL_DIR, tokenizer=loaded.tokenizer,
             processor=loaded.image_processor, overwrite=True,
             extra={"image_config": loaded.image_config or None, "task": run.task.name})
        write_model_card(run_dir, results, run.config)
        write_curves(run_dir, run_dir / LOG_FILE, results)
        results.write(run_dir / RESULTS_FILE)
    accelerator.wait_for_everyone()
    accelerator.end_training()


def _run_conversion(config: RunConfig | None, resume, console, started: list[Path]) -> RunResults:
    """The stages in order (``STAGES``)."""
    run = resolve_stage(config, resume, console)
    checked = preflight(run.config, run.run_dir, run.accelerator, run.task, run.say)  # nothing written before it passes
    loaded = load_stage(run, checked, started)
    converted = convert_stage(run, loaded.model, checked.eval_loaders)
    distil_stage(run, loaded.model, checked, converted)
    trained = finetune_stage(run, loaded, checked, converted)
    results = score_stage(run, trained, checked, loaded, converted)
    save_stage(run, trained, checked, results)
    return results


def _logger(accelerator, run_dir: Path):
    def log(entry: dict) -> None:
        if accelerator.is_main_process:
            run_dir.mkdir(parents=True, exist_ok=True)
            with open(run_dir / LOG_FILE, "a") as f:
                f.write(json.dumps({"time": round(time.time(), 3), **entry}) + "\n")

    return log


# ----------------------------------------------------------------------- eval
def evaluate_model(path: str | Path, task: str | None = None, data_dir: str | None = None,
                   split: str | None = None, batch_size: int = 64, max_length: int | None = None,
                   max_examples: int | None = None, heads: bool = False, encoding: str | None = None,
                   inspect: Callable | None = None) -> dict:
    """Metrics of a saved converted model, a run folder, or an original checkpoint; ``heads``: also
    the per-head fit of the linear attention to softmax (``engine.head_fit``); ``inspect(accelerator, model,
    eval_loaders, task)``: whatever it returns, as ``inspected``."""
    from accelerate import Accelerator

    path = Path(path)
    run_config = RunConfig(seed=0)  # a model folder has no run settings: seed 0 picks the --max-examples sample
    if (path / RESULTS_FILE).is_file() or (path / CONFIG_FILE).is_file() and (path / MODEL_DIR).is_dir():
        run_config = RunConfig.from_dict(_read_json(path / CONFIG_FILE, "run config"))
        path = path / MODEL_DIR
    source = str(path)
    meta_task = None
    meta_file = path / CONVERSION_FILE
    if meta_file.is_file():
        meta_task = _read_json(meta_file, "model metadata").get("task")
    elif path.is_dir():  # say what the folder is not before asking which task it was trained for

        check_model_folder(path)
    elif path.exists():
        raise LunaConvertError(f"{path} is a file; pass a run folder, a saved model folder or a checkpoint folder")
    elif missing_local_folder(source):
        raise LunaConvertError(f"model folder {source} does not exist; pass a run folder under outputs/, a saved "
                               "model folder or a hub id")
    task_name = task or run_config.task or meta_task
    if not task_name:
        raise LunaConvertError(f"cannot tell which task {source} was trained for; pass --task")
    task = task_for(run_config) if run_config.resolved and not task else get_task(task_name)
    # The run's data and preprocessing (max_length, image_size), scored with this command's batches and split.
    config = replace(run_config, data_dir=data_dir if data_dir is not None else run_config.data_dir, eval_split=split,
                     encoding=encoding or run_config.encoding,
                     train=replace(run_config.train, eval_batch_size=batch_size, max_eval_examples=max_examples,
                                   # a selection candidate's held-out part is drawn from its training subset
                                   max_train_examples=run_config.train.max_train_examples
                                   if holdout_of(run_config) else None, batch_size=batch_size,
                                   max_length=max_length or run_config.train.max_length))
    config.validate()  # --encoding
    kind = kind_of(task)
    loaded = load_model(source, task.num_labels, kind=kind)
    if heads and not is_converted(loaded.model):
        raise LunaConvertError(f"{source} is not converted: --heads compares a converted model's linear attention "
                               "with softmax; pass a run folder or a converted model")
    accelerator = Accelerator()
    loaded.model.to(accelerator.device)
    teacher = None
    if kind.scored_against_teacher and is_converted(loaded.model) and run_config.model:
        def teacher():  # the run's unconverted model, loaded only if the score needs its embeddings
            origin = ensure_builtin(run_config.model, accelerator, run_config.output_dir, console=lambda *a, **k: None,
                                    data_dir=run_config.data_dir)
            return load_model(origin, kind=kind).model
    data = TaskData(config, loaded, task, accelerator, teacher=teacher)
    eval_loaders = data.eval_loaders()
    metrics, counted = score(accelerator, loaded.model, eval_loaders, data.task, data.kind)
    result = {"model": source, "task": task.name, "metrics": metrics, "eval_examples": counted,
              "converted": is_converted(loaded.model)}
    if heads:
        result["head_fit"] = head_fit(loaded.model, next(iter(eval_loaders.values())), device=accelerator.device)
    if inspect is not None:
        result["inspected"] = inspect(accelerator, loaded.model, eval_loaders, data.task)
    accelerator.end_training()
    return result
