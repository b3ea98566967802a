"""A finished run's record: :class:`RunResults`, what ``results.json`` holds.

The pipeline builds one record and writes it once (``RunResults.write``); the model card, the curves,
``report``, ``compare`` and the command line read it back by attribute (``RunResults.read``). On disk
the keys are the record's field names, ``schema_version`` first. A file written before the version was
recorded (no ``schema_version``: version 0, the same keys) still reads: what it lacks takes the field's
default, and keys the record does not know are kept in ``extra`` and written back unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from ..errors import LunaConvertError
from ..fileio import atomic_write_json
from .config import RunConfig

RESULTS_SCHEMA_VERSION = 1
# What every results file has held since the first version; all else has a default.
REQUIRED_KEYS = ("method", "task", "headline_metric", "teacher_score", "converted_score", "run_dir")
# Added since: written only where a run has them, so other runs' files keep the keys they had.
OPTIONAL_KEYS = ("layer_selection", "hybrid_check")


@dataclass(frozen=True)
class StepCounts:
    """Optimizer updates per training stage."""

    distill: int = 0
    finetune: int = 0


@dataclass(frozen=True)
class Timings:
    """Seconds per stage; None for a stage the run did not have (written as an absent key)."""

    teacher_eval_s: float | None = None
    distill_s: float | None = None
    finetune_s: float | None = None
    eval_s: float | None = None
    total_s: float | None = None


@dataclass(frozen=True)
class ConversionSummary:
    """``ConversionReport.to_dict()`` as recorded: the method, its options (defaults filled in), what was replaced."""

    method: str
    options: dict = field(default_factory=dict)
    params_added: int = 0
    modules: list = field(default_factory=list)
    kept_local: list = field(default_factory=list)
    kept_softmax: list = field(default_factory=list)


@dataclass(frozen=True)
class RunResults:
    """One finished run: scores, what it ran with, how long it took, where it is.

    Indexing by a results.json key (``results["steps"]``) reads the JSON form, for code written against
    the dict :func:`~luna_convert.run.pipeline.run_conversion` returned before the record existed."""

    method: str
    task: str
    headline_metric: str
    teacher_score: float
    converted_score: float
    run_dir: str
    recipe: str | None = None
    model: str | None = None
    recovered_pct: float | None = None
    stage_scores: dict[str, float] = field(default_factory=dict)  # after_conversion, after_distillation, final
    head_fit: dict | None = None  # engine.head_fit's per-head table and means
    lora: dict | None = None  # engine.lora's summary when the run trained adapters
    method_recipe: dict = field(default_factory=dict)  # the run settings the method's recipe filled in
    teacher_metrics: dict[str, float] = field(default_factory=dict)
    converted_metrics: dict[str, float] = field(default_factory=dict)
    eval_examples: int | None = None
    truncated_examples: int = 0
    truncated_by_split: dict[str, int] = field(default_factory=dict)
    resolved: dict | None = None  # own data: what was chosen and why
    steps: StepCounts = field(default_factory=StepCounts)
    final_loss: float | None = None
    timings: Timings = field(default_factory=Timings)
    seed: int | None = None
    num_processes: int = 1
    device: str | None = None
    conversion: ConversionSummary | None = None  # None: the softmax control, which converts nothing
    config: dict = field(default_factory=dict)  # RunConfig.to_dict(); run_config() reads it back
    versions: dict[str, str] = field(default_factory=dict)
    finished_at: str | None = None  # ISO time; orders runs in `report`
    # keep_softmax_layers auto: the target, the chosen layers, the frontier (run/layer_selection.py); None: not asked
    layer_selection: dict | None = None
    # a window run: the score and each layer's output with the linear part removed (engine/hybrid_check.py)
    hybrid_check: dict | None = None
    schema_version: int = RESULTS_SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)  # keys this version does not know, kept as read

    # ------------------------------------------------------------ reading back
    def run_config(self) -> RunConfig:
        return RunConfig.from_dict(self.config)

    def stage_score(self, stage: str) -> float | None:
        """The headline score after ``stage``; a run recorded without stage scores still has its final one."""
        return self.stage_scores.get(stage, self.converted_score if stage == "final" else None)

    @property
    def attention_kl(self) -> float | None:
        """KL(softmax || linear) per attention row, mean over heads, after training (None: not measured)."""
        return (self.head_fit or {}).get("mean_kl")

    def __getitem__(self, key: str) -> Any:
        return self.to_json()[key]

    # ------------------------------------------------------------ the file
    def to_json(self) -> dict:
        """results.json's content: ``schema_version``, then every field in order, then ``extra``."""
        data: dict[str, Any] = {"schema_version": self.schema_version}
        for f in fields(self):
            if f.name in ("schema_version", "extra"):
                continue
            value = getattr(self, f.name)
            if value is None and f.name in OPTIONAL_KEYS:
                continue
            if isinstance(value, Timings):
                value = {k: v for k, v in _as_dict(value).items() if v is not None}
            elif isinstance(value, (StepCounts, ConversionSummary)):
                value = _as_dict(value)
            data[f.name] = value
        return {**data, **self.extra}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str | Path = "results.json") -> RunResults:
        """The record of a results.json's content (any version up to this one's); LunaConvertError naming
        ``source`` for content no version wrote."""
        if not isinstance(data, Mapping):
            raise LunaConvertError(f"{source} does not hold a JSON object; remove that run folder or pass the others")
        version = data.get("schema_version", 0)
        if not isinstance(version, int) or version > RESULTS_SCHEMA_VERSION:
            raise LunaConvertError(f"{source} has schema_version {version!r}, newer than this luna-convert reads "
                                   f"({RESULTS_SCHEMA_VERSION}); upgrade luna-convert")
        missing = [k for k in REQUIRED_KEYS if k not in data]
        if missing:
            raise LunaConvertError(f"{source} lacks {', '.join(missing)}; it is no luna-convert results file")
        known = {f.name for f in fields(cls)} - {"extra"}
        values = {k: v for k, v in data.items() if k in known}
        try:
            values["steps"] = StepCounts(**(data.get("steps") or {}))
            values["timings"] = Timings(**(data.get("timings") or {}))
            if data.get("conversion") is not None:
                values["conversion"] = ConversionSummary(**data["conversion"])
        except TypeError as e:
            raise LunaConvertError(f"{source}: {e}; remove that run folder or pass the others") from None
        values["schema_version"] = RESULTS_SCHEMA_VERSION
        return cls(**values, extra={k: v for k, v in data.items() if k not in known})

    @classmethod
    def read(cls, path: str | Path) -> RunResults:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise LunaConvertError(f"cannot read {path} ({e}); remove that run folder or pass the others") from None
        return cls.from_json(data, path)

    def write(self, path: str | Path) -> None:
        atomic_write_json(Path(path), self.to_json())


def _as_dict(record) -> dict:
    return {f.name: getattr(record, f.name) for f in fields(record)}
