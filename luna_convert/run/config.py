"""The run config: one typed object, :class:`RunConfig`, with a section per concern.

The field defaults are the defaults; a recipe states only what differs. :meth:`RunConfig.from_dict` reads
the saved layout (a run's config.json; keys it lacks, written by an older version, keep their defaults)
and validates it, so a bad setting is refused before any model is loaded; :meth:`RunConfig.to_dict` is
config.json's content. Recipes and ``--set`` overrides are read in :mod:`.recipes`.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from typing import Any, Iterator, Mapping

from ..errors import LunaConvertError, check_peft_available, unknown_name
from ..linear_methods.options import AttentionOptions
from ..linear_methods.registry import options_of, resolve_options
from ..task_kinds import kind_of
from ..tasks import EMBEDDING_LOSSES

# The control run of `compare`: the original model finetuned unconverted with the same budget, so that
# "% recovered" can be read against what the extra training alone does to the teacher.
CONTROL_METHOD = "softmax"
# A keyword of convert() itself that method_options passes on with the method's options.
CONVERT_KEYWORD_OPTIONS = ("convert_local_layers",)
# keep_softmax_layers' value that asks for the layers to be chosen (tools/layer_selection.py)
AUTO_LAYERS = "auto"


@dataclass
class ColumnSettings:
    """Own data: the columns to read, detected by name when None."""

    text: str | None = None
    text_pair: str | None = None
    label: str | None = None


@dataclass
class TrainSettings:
    """Finetuning on the task (and the data loading every stage shares)."""

    lr: float = 2e-5
    added_lr: float | None = None  # learning rate of what conversion added (feature maps, DWC); null: train.lr
    weight_decay: float = 0.01
    schedule: str = "linear"  # linear | cosine | constant
    warmup_ratio: float = 0.06
    epochs: float = 3.0
    max_steps: int | None = None  # optimizer steps, overriding epochs (0: no finetuning); null: epochs count
    batch_size: int = 32
    eval_batch_size: int = 64
    grad_accum: int = 1
    max_length: int = 128
    image_size: int | None = None  # default: the model's own preprocessing size
    mixed_precision: str = "no"  # no | bf16 | fp16
    checkpoint_every: int = 0  # 0: only at stage ends
    max_grad_norm: float = 1.0
    augment: bool = True  # light train-time augmentation for images
    max_train_examples: int | None = None
    max_eval_examples: int | None = None
    score_stages: bool = True  # also score right after conversion and after distillation
    # the embedding task's loss against the teacher's embeddings: cosine (1 - cosine similarity) | mse
    embedding_loss: str = "cosine"
    # Weight w of the original (unconverted) model's logits in the finetuning loss:
    # (1 - w) task loss + w KL(teacher || model), the teacher frozen (RADLADS-style). 0: labels only.
    teacher_kd: float = 0.0


@dataclass
class LoraSettings:
    """LoRA second stage (peft): adapters of this rank on the pretrained linear layers, the rest of the
    pretrained weights frozen except the task head; what conversion added trains in full. 0: off."""

    rank: int = 0
    alpha: float | None = None  # null: 2 x rank
    dropout: float = 0.0


@dataclass
class DistillSettings:
    """Attention distillation before finetuning."""

    steps: int | None = None  # None: the method's recipe (default_steps if it distils, else 0)
    default_steps: int = 300
    lr: float = 1e-2
    # attention (row cross-entropy, N x N) | output (layer output MSE, linear in N) | logits (KL to the
    # model's own logits under softmax attention; linear in N)
    target: str = "attention"
    batch_size: int | None = None  # default: train.batch_size


@dataclass
class LayerSelectionSettings:
    """``keep_softmax_layers: auto`` (tools/layer_selection.py): the fewest attention layers left softmax whose
    hybrid keeps ``target_pct`` % of the softmax control's score on a held-out part of the training data."""

    target_pct: float = 99.0  # percent of the control's score (the unconverted model, same budget)
    holdout: float = 0.15  # fraction of the training data held out (seeded) to score the candidates on
    time_lengths: list = field(default_factory=lambda: [4096, 8192])  # tokens the frontier's forward is timed at


# Fields of a RunConfig that are the run's record, not settings: no recipe or --set names them; config.json
# holds each one that is set.
RUN_RECORD = ("overwrite", "run_dir", "auto", "resolved", "selection")


