"""An LRA run's config, :class:`LRAConfig`: the task, the attention method and its options, the encoder's sizes,
the data's sizes and the training budget. Recipes (``luna_convert/recipes/lra/<task>-<protocol>.yaml``) state
what differs from the defaults; ``--set key=value`` overrides any setting by its dotted name.

``method_options`` maps a method name to its options, so that one recipe pins every method's form (LUNA's is
the paper's) and a run takes the entry of its own method.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..errors import ConversionError, LunaConvertError, unknown_name
from ..linear_methods.options import AttentionOptions
from ..linear_methods.registry import METHODS, get_method, resolve_options
from .data import TASKS, task_info
from .model import SOFTMAX, EncoderSettings

RECIPE_DIR = Path(__file__).resolve().parents[1] / "recipes" / "lra"  # package data
PROTOCOLS = ("cpu", "paper")
SCHEDULES = ("linear", "cosine", "constant")
PRECISIONS = ("no", "bf16", "fp16")
SPLIT_NAMES = ("test", "dev")


@dataclass
class DataSettings:
    """How much data, and how the generated sets are drawn. Counts: None takes every example there is."""

    train_examples: int | None = 2000
    dev_examples: int | None = 500
    test_examples: int | None = 1000
    dev_fraction: float = 0.1  # own data without a dev split: this part of train is held out as dev
    min_length: int = 500  # ListOps: tokens per expression
    max_length: int = 2000
    difficulty: int = 2  # Pathfinder: 1-3, longer curves and more distractors
    max_bytes: int = 4096  # Text and Retrieval: bytes kept per document


@dataclass
class TrainSettings:
    lr: float = 1e-3
    weight_decay: float = 0.01
    schedule: str = "linear"
    warmup_steps: int = 0
    max_steps: int = 500
    batch_size: int = 32
    eval_batch_size: int = 64
    checkpoint_every: int = 0  # 0: no checkpoint before the end (a run then cannot be resumed)
    max_grad_norm: float = 1.0
    mixed_precision: str = "no"


RUN_RECORD = ("overwrite", "run_dir")
SECTIONS = ("encoder", "data", "train")


def as_number(value, default):
    """YAML reads ``1e-3`` (no dot) as a string: a float setting takes it as the number it spells."""
    if isinstance(default, float) and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


@dataclass
class LRAConfig:
    task: str = "listops"
    method: str = SOFTMAX
    name: str | None = None
    description: str = ""
    method_options: dict = field(default_factory=dict)  # method -> its options
    seed: int = 0
    data_dir: str | None = None  # image, text, retrieval: the user's folder
    cache_dir: str | None = None  # generated sets; None: ~/.cache/luna_convert/lra
    output_dir: str = "outputs"
    eval_split: str = "test"  # the split results report; dev is scored beside it
    encoder: EncoderSettings = field(default_factory=EncoderSettings)
    data: DataSettings = field(default_factory=DataSettings)
    train: TrainSettings = field(default_factory=TrainSettings)
    overwrite: bool | None = None
    run_dir: str | None = None

    def options(self) -> dict:
        """The options of this run's method, as given (by name)."""
        return dict(self.method_options.get(self.method) or {})

    def attention_options(self) -> AttentionOptions | None:
        """This run's method options validated into the method's options object once (the same object until
        ``method`` or ``method_options`` change): what every encoder layer is built with. None for softmax."""
        if self.method == SOFTMAX:
            return None
        key = (self.method, repr(self.options()))  # repr: 1, 1.0 and True are different settings
        if self.__dict__.get("_options_key") != key:
            try:
                self._options = resolve_options(self.method, self.options())
            except ConversionError as e:
                raise LunaConvertError(f"method_options.{self.method}: {e}") from None
            self._options_key = key
        return self._options

    def to_dict(self) -> dict:
        data = asdict(self)
        return {k: v for k, v in data.items() if not (k in RUN_RECORD and v is None)}

    @classmethod
    def from_dict(cls, data: dict) -> "LRAConfig":
        """A config from a recipe or a saved config.json; unknown keys are an error; validated."""
        data = copy.deepcopy(data)
        config = cls()
        for key, value in data.items():
            if key in SECTIONS:
                if not isinstance(value, dict):
                    raise LunaConvertError(f"LRA setting {key} must be a mapping of settings, got {value!r}")
                section = getattr(config, key)
                for sub, subvalue in value.items():
                    if sub not in {f.name for f in fields(section)}:
                        raise unknown_name("LRA setting", f"{key}.{sub}", setting_names())
                    setattr(section, sub, as_number(subvalue, getattr(section, sub)))
            elif key in {f.name for f in fields(cls)}:
                setattr(config, key, value)
            else:
                raise unknown_name("LRA setting", key, setting_names())
        config.check()
        return config

    def check(self) -> None:
        task_info(self.task)
        if self.method != SOFTMAX:
            get_method(self.method)
        if not isinstance(self.method_options, dict) or not all(isinstance(v, dict) or v is None
                                                                for v in self.method_options.values()):
            raise LunaConvertError("method_options must map a method name to its options, e.g. "
                                   "method_options.luna.projections=8")
        for name in self.method_options:
            if name != SOFTMAX and name not in METHODS:
                raise unknown_name("method in method_options", name, METHODS)
        self.attention_options()
        self.encoder.check()
        check_counts(self.data)
        if task_info(self.task).generated:
            unset = [n for n in ("train_examples", "dev_examples", "test_examples") if getattr(self.data, n) is None]
            if unset:
                raise LunaConvertError(f"lra {self.task} generates its data: set data.{unset[0]} to a number of "
                                       "examples (null means all of a folder's)")
        check_train(self.train)
        if self.eval_split not in SPLIT_NAMES:
            raise LunaConvertError(f"eval_split must be one of {', '.join(SPLIT_NAMES)}, got {self.eval_split!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise LunaConvertError(f"seed must be a whole number, got {self.seed!r}")


def positive_int(name: str, value, allow_none: bool = False, allow_zero: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < (0 if allow_zero else 1):
        raise LunaConvertError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} whole number, "
                               f"got {value!r}")


