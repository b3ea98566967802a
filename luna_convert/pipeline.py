"""The conversion job: teacher score, convert, (distil), finetune, converted score, save.

``run_conversion(config)`` is what ``luna-convert RECIPE`` calls; ``evaluate_model``
is ``luna-convert eval``. Both work unchanged under ``accelerate launch``.
"""

from __future__ import annotations

import json
import math
import time
from datetime import datetime
from pathlib import Path

from .convert import convert, is_converted
from .errors import LunaConvertError
from .fileio import atomic_write_json
from .methods import get_method
from .serialization import library_versions, save

RESULTS_FILE, CONFIG_FILE, TEACHER_FILE, LOG_FILE = "results.json", "config.json", "teacher.json", "train_log.jsonl"
MODEL_DIR, DISTILLED_DIR = "model", "checkpoints/distilled"
EXTRA_EVAL_SPLITS = {"mnli": ("validation_mismatched",)}


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
    return Path(config["output_dir"]) / f"{config['name'] or 'run'}-{config['method']}-{stamp}"


def validate(config: dict) -> None:
    """Fail before any heavy work on settings that cannot work."""
    from .tasks import get_task

    if not config.get("model"):
        raise LunaConvertError("no model given: pass --model ID|PATH or a recipe that names one")
    if not config.get("task"):
        raise LunaConvertError("no task given: pass --task NAME or a recipe that names one (see `luna-convert recipes`)")
    get_task(config["task"])
    get_method(config["method"])
    t = config["train"]
    for key in ("batch_size", "eval_batch_size", "grad_accum"):
        if not isinstance(t[key], int) or t[key] < 1:
            raise LunaConvertError(f"train.{key} must be a positive integer, got {t[key]!r}")
    if not (t["lr"] > 0):
        raise LunaConvertError(f"train.lr must be positive, got {t['lr']!r}")
    if t["mixed_precision"] not in ("no", "bf16", "fp16"):
        raise LunaConvertError(f"train.mixed_precision must be no, bf16 or fp16, got {t['mixed_precision']!r}")


def distill_steps(config: dict) -> int:
    steps = config["distill"]["steps"]
    if steps is None:
        steps = config["distill"]["default_steps"] if get_method(config["method"]).distill else 0
    return int(steps)


# ----------------------------------------------------------------------- data
class TaskData:
    """The task's splits and loaders for one model's preprocessing."""

    def __init__(self, config: dict, loaded, task, accelerator=None):
        from . import data

        self.task, self.loaded, self.config = task, loaded, config
        t = config["train"]
        self.truncated = 0

        def split(name: str, limit, train: bool, batch_size: int):
            dataset = data.load_split(task, name, config["data_dir"], max_examples=limit, seed=config["seed"])
            if task.kind == "text":
                dataset = data.align_labels(dataset, task, loaded.id2label, loaded.num_labels)
                loader = data.make_text_dataloader(dataset, task, loaded.tokenizer, batch_size=batch_size,
                                                   max_length=t["max_length"], shuffle=train, seed=config["seed"])
                self.truncated += getattr(loader, "num_truncated", 0)
            else:
                _check_image_labels(dataset, loaded.num_labels, name)
                size = t["image_size"] or loaded.image_config["size"]
                transform = data.image_transform(loaded.image_config["mean"], loaded.image_config["std"], size,
                                                 train=train and t.get("augment", True))
                loader = data.make_image_dataloader(dataset, transform, batch_size=batch_size, shuffle=train,
                                                    seed=config["seed"])
            return dataset, loader

        self.split = split

    def train_loader(self, batch_size: int | None = None):
        t = self.config["train"]
        return self.split(self.task.train_split, t["max_train_examples"], True, batch_size or t["batch_size"])[1]

    def eval_loaders(self) -> dict:
        t = self.config["train"]
        names = [self.config["eval_split"] or self.task.eval_split]
        if not self.config["eval_split"]:
            names += list(EXTRA_EVAL_SPLITS.get(self.task.name, ()))
        return {n: self.split(n, t["max_eval_examples"], False, t["eval_batch_size"])[1] for n in names}