@dataclass
class RunConfig:
    """Everything a run is made of; ``luna-convert run`` builds one from a recipe and the command line."""

    name: str | None = None
    description: str = ""
    model: str | None = None  # hub id, local folder, "timm:<name>" or "builtin:<name>"
    task: str | None = None
    data_dir: str | None = None
    eval_split: str | None = None  # default: the task's evaluation split
    train_split: str | None = None  # default: the task's train split (own data: the file/folder/split called train)
    metric: str | None = None  # headline metric; default: the task's (accuracy for classification, pearson for regression)
    columns: ColumnSettings = field(default_factory=ColumnSettings)
    encoding: str | None = None  # of the text data files (csv, tsv, json lines); null: UTF-8, a BOM allowed
    # ImageFolder images that do not decode: left out of the run (and counted) instead of refused
    skip_unreadable_images: bool = False
    method: str = "luna"
    method_options: dict = field(default_factory=dict)
    # attention layers (0-based; negative from the end) left softmax: a hybrid; "auto": chosen (layer_selection)
    keep_softmax_layers: list[int] | str = field(default_factory=list)
    seed: int = 42
    output_dir: str = "outputs"
    train: TrainSettings = field(default_factory=TrainSettings)
    lora: LoraSettings = field(default_factory=LoraSettings)
    distill: DistillSettings = field(default_factory=DistillSettings)
    layer_selection: LayerSelectionSettings = field(default_factory=LayerSelectionSettings)
    # The run's record (RUN_RECORD); None: not set, and not saved.
    overwrite: bool | None = None  # --overwrite: this run may replace the run in run_dir (the CLI records it always)
    run_dir: str | None = None  # --run-dir, or compare's folder for this run
    auto: list[str] | None = None  # own data: the settings chosen from the model and data (autoconfig.mark_auto)
    resolved: dict | None = None  # own data: what was chosen and why (autoconfig.resolve_own_data)
    # a run of keep_softmax_layers auto: {"role": "candidate", "holdout", "seed"} (trained without the held-out
    # part, scored on it) or {"role": "final", "target_pct", ...} (the chosen set's full run)
    selection: dict | None = None

    # ------------------------------------------------------------ reading and writing
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunConfig:
        """A config from its saved layout (config.json, results.json's ``config``), validated; keys it lacks
        keep their defaults. An unknown key, a value of the wrong type or out of range: LunaConvertError."""
        config = _read_section(cls, data, "", allowed=RUN_RECORD)
        config.validate()
        return config

    @classmethod
    def from_recipe(cls, data: Mapping[str, Any]) -> RunConfig:
        """A recipe file's settings, validated: as :meth:`from_dict`, but the run's record is no setting."""
        config = _read_section(cls, data, "", allowed=())
        config.validate()
        return config

    def to_dict(self) -> dict:
        """config.json's content: every setting in order, then the run's record where set."""
        data = asdict(self)
        for name in RUN_RECORD:
            if data[name] is None:
                del data[name]
        return data

    # ------------------------------------------------------------ settings by dotted name
    @classmethod
    def setting_names(cls) -> list[str]:
        """Every setting's dotted name (``train.lr``; ``method_options`` as one): what ``--set`` takes."""
        return [name for name, _ in _leaves(cls())]

    def settings(self) -> dict[str, Any]:
        """Every setting by its dotted name, in order; each method option given as ``method_options.NAME``."""
        out: dict[str, Any] = {}
        for name, value in _leaves(self):
            if name == "method_options":
                out.update({f"{name}.{key}": option for key, option in value.items()})
            else:
                out[name] = value
        return out

    def setting(self, name: str) -> Any:
        """A setting by its dotted name (``train.lr``)."""
        section, _, leaf = name.rpartition(".")
        return getattr(getattr(self, section) if section else self, leaf)

    def set_setting(self, name: str, value: Any) -> None:
        section, _, leaf = name.rpartition(".")
        setattr(getattr(self, section) if section else self, leaf, value)

    # ------------------------------------------------------------ checks
    def validate(self) -> None:
        """Refuse settings that cannot work, each with a one-line message naming the setting: the task and
        method names, every number and choice, and the method options (built as the method's options
        object), before any model is loaded. What only a model can tell is checked when it is loaded
        (``pipeline``: supported attention, keep_softmax_layers in range, options that fit its heads)."""
        if self.task:
            kind_of(self.task).check_config(self)
        control = self.method == CONTROL_METHOD
        if not control:
            options_of(self.method)  # an unknown method name first
        t = self.train
        for key in ("batch_size", "eval_batch_size", "grad_accum"):
            value = getattr(t, key)
            if not isinstance(value, int) or value < 1:
                raise LunaConvertError(f"train.{key} must be a positive integer, got {value!r}")
        if not (_is_number(t.lr) and t.lr > 0):
            raise LunaConvertError(f"train.lr must be positive, got {t.lr!r}")
        kept = self.keep_softmax_layers
        if kept != AUTO_LAYERS and (not isinstance(kept, list) or not all(_is_int(i) for i in kept)):
            raise LunaConvertError(f"keep_softmax_layers must be a list of layer indices, e.g. [0, 5], got {kept!r} "
                                   "(or auto: chosen for a target score)")
        if kept and control:
            raise LunaConvertError(f"keep_softmax_layers {'auto ' if kept == AUTO_LAYERS else ''}needs a linear "
                                   "method; the softmax control converts nothing")
        if t.mixed_precision not in ("no", "bf16", "fp16"):
            raise LunaConvertError(f"train.mixed_precision must be no, bf16 or fp16, got {t.mixed_precision!r}")
        for key, value, ok, what in self._range_checks():
            if not ok:
                raise LunaConvertError(f"{key} must be {what}, got {value!r}; fix it with --set {key}=...")
        self.attention_options()

    def attention_options(self) -> AttentionOptions | None:
        """The method's options object: ``method_options`` (less convert's own keywords) validated into the
        method's options dataclass once, the same object returned until ``method`` or ``method_options``
        change; what the run converts with (``convert(..., options=)``) and saves. None for the control."""
        if self.method == CONTROL_METHOD:
            return None
        given = {k: v for k, v in self.method_options.items() if k not in CONVERT_KEYWORD_OPTIONS}
        key = (self.method, repr(given))  # repr: 1, 1.0 and True are different settings
        if self.__dict__.get("_options_key") != key:
            self._options, self._options_key = resolve_options(self.method, given), key
        return self._options

    def control(self) -> RunConfig:
        """A copy of this config as the softmax control (same data and budget, nothing converted): what
        ``compare`` and the layer selection run as their control."""
        return replace(copy.deepcopy(self), method=CONTROL_METHOD, method_options={}, keep_softmax_layers=[])

    def convert_keywords(self) -> dict[str, Any]:
        """The keywords of convert() itself given in ``method_options`` (``convert_local_layers``)."""
        return {k: v for k, v in self.method_options.items() if k in CONVERT_KEYWORD_OPTIONS}

    def check_runnable(self) -> None:
        """What a run needs besides valid settings: a model, a task (or own data), peft for LoRA."""
        if not self.model:
            raise LunaConvertError("no model given: pass --model ID|PATH or a recipe that names one")
        if not self.task and not self.data_dir:
            raise LunaConvertError("no task given: pass --task NAME or a recipe that names one (see `luna-convert "
                                   "recipes`), or --data-dir with your own data")
        self.validate()  # a config built or changed in Python has not been through from_dict
        if self.lora.rank:
            check_peft_available()

    def _range_checks(self) -> list[tuple[str, Any, bool, str]]:
        """(setting, value, whether it is valid, what it must be) of the remaining numbers and choices."""
        t, d, lora, ls = self.train, self.distill, self.lora, self.layer_selection

        checks = [
            ("train.max_steps", t.max_steps, t.max_steps is None or _is_int(t.max_steps) and t.max_steps >= 0,
             "a whole number of steps (0: no finetuning), or null (then train.epochs counts)"),
            ("train.epochs", t.epochs, t.max_steps is not None or _is_number(t.epochs) and t.epochs > 0,
             "a positive number"),
            ("encoding", self.encoding, self.encoding is None or _is_codec(self.encoding),
             "a text encoding Python knows (e.g. utf-8, cp1252, latin-1) or null (UTF-8)"),
            ("skip_unreadable_images", self.skip_unreadable_images, isinstance(self.skip_unreadable_images, bool),
             "true or false"),
            ("train.checkpoint_every", t.checkpoint_every, _is_int(t.checkpoint_every) and t.checkpoint_every >= 0,
             "a whole number of steps (0: no intermediate checkpoints)"),
            ("train.warmup_ratio", t.warmup_ratio, _is_number(t.warmup_ratio) and 0 <= t.warmup_ratio < 1,
             "a fraction in [0, 1)"),
            ("train.added_lr", t.added_lr, t.added_lr is None or _is_number(t.added_lr) and t.added_lr > 0,
             "positive, or null (train.lr)"),
            ("train.score_stages", t.score_stages, isinstance(t.score_stages, bool), "true or false"),
            ("train.weight_decay", t.weight_decay, _is_number(t.weight_decay) and t.weight_decay >= 0, "0 or more"),
            ("train.max_grad_norm", t.max_grad_norm, t.max_grad_norm is None or _is_number(t.max_grad_norm)
             and t.max_grad_norm >= 0, "0 or more (0 or null: no clipping)"),
            ("train.max_length", t.max_length, _is_int(t.max_length) and t.max_length >= 1, "a positive integer"),
            ("train.image_size", t.image_size, t.image_size is None or _is_int(t.image_size) and t.image_size >= 1,
             "a positive integer or null (the model's size)"),
            ("train.schedule", t.schedule, t.schedule in ("linear", "cosine", "constant"), "linear, cosine or constant"),
            ("train.teacher_kd", t.teacher_kd, _is_number(t.teacher_kd) and 0 <= t.teacher_kd <= 1,
             "a weight in [0, 1] (0: labels only)"),
            ("train.embedding_loss", t.embedding_loss, t.embedding_loss in EMBEDDING_LOSSES,
             " or ".join(EMBEDDING_LOSSES)),
            ("distill.steps", d.steps, d.steps is None or _is_int(d.steps) and d.steps >= 0,
             "0 or more, or null (the method's default)"),
            ("distill.default_steps", d.default_steps, _is_int(d.default_steps) and d.default_steps >= 0, "0 or more"),
            ("distill.lr", d.lr, _is_number(d.lr) and d.lr > 0, "positive"),
            ("distill.target", d.target, d.target in ("attention", "output", "logits"), "attention, output or logits"),
            ("distill.batch_size", d.batch_size, d.batch_size is None or _is_int(d.batch_size) and d.batch_size >= 1,
             "a positive integer or null (train.batch_size)"),
            ("lora.rank", lora.rank, _is_int(lora.rank) and lora.rank >= 0, "0 (off) or a positive integer"),
            ("lora.alpha", lora.alpha, lora.alpha is None or _is_number(lora.alpha) and lora.alpha > 0,
             "positive, or null (2 x rank)"),
            ("lora.dropout", lora.dropout, _is_number(lora.dropout) and 0 <= lora.dropout < 1, "a fraction in [0, 1)"),
            ("layer_selection.target_pct", ls.target_pct, _is_number(ls.target_pct) and 0 < ls.target_pct <= 100,
             "a percentage in (0, 100]"),
            ("layer_selection.holdout", ls.holdout, _is_number(ls.holdout) and 0 < ls.holdout < 1, "a fraction in (0, 1)"),
            ("layer_selection.time_lengths", ls.time_lengths, isinstance(ls.time_lengths, list)
             and all(_is_int(n) and n >= 1 for n in ls.time_lengths), "a list of token counts, e.g. [4096, 8192]"),
        ]
        for key in ("max_train_examples", "max_eval_examples"):
            value = getattr(t, key)
            checks.append((f"train.{key}", value, value is None or _is_int(value) and value >= 1,
                           "a positive integer or null (all)"))
        return checks


