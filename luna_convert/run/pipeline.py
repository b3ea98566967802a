"""The conversion job: teacher score, convert, (distil), finetune, converted score, save.

``run_conversion(config)`` is what ``luna-convert RECIPE`` calls; ``evaluate_model``
is ``luna-convert eval``. Both work unchanged under ``accelerate launch``.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

from .autoconfig import needs_resolution, resolve_own_data, task_for
from ..conversion import convert, feature_map_parameters, is_converted
from ..errors import ConversionError, LunaConvertError
from ..fileio import atomic_write_json, atomic_write_text
from ..folder_layout import (CONFIG_FILE, CONVERSION_FILE, CURVES_FILE, DISTILLED_DIR, LOG_FILE, MODEL_CARD_FILE,
                             MODEL_DIR, RESULTS_FILE, STAGES_FILE, STATE_FILE, TEACHER_FILE, WEIGHTS_FILE)
from ..linear_methods.registry import get_method
from ..metrics import headline_metric, recovered_pct
from .recipes import with_defaults
from .model_card import write_model_card
from .plots import write_curves
from ..serialization import library_versions, save
from ..engine.head_fit import head_fit
from ..engine.lora import add_lora, check_peft_available, merge_lora
from ..engine.training import distill_attention, finetune, read_trainer_state
from ..tasks import get_task
from .models import check_model_folder, example_inputs, load_model
from .teachers import ensure_builtin
from ..engine.scoring import score
from .task_data import TaskData, steps_for

# The control run of `compare`: the original model finetuned unconverted with the same budget, so that
# "% recovered" can be read against what the extra training alone does to the teacher.
CONTROL_METHOD = "softmax"


# --------------------------------------------------------------------- set-up
def make_accelerator(config: dict):
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    return Accelerator(
        mixed_precision=config["train"]["mixed_precision"],
        gradient_accumulation_steps=config["train"]["grad_accum"],
        # A seeded sampler makes the data order a function of (seed, epoch): what resume relies on.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )


def new_run_dir(config: dict) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(config["output_dir"]) / f"{config['name'] or 'run'}-{config['method']}-{stamp}"
    path, n = base, 1
    while path.exists():  # two runs started in the same second never share (or overwrite) a folder
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


# What a run writes into its folder: removed (only these) before --overwrite reuses a folder.
RUN_ARTEFACTS = (RESULTS_FILE, CONFIG_FILE, TEACHER_FILE, LOG_FILE, STAGES_FILE, STATE_FILE, MODEL_DIR,
                 "checkpoints", MODEL_CARD_FILE, CURVES_FILE)


def _check_replaceable(run_dir: Path) -> None:
    """--overwrite deletes a previous run, never anything else: refuse folders holding other files."""
    foreign = sorted(p.name for p in run_dir.iterdir() if p.name not in RUN_ARTEFACTS and not p.name.startswith("."))
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


def _clear_run_folder(run_dir: Path) -> None:
    import shutil

    for name in RUN_ARTEFACTS:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


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


    log_file = run_dir / LOG_FILE
    if log_file.is_file():
        kept = []
        for line in log_file.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            stage = entry.get("stage")
            if stage == "distill" and not distilled or stage == "finetune" and entry.get("step", 0) > finetune_step:
                continue
            kept.append(line)
        atomic_write_text(log_file, "".join(f"{line}\n" for line in kept))
    for folder in (run_dir, run_dir / "checkpoints"):
        for tmp in folder.glob(".*.tmp") if folder.is_dir() else ():
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)


def validate(config: dict) -> None:
    """Fail before any heavy work on settings that cannot work."""

    if not config.get("model"):
        raise LunaConvertError("no model given: pass --model ID|PATH or a recipe that names one")
    if not config.get("task") and not config.get("data_dir"):
        raise LunaConvertError("no task given: pass --task NAME or a recipe that names one (see `luna-convert recipes`), "
                               "or --data-dir with your own data")
    if config.get("task"):
        get_task(config["task"])
    if config["method"] != CONTROL_METHOD:
        get_method(config["method"])
    t = config["train"]
    for key in ("batch_size", "eval_batch_size", "grad_accum"):
        if not isinstance(t[key], int) or t[key] < 1:
            raise LunaConvertError(f"train.{key} must be a positive integer, got {t[key]!r}")
    if not (t["lr"] > 0):
        raise LunaConvertError(f"train.lr must be positive, got {t['lr']!r}")
    kept = config["keep_softmax_layers"]
    if not isinstance(kept, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in kept):
        raise LunaConvertError(f"keep_softmax_layers must be a list of layer indices, e.g. [0, 5], got {kept!r}")
    if kept and config["method"] == CONTROL_METHOD:
        raise LunaConvertError("keep_softmax_layers needs a linear method; the softmax control converts nothing")
    if t["mixed_precision"] not in ("no", "bf16", "fp16"):
        raise LunaConvertError(f"train.mixed_precision must be no, bf16 or fp16, got {t['mixed_precision']!r}")
    _validate_ranges(config)


def _validate_ranges(config: dict) -> None:
    """The remaining numeric and choice settings, so that a bad --set fails before anything is written."""
    t, d = config["train"], config["distill"]

    def is_int(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    def is_num(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    checks = [
        ("train.max_steps", t["max_steps"], t["max_steps"] is None or is_int(t["max_steps"]) and t["max_steps"] >= 0,
         "a positive integer, or 0 or null (then train.epochs counts)"),
        ("train.epochs", t["epochs"], bool(t["max_steps"]) or is_num(t["epochs"]) and t["epochs"] > 0,
         "a positive number"),
        ("train.checkpoint_every", t["checkpoint_every"], is_int(t["checkpoint_every"]) and t["checkpoint_every"] >= 0,
         "a whole number of steps (0: no intermediate checkpoints)"),
        ("train.warmup_ratio", t["warmup_ratio"], is_num(t["warmup_ratio"]) and 0 <= t["warmup_ratio"] < 1,
         "a fraction in [0, 1)"),
        ("train.added_lr", t["added_lr"], t["added_lr"] is None or is_num(t["added_lr"]) and t["added_lr"] > 0,
         "positive, or null (train.lr)"),
        ("train.score_stages", t["score_stages"], isinstance(t["score_stages"], bool), "true or false"),
        ("train.weight_decay", t["weight_decay"], is_num(t["weight_decay"]) and t["weight_decay"] >= 0, "0 or more"),
        ("train.max_grad_norm", t["max_grad_norm"], t["max_grad_norm"] is None or is_num(t["max_grad_norm"])
         and t["max_grad_norm"] >= 0, "0 or more (0 or null: no clipping)"),
        ("train.max_length", t["max_length"], is_int(t["max_length"]) and t["max_length"] >= 1, "a positive integer"),
        ("train.image_size", t["image_size"], t["image_size"] is None or is_int(t["image_size"]) and t["image_size"] >= 1,
         "a positive integer or null (the model's size)"),
        ("train.schedule", t["schedule"], t["schedule"] in ("linear", "cosine", "constant"), "linear, cosine or constant"),
        ("distill.steps", d["steps"], d["steps"] is None or is_int(d["steps"]) and d["steps"] >= 0,
         "0 or more, or null (the method's default)"),
        ("distill.default_steps", d["default_steps"], is_int(d["default_steps"]) and d["default_steps"] >= 0, "0 or more"),
        ("distill.lr", d["lr"], is_num(d["lr"]) and d["lr"] > 0, "positive"),
        ("distill.target", d["target"], d["target"] in ("attention", "output", "logits"),
         "attention, output or logits"),
        ("distill.batch_size", d["batch_size"], d["batch_size"] is None or is_int(d["batch_size"]) and d["batch_size"] >= 1,
         "a positive integer or null (train.batch_size)"),
    ]
    lora = config["lora"]
    checks += [
        ("lora.rank", lora["rank"], is_int(lora["rank"]) and lora["rank"] >= 0, "0 (off) or a positive integer"),
        ("lora.alpha", lora["alpha"], lora["alpha"] is None or is_num(lora["alpha"]) and lora["alpha"] > 0,
         "positive, or null (2 x rank)"),
        ("lora.dropout", lora["dropout"], is_num(lora["dropout"]) and 0 <= lora["dropout"] < 1, "a fraction in [0, 1)"),
    ]
    for key in ("max_train_examples", "max_eval_examples"):
        checks.append((f"train.{key}", t[key], t[key] is None or is_int(t[key]) and t[key] >= 1,
                       "a positive integer or null (all)"))
    for key, value, ok, what in checks:
        if not ok:
            raise LunaConvertError(f"{key} must be {what}, got {value!r}; fix it with --set {key}=...")
    if lora["rank"]:
        check_peft_available()


def apply_method_recipe(config: dict) -> dict:
    """Fill the run settings the method recommends (``Method.recipe``, e.g. ``train.added_lr``) where the
    config leaves them unset (None); returns what was filled in (recorded in results.json)."""
    if config["method"] == CONTROL_METHOD:
        return {}
    applied = {}
    for key, value in get_method(config["method"]).recipe.items():
        section, name = key.split(".")
        if config[section].get(name) is None:
            config[section][name] = applied[key] = value
    return applied


def distill_steps(config: dict) -> int:
    steps = config["distill"]["steps"]
    if config["method"] == CONTROL_METHOD:
        return 0
    if steps is None:
        steps = config["distill"]["default_steps"] if get_method(config["method"]).distill else 0
    return int(steps)


# ------------------------------------------------------------------------ run
def run_conversion(config: dict, resume: str | Path | None = None, console=None) -> dict:
    """Convert the configured model and train it back; returns results.json's content."""
    from accelerate.utils import set_seed

    t_start = time.perf_counter()
    if resume is not None:
        run_dir = Path(resume)
        if not run_dir.is_dir():
            raise LunaConvertError(f"cannot resume {run_dir}: no such folder; pass a run folder under outputs/")
        if not (run_dir / CONFIG_FILE).is_file():
            raise LunaConvertError(f"cannot resume {run_dir}: no {CONFIG_FILE} there; pass a run folder under outputs/")
        if (run_dir / RESULTS_FILE).is_file():
            raise LunaConvertError(f"{run_dir} already finished (it has {RESULTS_FILE}); nothing to resume: read its "
                                   f"results, `luna-convert eval {run_dir}`, or start a new run")
        config = with_defaults(_read_json(run_dir / CONFIG_FILE, "run config"))
    validate(config)
    method_recipe = apply_method_recipe(config) if resume is None else {}  # a resumed config has them already
    accelerator = make_accelerator(config)
    own_data = needs_resolution(config)  # no recipe: task, columns, splits, defaults come from model + data
    task = None if own_data else task_for(config)
    reuse = False  # a new run in a non-empty folder (allowed with --overwrite)
    if resume is None:
        run_dir = Path(config.get("run_dir") or new_run_dir(config))
        if accelerator.num_processes > 1:  # one folder for all ranks (their clocks may read different seconds)
            from accelerate.utils import broadcast_object_list

            run_dir = Path(broadcast_object_list([str(run_dir)], from_process=0)[0])
        if run_dir.exists() and not run_dir.is_dir():
            raise LunaConvertError(f"{run_dir} is a file; choose another run folder")
        reuse = run_dir.exists() and any(run_dir.iterdir())
        if reuse and not config.get("overwrite"):
            raise LunaConvertError(f"{run_dir} already exists and is not empty; pass --overwrite to replace that run "
                                   "or choose another folder")
        if reuse:
            _check_replaceable(run_dir)
    log = _logger(accelerator, run_dir)
    say = (console.print if console is not None and accelerator.is_main_process else (lambda *a, **k: None))
    timings: dict[str, float] = {}

    source = ensure_builtin(config["model"], accelerator, config["output_dir"], console=say, data_dir=config["data_dir"])
    set_seed(config["seed"])
    loaded = load_model(source, task.num_labels if task else None, level=task.level if task else "sequence")
    if own_data:
        resolve_own_data(config, loaded, say=say)
        task = task_for(config)
    if is_converted(loaded.model):
        raise LunaConvertError(f"{config['model']} is already converted to linear attention; start from the original")
    control = config["method"] == CONTROL_METHOD
    if not control:
        _check_convertible(loaded.model, config["method"], config["method_options"], config["keep_softmax_layers"])
    data = TaskData(config, loaded, task)
    task = data.task  # a token task's tag names come with the model
    eval_loaders = data.eval_loaders()
    train_loader = data.train_loader()  # read before the run folder appears: bad train data fails first
    if accelerator.is_main_process:
        if reuse:  # --overwrite: nothing of the old run may leak into this one
            _clear_run_folder(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume is None:
            atomic_write_json(run_dir / CONFIG_FILE, config)
    accelerator.wait_for_everyone()
    say(f"{'resuming' if resume is not None else 'run folder'} {run_dir}", soft_wrap=True)
    model = loaded.model.to(accelerator.device)

    # 1. The original score (kept across resumes: it never changes).
    teacher_file = run_dir / TEACHER_FILE
    if teacher_file.is_file():
        teacher = _read_json(teacher_file, "teacher score")
    else:
        say(f"scoring the original model on the {' and '.join(eval_loaders)} split")
        t0 = time.perf_counter()
        metrics, _ = score(accelerator, model, eval_loaders, task)
        teacher = {"metrics": metrics, "seconds": time.perf_counter() - t0}
        if accelerator.is_main_process:
            atomic_write_json(teacher_file, teacher)
    timings["teacher_eval_s"] = teacher["seconds"]
    headline = headline_metric(task)
    say(f"teacher {headline}: {teacher['metrics'][headline]:.4f}")

    # 2. Convert (seeded: a resumed run rebuilds the same feature maps), 3. distil.
    n_distill = distill_steps(config)
    state = read_trainer_state(run_dir) if resume is not None else None
    distilled_dir = run_dir / DISTILLED_DIR
    distilled = _distilled_stage(distilled_dir) if n_distill else None
    if resume is not None and accelerator.is_main_process:
        _forget_after_checkpoint(run_dir, state["step"] if state and state["stage"] == "finetune" else 0,
                                 distilled is not None)
    set_seed(config["seed"])
    if control:
        report = None
        say("control run: the original softmax model is finetuned with the same budget, unconverted")
    else:
        report = convert(model, config["method"], keep_softmax_layers=config["keep_softmax_layers"],
                         **config["method_options"])
        model.to(accelerator.device)
        kept = f"; {len(report.kept_softmax)} kept softmax" if report.kept_softmax else ""
        say(f"converted {len(report.modules)} attention modules to {config['method']} "
            f"(+{report.params_added:,} parameters){kept}")
        if n_distill and not feature_map_parameters(model):
            # Same budget for every method (compare): a map without parameters has nothing to distil.
            say(f"{config['method']} has no trainable feature map: its {n_distill} distillation steps are skipped")
            n_distill = 0
    stage_scores = _read_json(run_dir / STAGES_FILE, "stage scores") if (run_dir / STAGES_FILE).is_file() else {}

    def score_stage(name: str) -> None:
        """The headline score of the model as it is now, once per run (kept across resumes)."""
        if not config["train"]["score_stages"] or name in stage_scores:
            return
        import torch

        # Scoring must not move the run's RNG stream: a resumed run skips it.
        devices = [accelerator.device] if accelerator.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            stage_metrics, _ = score(accelerator, model, eval_loaders, task)
        stage_scores[name] = stage_metrics[headline]
        say(f"{name.replace('_', ' ')} {headline}: {stage_scores[name]:.4f}")
        if accelerator.is_main_process:
            atomic_write_json(run_dir / STAGES_FILE, stage_scores)

    if not control:
        score_stage("after_conversion")
    if n_distill and distilled is not None:
        from safetensors.torch import load_model as load_weights

        load_weights(model, str(distilled_dir / WEIGHTS_FILE))
        timings["distill_s"] = distilled["seconds"]
    elif n_distill:
        say(f"distilling attention for {n_distill} steps: each linear attention learns to match its softmax attention")
        d = config["distill"]
        stage = distill_attention(accelerator, model, accelerator.prepare_data_loader(
            data.train_loader(d["batch_size"])), steps=n_distill, lr=d["lr"], log=log, target=d["target"],
            span_logits=task.is_span_level)
        timings["distill_s"] = stage.seconds
        if accelerator.is_main_process:
            save(model, distilled_dir, overwrite=True,
                 extra={"distill_stage": {"steps": stage.steps, "seconds": stage.seconds}})
        accelerator.wait_for_everyone()
    if n_distill:
        score_stage("after_distillation")

    # 4. Finetune on the task.
    t = config["train"]
    total = steps_for(config, train_loader, accelerator)
    start = state["step"] if state and state["stage"] == "finetune" else 0
    lora = None
    if config["lora"]["rank"]:
        lora = add_lora(model, **config["lora"])
        say(f"LoRA rank {lora.rank} on {lora.adapted_layers} linear layers: {lora.trainable_params:,} of "
            f"{lora.total_params:,} parameters train (adapters, the task head, what conversion added)")
    say(f"finetuning on the task for {total} steps" + (f" (from step {start})" if start else ""))
    set_seed(config["seed"] + 1)
    model, stage = finetune(accelerator, model, train_loader, steps=total, lr=t["lr"], weight_decay=t["weight_decay"],
                            schedule=t["schedule"], warmup_ratio=t["warmup_ratio"], max_grad_norm=t["max_grad_norm"],
                            run_dir=run_dir, checkpoint_every=t["checkpoint_every"], start_step=start, log=log,
                            added_lr=t["added_lr"])
    timings["finetune_s"] = stage.seconds

    # 5. The converted score, 6. save.
    say(f"scoring the converted model on the {' and '.join(eval_loaders)} split")
    t0 = time.perf_counter()
    metrics, counted = score(accelerator, model, eval_loaders, task)
    timings["eval_s"] = time.perf_counter() - t0
    # Which heads the kernel follows (per head: softmax entropy, KL to the linear rows).
    fit = None if control else head_fit(accelerator.unwrap_model(model), next(iter(eval_loaders.values())),
                                        device=accelerator.device)
    if lora is not None:  # the saved model is the plain architecture, adapters folded into its weights
        merge_lora(accelerator.unwrap_model(model))
    timings["total_s"] = time.perf_counter() - t_start
    teacher_score, converted_score = teacher["metrics"][headline], metrics[headline]
    results = {
        "recipe": config["name"], "method": config["method"], "task": task.name, "model": config["model"],
        "headline_metric": headline,
        "teacher_score": teacher_score,
        "converted_score": converted_score,
        "recovered_pct": recovered_pct(converted_score, teacher_score, headline),
        "stage_scores": {**stage_scores, "final": converted_score},
        "head_fit": fit,
        "lora": lora.to_dict() if lora is not None else None,
        "method_recipe": method_recipe,
        "teacher_metrics": teacher["metrics"], "converted_metrics": metrics,
        "eval_examples": counted, "truncated_examples": data.truncated, "truncated_by_split": data.truncated_by_split,
        "resolved": config.get("resolved"),
        "steps": {"distill": n_distill, "finetune": stage.steps},
        "final_loss": stage.final_loss, "timings": timings, "seed": config["seed"],
        "num_processes": accelerator.num_processes, "device": str(accelerator.device),
        "conversion": report.to_dict() if report else None, "config": config, "versions": library_versions(),
        "run_dir": str(run_dir), "finished_at": datetime.now().astimezone().isoformat(),  # orders runs in `report`
    }
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        save(unwrapped, run_dir / MODEL_DIR, tokenizer=loaded.tokenizer, processor=loaded.image_processor,
             overwrite=True, extra={"image_config": loaded.image_config or None, "task": task.name})
        # What people look at, then results.json last: it is what marks the run finished.
        write_model_card(run_dir, results)
        write_curves(run_dir, run_dir / LOG_FILE, results)
        atomic_write_json(run_dir / RESULTS_FILE, results)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return results


def _check_convertible(model, method: str, options: dict, keep_softmax_layers: list[int] = ()) -> None:
    """Dry-run the conversion on the model as the run will use it, so that a model without supported
    attention, attention that cannot be converted faithfully, or bad method options fail before the
    run folder is written: a copy of the model that shares its weights (only the module structure is
    copied) gets its first attention module converted and runs one forward pass on a made-up input."""
    import copy

    import torch

    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    probe = copy.deepcopy(model, memo=shared).eval()
    chosen: list[str] = []

    def first_only(_module, name: str) -> bool:
        if not chosen:
            chosen.append(name)
        return name == chosen[0]

    with torch.random.fork_rng(devices=[]):  # the run's seeded RNG stream stays as it is
        # raises the explanatory ConversionError
        convert(probe, method, filter_fn=first_only, keep_softmax_layers=keep_softmax_layers, **options)
        args, kwargs = example_inputs(probe)
        try:
            with torch.no_grad():
                probe(*args, **kwargs)
        except (RuntimeError, ValueError, TypeError) as e:
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            what = f"method {method!r}" + (f" with options {options}" if options else "")
            hint = ("fix --set method_options... (defaults: `luna-convert methods`)" if options else
                    "this model cannot be converted with it (rerun with --debug to see where it failed)")
            raise ConversionError(f"{what} cannot run on {type(model).__name__} (test forward of {chosen[0]}: "
                                  f"{reason}); {hint}") from e


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
                   max_examples: int | None = None, heads: bool = False) -> dict:
    """Metrics of a saved converted model, a run folder, or an original checkpoint; ``heads``: also
    the per-head fit of the linear attention to softmax (``engine.head_fit``)."""
    from accelerate import Accelerator

    path = Path(path)
    run_config = {}
    if (path / RESULTS_FILE).is_file() or (path / CONFIG_FILE).is_file() and (path / MODEL_DIR).is_dir():
        run_config = _read_json(path / CONFIG_FILE, "run config")
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
    elif source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise LunaConvertError(f"model folder {source} does not exist; pass a run folder under outputs/, a saved "
                               "model folder or a hub id")
    task_name = task or run_config.get("task") or meta_task
    if not task_name:
        raise LunaConvertError(f"cannot tell which task {source} was trained for; pass --task")
    task = task_for(run_config) if run_config.get("resolved") and not task else get_task(task_name)
    config = {
        "data_dir": data_dir if data_dir is not None else run_config.get("data_dir"),
        "eval_split": split, "seed": run_config.get("seed", 0),
        "train": {**(run_config.get("train") or {}), "eval_batch_size": batch_size, "max_eval_examples": max_examples,
                  "max_train_examples": None, "batch_size": batch_size, "image_size": (run_config.get("train") or {}).get("image_size")},
    }
    config["train"]["max_length"] = max_length or config["train"].get("max_length", 128)
    loaded = load_model(source, task.num_labels, level=task.level)
    if heads and not is_converted(loaded.model):
        raise LunaConvertError(f"{source} is not converted: --heads compares a converted model's linear attention "
                               "with softmax; pass a run folder or a converted model")
    accelerator = Accelerator()
    loaded.model.to(accelerator.device)
    data = TaskData(config, loaded, task)
    eval_loaders = data.eval_loaders()
    metrics, counted = score(accelerator, loaded.model, eval_loaders, data.task)
    result = {"model": source, "task": task.name, "metrics": metrics, "eval_examples": counted,
              "converted": is_converted(loaded.model)}
    if heads:
        result["head_fit"] = head_fit(loaded.model, next(iter(eval_loaders.values())), device=accelerator.device)
    accelerator.end_training()
    return result