def _check_image_labels(dataset, num_labels: int, split: str) -> None:
    classes = getattr(dataset, "classes", None)
    if classes is not None and len(classes) > num_labels:
        raise LunaConvertError(
            f"the {split} split has {len(classes)} classes but the model predicts {num_labels}; "
            "use a model finetuned on these classes"
        )


def score(accelerator, model, loaders: dict, task) -> tuple[dict, int]:
    """Metrics on every eval split (extra splits prefixed by their name) and examples counted."""
    from .metrics import compute_metrics
    from .training import predict

    metrics, counted = {}, 0
    for i, (name, loader) in enumerate(loaders.items()):
        logits, labels = predict(accelerator, model, accelerator.prepare_data_loader(loader), f"eval {name}")
        values = compute_metrics(task, logits, labels)
        prefix = "" if i == 0 else f"{name}/"
        metrics.update({f"{prefix}{k}": v for k, v in values.items()})
        counted += len(labels) if i == 0 else 0
    return metrics, counted


def steps_for(config: dict, loader, accelerator) -> int:
    t = config["train"]
    if t["max_steps"]:
        return int(t["max_steps"])
    per_process = math.ceil(len(loader) / accelerator.num_processes)
    return max(1, math.ceil(t["epochs"] * max(1, per_process // t["grad_accum"])))


# ------------------------------------------------------------------------ run
def run_conversion(config: dict, resume: str | Path | None = None, console=None) -> dict:
    """Convert the configured model and train it back; returns results.json's content."""
    from accelerate.utils import set_seed

    from .metrics import headline_metric
    from .models import load_model
    from .tasks import get_task
    from .teachers import ensure_builtin
    from .training import distill_attention, finetune, read_trainer_state

    t_start = time.perf_counter()
    if resume is not None:
        run_dir = Path(resume)
        if not (run_dir / CONFIG_FILE).is_file():
            raise LunaConvertError(f"cannot resume {run_dir}: no {CONFIG_FILE} there; pass a run folder under outputs/")
        config = json.loads((run_dir / CONFIG_FILE).read_text())
    validate(config)
    accelerator = make_accelerator(config)
    task = get_task(config["task"])
    if resume is None:
        run_dir = Path(config.get("run_dir") or new_run_dir(config))
        if run_dir.exists() and any(run_dir.iterdir()) and not config.get("overwrite"):
            raise LunaConvertError(f"{run_dir} already exists; pass --overwrite or another --output-dir")
    log = _logger(accelerator, run_dir)
    say = (console.print if console is not None and accelerator.is_main_process else (lambda *a, **k: None))
    timings: dict[str, float] = {}

    source = ensure_builtin(config["model"], accelerator, config["output_dir"], console=say)
    set_seed(config["seed"])
    loaded = load_model(source, task.num_labels)
    if is_converted(loaded.model):
        raise LunaConvertError(f"{config['model']} is already converted to linear attention; start from the original")
    data = TaskData(config, loaded, task)
    eval_loaders = data.eval_loaders()
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume is None:
            atomic_write_json(run_dir / CONFIG_FILE, config)
    model = loaded.model.to(accelerator.device)

    # 1. The original score (kept across resumes: it never changes).
    teacher_file = run_dir / TEACHER_FILE
    if teacher_file.is_file():
        teacher = json.loads(teacher_file.read_text())
    else:
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
    set_seed(config["seed"])
    report = convert(model, config["method"], **config["method_options"])
    model.to(accelerator.device)
    say(f"converted {len(report.modules)} attention modules to {config['method']} (+{report.params_added:,} parameters)")
    if n_distill and distilled_dir.is_dir():
        from safetensors.torch import load_model as load_weights

        load_weights(model, str(distilled_dir / "model.safetensors"))
        timings["distill_s"] = json.loads((distilled_dir / "stage.json").read_text())["seconds"]
    elif n_distill:
        d = config["distill"]
        stage = distill_attention(accelerator, model, accelerator.prepare_data_loader(
            data.train_loader(d["batch_size"])), steps=n_distill, lr=d["lr"], log=log)
        timings["distill_s"] = stage.seconds
        if accelerator.is_main_process:
            save(model, distilled_dir, overwrite=True)
            atomic_write_json(distilled_dir / "stage.json", {"steps": stage.steps, "seconds": stage.seconds})
        accelerator.wait_for_everyone()

    # 4. Finetune on the task.
    t = config["train"]
    train_loader = data.train_loader()
    total = steps_for(config, train_loader, accelerator)
    start = state["step"] if state and state["stage"] == "finetune" else 0
    set_seed(config["seed"] + 1)
    model, stage = finetune(accelerator, model, train_loader, steps=total, lr=t["lr"], weight_decay=t["weight_decay"],
                            schedule=t["schedule"], warmup_ratio=t["warmup_ratio"], max_grad_norm=t["max_grad_norm"],
                            run_dir=run_dir, checkpoint_every=t["checkpoint_every"], start_step=start, log=log)
    timings["finetune_s"] = stage.seconds

    # 5. The converted score, 6. save.
    t0 = time.perf_counter()
    metrics, counted = score(accelerator, model, eval_loaders, task)
    timings["eval_s"] = time.perf_counter() - t0
    timings["total_s"] = time.perf_counter() - t_start
    teacher_score, converted_score = teacher["metrics"][headline], metrics[headline]
    results = {
        "recipe": config["name"], "method": config["method"], "task": task.name, "model": config["model"],
        "headline_metric": headline,
        "teacher_score": teacher_score,
        "converted_score": converted_score,
        "recovered_pct": recovered_pct(converted_score, teacher_score),
        "teacher_metrics": teacher["metrics"], "converted_metrics": metrics,
        "eval_examples": counted, "truncated_examples": data.truncated,
        "steps": {"distill": n_distill, "finetune": stage.steps},
        "final_loss": stage.final_loss, "timings": timings, "seed": config["seed"],
        "num_processes": accelerator.num_processes, "device": str(accelerator.device),
        "conversion": report.to_dict(), "config": config, "versions": library_versions(),
        "run_dir": str(run_dir),
    }
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        save(unwrapped, run_dir / MODEL_DIR, tokenizer=loaded.tokenizer, processor=loaded.image_processor,
             overwrite=True, extra={"image_config": loaded.image_config or None, "task": task.name})
        atomic_write_json(run_dir / RESULTS_FILE, results)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return results


def recovered_pct(converted: float, teacher: float) -> float | None:
    """100 x converted / teacher; undefined (None) when the teacher scores <= 0."""
    return 100.0 * converted / teacher if teacher > 0 else None


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
                   max_examples: int | None = None) -> dict:
    """Metrics of a saved converted model, a run folder, or an original checkpoint."""
    from accelerate import Accelerator

    from .models import load_model
    from .tasks import get_task

    path = Path(path)
    run_config = {}
    if (path / RESULTS_FILE).is_file() or (path / CONFIG_FILE).is_file() and (path / MODEL_DIR).is_dir():
        run_config = json.loads((path / CONFIG_FILE).read_text())
        path = path / MODEL_DIR
    source = str(path)
    meta_task = None
    meta_file = path / "linear_attention.json"
    if meta_file.is_file():
        meta_task = json.loads(meta_file.read_text()).get("task")
    task_name = task or run_config.get("task") or meta_task
    if not task_name:
        raise LunaConvertError(f"cannot tell which task {source} was trained for; pass --task")
    task = get_task(task_name)
    config = {
        "data_dir": data_dir if data_dir is not None else run_config.get("data_dir"),
        "eval_split": split, "seed": run_config.get("seed", 0),
        "train": {**(run_config.get("train") or {}), "eval_batch_size": batch_size, "max_eval_examples": max_examples,
                  "max_train_examples": None, "batch_size": batch_size, "image_size": (run_config.get("train") or {}).get("image_size")},
    }
    config["train"]["max_length"] = max_length or config["train"].get("max_length", 128)
    loaded = load_model(source, task.num_labels)
    accelerator = Accelerator()
    loaded.model.to(accelerator.device)
    metrics, counted = score(accelerator, loaded.model, TaskData(config, loaded, task).eval_loaders(), task)
    accelerator.end_training()
    return {"model": source, "task": task.name, "metrics": metrics, "eval_examples": counted,
            "converted": is_converted(loaded.model)}