def coerce_setting(key: str, value, default):
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


def _read_section(cls: type, data: Mapping[str, Any], prefix: str, allowed: tuple[str, ...] = ()):
    """``cls`` (RunConfig or one of its sections) from a mapping of its fields, each checked against the
    type of its default; ``allowed``: run-record fields accepted besides the settings."""
    if not isinstance(data, Mapping):
        raise LunaConvertError(f"a run config must be a mapping of settings, got {type(data).__name__}")
    defaults = cls()
    settings = [f.name for f in fields(cls) if f.name not in RUN_RECORD]
    values = {}
    for key, value in copy.deepcopy(dict(data)).items():  # the config owns its lists and mappings
        name = f"{prefix}{key}"
        if key not in settings and key not in allowed:
            raise unknown_name("recipe setting", name, [f"{prefix}{k}" for k in settings])
        default = getattr(defaults, key)
        if is_dataclass(default):
            if not isinstance(value, Mapping):
                raise LunaConvertError(f"recipe setting {name} must be a mapping")
            values[key] = _read_section(type(default), value, f"{name}.")
        else:
            values[key] = coerce_setting(name, value, default)
    return cls(**values)


def _leaves(obj, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted name, value) of every setting of ``obj``, sections walked into, the run's record left out."""
    for f in fields(obj):
        if f.name in RUN_RECORD:
            continue
        value = getattr(obj, f.name)
        if is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_codec(name) -> bool:
    import io

    try:  # as open() checks it: codecs that are not text encodings (hex, zlib, ...) are refused too
        return isinstance(name, str) and io.TextIOWrapper(io.BytesIO(), encoding=name).encoding == name
    except LookupError:
        return False