def check_counts(d: DataSettings) -> None:
    for name in ("train_examples", "dev_examples", "test_examples"):
        positive_int(f"data.{name}", getattr(d, name), allow_none=True)
    for name in ("min_length", "max_length", "max_bytes"):
        positive_int(f"data.{name}", getattr(d, name))
    if d.min_length > d.max_length:
        raise LunaConvertError(f"data.min_length ({d.min_length}) is above data.max_length ({d.max_length})")
    if d.difficulty not in (1, 2, 3):
        raise LunaConvertError(f"data.difficulty must be 1, 2 or 3, got {d.difficulty!r}")
    if not (isinstance(d.dev_fraction, (int, float)) and 0 < d.dev_fraction < 1):
        raise LunaConvertError(f"data.dev_fraction must be between 0 and 1, got {d.dev_fraction!r}")


def check_train(t: TrainSettings) -> None:
    for name in ("max_steps", "batch_size", "eval_batch_size"):
        positive_int(f"train.{name}", getattr(t, name))
    for name in ("warmup_steps", "checkpoint_every"):
        positive_int(f"train.{name}", getattr(t, name), allow_zero=True)
    for name in ("lr", "weight_decay", "max_grad_norm"):
        value = getattr(t, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or (name == "lr" and value == 0):
            raise LunaConvertError(f"train.{name} must be a {'positive' if name == 'lr' else 'non-negative'} number, "
                                   f"got {value!r}")
    if t.schedule not in SCHEDULES:
        raise LunaConvertError(f"train.schedule must be one of {', '.join(SCHEDULES)}, got {t.schedule!r}")
    if t.mixed_precision not in PRECISIONS:
        raise LunaConvertError(f"train.mixed_precision must be one of {', '.join(PRECISIONS)}, got {t.mixed_precision!r}")


def setting_names() -> list[str]:
    config = LRAConfig()
    names = [f.name for f in fields(LRAConfig) if f.name not in (*SECTIONS, *RUN_RECORD)]
    for section in SECTIONS:
        names += [f"{section}.{f.name}" for f in fields(getattr(config, section))]
    return names


# ------------------------------------------------------------------ recipes and overrides
def recipe_path(task: str, protocol: str) -> Path:
    return RECIPE_DIR / f"{task}-{protocol}.yaml"


def available_lra_recipes() -> dict[str, str]:
    """Recipe name (``<task>-<protocol>``) -> its one-line description."""
    return {p.stem: read_yaml(p).get("description", "") for p in sorted(RECIPE_DIR.glob("*.yaml"))}


def read_yaml(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise LunaConvertError(f"LRA recipe {path} cannot be read: {e}".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise LunaConvertError(f"LRA recipe {path} must hold a mapping of settings")
    return data


def load_lra_config(task: str, protocol: str = "cpu", recipe: str | None = None,
                    overrides: dict | None = None) -> LRAConfig:
    """The config of ``task``: a recipe file (``recipe``, else the task's ``protocol`` recipe) with
    ``overrides`` (dotted keys) applied, validated."""
    task_info(task)
    if recipe is None:
        if protocol not in PROTOCOLS:
            raise unknown_name("LRA protocol", protocol, PROTOCOLS)
        path = recipe_path(task, protocol)
        data = read_yaml(path) if path.is_file() else {}
    else:
        path = Path(recipe)
        if not path.is_file():
            raise LunaConvertError(f"LRA recipe {path} does not exist; pass a YAML file or use --protocol")
        data = read_yaml(path)
    data = {"name": path.stem, **data, "task": task}
    for key, value in (overrides or {}).items():
        set_dotted(data, key, value)
    return LRAConfig.from_dict(data)


def set_dotted(data: dict, key: str, value) -> None:
    parts = key.split(".")
    if parts[0] not in {f.name for f in fields(LRAConfig)}:
        raise unknown_name("LRA setting", key, setting_names())
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise unknown_name("LRA setting", key, setting_names())
    node[parts[-1]] = value


def known_tasks() -> tuple[str, ...]:
    return tuple(TASKS)
