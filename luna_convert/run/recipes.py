"""Named YAML recipes and ``key=value`` overrides.

A recipe is a nested mapping with the sections of :data:`DEFAULTS`; a file
states only what differs. Overrides use dotted keys (``train.lr=3e-5``);
values are parsed as YAML scalars (``3e-5``, ``true``, ``null``).
"""

from __future__ import annotations

import copy
from pathlib import Path

from ..errors import LunaConvertError, unknown_name

# Shipped inside the package (package-data), so an installed tool finds them from any working directory.
RECIPE_DIRS = [Path(__file__).resolve().parents[1] / "recipes"]  # package data: luna_convert/recipes/*.yaml

DEFAULTS: dict = {
    "name": None,
    "description": "",
    "model": None,  # hub id, local folder, "timm:<name>" or "builtin:<name>"
    "task": None,
    "data_dir": None,
    "eval_split": None,  # default: the task's evaluation split
    "train_split": None,  # default: the task's train split (own data: the file/folder/split called train)
    "metric": None,  # headline metric; default: the task's (accuracy for classification, pearson for regression)
    "columns": {"text": None, "text_pair": None, "label": None},  # own data: detected by name when None
    "method": "luna",
    "method_options": {},
    "keep_softmax_layers": [],  # attention layers (0-based; negative from the end) left softmax: a hybrid
    "seed": 42,
    "output_dir": "outputs",
    "train": {
        "lr": 2e-5,
        "added_lr": None,  # learning rate of what conversion added (feature maps, DWC); null: train.lr
        "weight_decay": 0.01,
        "schedule": "linear",  # linear | cosine | constant
        "warmup_ratio": 0.06,
        "epochs": 3.0,
        "max_steps": None,  # overrides epochs when set
        "batch_size": 32,
        "eval_batch_size": 64,
        "grad_accum": 1,
        "max_length": 128,
        "image_size": None,  # default: the model's own preprocessing size
        "mixed_precision": "no",  # no | bf16 | fp16
        "checkpoint_every": 0,  # 0: only at stage ends
        "max_grad_norm": 1.0,
        "augment": True,  # light train-time augmentation for images
        "max_train_examples": None,
        "max_eval_examples": None,
        "score_stages": True,  # also score right after conversion and after distillation
    },
    # LoRA second stage (peft): adapters of this rank on the pretrained linear layers, the rest of the
    # pretrained weights frozen except the task head; what conversion added trains in full. 0: off.
    "lora": {"rank": 0, "alpha": None, "dropout": 0.0},  # alpha null: 2 x rank
    "distill": {
        "steps": None,  # None: the method's recipe (default_steps if it distils, else 0)
        "default_steps": 300,
        "lr": 1e-2,
        # attention (row cross-entropy, N x N) | output (layer output MSE, linear in N) | logits (KL to the
        # model's own logits under softmax attention; linear in N)
        "target": "attention",
        "batch_size": None,  # default: train.batch_size
    },
}


def available_recipes() -> dict[str, str]:
    """Recipe name -> one-line description."""
    out = {}
    for folder in RECIPE_DIRS:
        for path in sorted(folder.glob("*.yaml")):
            out.setdefault(path.stem, _read_yaml(path).get("description", ""))
    return out


def _read_yaml(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise LunaConvertError(f"recipe file {path} is not valid YAML: {e}".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise LunaConvertError(f"recipe file {path} must hold a mapping of settings")
    return data


def _merge(base: dict, update: dict, where: str = "") -> dict:
    for key, value in update.items():
        if key not in base:
            raise unknown_name("recipe setting", f"{where}{key}", [f"{where}{k}" for k in base])
        if isinstance(base[key], dict) and key != "method_options":
            if not isinstance(value, dict):
                raise LunaConvertError(f"recipe setting {where}{key} must be a mapping")
            _merge(base[key], value, f"{where}{key}.")
        else:
            base[key] = value
    return base


def with_defaults(saved: dict) -> dict:
    """A run's saved config.json with any setting it lacks (written by an older version) at its default."""
    def fill(base: dict, update: dict) -> dict:
        for key, value in update.items():
            if isinstance(base.get(key), dict) and isinstance(value, dict) and key != "method_options":
                fill(base[key], value)
            else:
                base[key] = value
        return base

    return fill(copy.deepcopy(DEFAULTS), saved)


def load_recipe(name_or_path: str | None) -> dict:
    """DEFAULTS updated by a named recipe or a YAML file (None: defaults only)."""
    config = copy.deepcopy(DEFAULTS)
    if name_or_path is None:
        return config
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        found = [folder / f"{name_or_path}.yaml" for folder in RECIPE_DIRS]
        path = next((p for p in found if p.is_file()), None)
        if path is None:
            raise unknown_name("recipe", str(name_or_path), available_recipes())
    config = _merge(config, _read_yaml(path))
    config["name"] = config["name"] or path.stem
    return config


def parse_override(item: str) -> tuple[str, object]:
    import yaml

    if "=" not in item:
        raise LunaConvertError(f"--set expects key=value (e.g. train.lr=3e-5), got {item!r}")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def apply_overrides(config: dict, overrides: dict[str, object]) -> dict:
    """Set dotted keys (``train.lr``, ``method_options.projections``); unknown keys are an error."""
    for key, value in overrides.items():
        parts = key.split(".")
        node = config
        for i, part in enumerate(parts[:-1]):
            if part not in node or not isinstance(node[part], dict):
                raise unknown_name("setting", key, _dotted_keys(DEFAULTS))
            node = node[part]
        leaf = parts[-1]
        if leaf not in node and parts[0] != "method_options":
            raise unknown_name("setting", key, _dotted_keys(DEFAULTS))
        expected = DEFAULTS.get(parts[0]) if len(parts) == 1 else _lookup(DEFAULTS, parts)
        node[leaf] = _coerce(key, value, expected)
    return config


def _lookup(tree: dict, parts: list[str]):
    for part in parts:
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _coerce(key: str, value, default):
    """Check a value against the type of its default (numbers may widen int -> float)."""
    if isinstance(default, dict):  # a whole section (train, distill, ...), not one setting
        if key == "method_options" and isinstance(value, dict):
            return value
        if key != "method_options":
            example = next(iter(default), "key")
            raise LunaConvertError(f"setting {key} is a group of settings; set them one at a time, "
                                   f"e.g. --set {key}.{example}=...")
        raise LunaConvertError(f"setting {key} must be a mapping, e.g. --set method_options.projections=16")
    if value is None or default is None:
        return value
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise LunaConvertError(f"setting {key} must be true or false, got {value!r}")
        return value
    if isinstance(default, (int, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise LunaConvertError(f"setting {key} must be a number, got {value!r}")
        return float(value) if isinstance(default, float) else value
    if isinstance(default, str) and not isinstance(value, str):
        return str(value)
    return value


def _dotted_keys(tree: dict, prefix: str = "") -> list[str]:
    keys = []
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            keys += _dotted_keys(v, f"{prefix}{k}.")
        else:
            keys.append(f"{prefix}{k}")
    return keys
