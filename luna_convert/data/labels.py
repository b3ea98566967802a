"""Label values and class names: parsing raw labels, matching class names, and aligning a
dataset's label ids (a token task's tags) with the model's classes (:func:`align_labels`)."""

from __future__ import annotations

import logging
import math
import re
from typing import Any, Sequence

from ..errors import LunaConvertError
from ..metrics import split_tag
from ..tasks import TaskSpec, get_task

logger = logging.getLogger(__name__)

# Spellings of GLUE label names seen in published checkpoints' id2label.
_LABEL_SYNONYMS: dict[str, str] = {
    "neg": "negative",
    "pos": "positive",
    "not_acceptable": "unacceptable",
    "ungrammatical": "unacceptable",
    "grammatical": "acceptable",
    "not_paraphrase": "not_equivalent",
    "non_paraphrase": "not_equivalent",
    "paraphrase": "equivalent",
    "non_duplicate": "not_duplicate",
    "contradictory": "contradiction",
    "contradict": "contradiction",
    "entail": "entailment",
    "entails": "entailment",
    "non_entailment": "not_entailment",
}

_GENERIC_LABEL = re.compile(r"^label_?(\d+)$")


def normalize_label_name(name: Any) -> str:
    """Case- and separator-insensitive spelling of a class name ("Not Entailment" -> "not_entailment")."""
    s = re.sub(r"[\s\-]+", "_", str(name).strip().lower())
    return _LABEL_SYNONYMS.get(s, s)


def int_or_none(value: Any) -> int | None:
    """``value`` as an int when it is a whole number (int, bool, integral float, numeric string, numpy
    scalar), else None."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value == int(value) else None
    if isinstance(value, str):
        s = value.strip()
        if re.fullmatch(r"[+-]?\d+", s):
            return int(s)
        try:
            f = float(s)
        except ValueError:
            return None
        return int(f) if math.isfinite(f) and f == int(f) else None
    try:  # numpy scalars
        f = float(value)
    except (TypeError, ValueError):
        return None
    return int(f) if math.isfinite(f) and f == int(f) else None


def is_missing(value: Any) -> bool:
    """Whether a cell holds no value: None, NaN or a blank string."""
    if value is None:
        return True
    if isinstance(value, float) and math.isnan(value):
        return True
    return isinstance(value, str) and value.strip() == ""


def parse_labels(task: TaskSpec, raw: Sequence[Any], where: str) -> list:
    """Raw label values -> float scores (regression), int class ids, or (generic tasks
    without label names) strings left for :func:`align_labels` to map."""
    out: list = []
    if task.is_regression:
        for i, v in enumerate(raw):
            try:
                f = float(v)
            except (TypeError, ValueError):
                f = float("nan")
            if is_missing(v) or not math.isfinite(f):
                raise LunaConvertError(f"{where}: example {i + 1} has label {v!r}; task {task.name!r} needs a number")
            out.append(f)
        return out
    names = {normalize_label_name(n): i for i, n in enumerate(task.label_names or ())}
    ints = [int_or_none(v) for v in raw]
    if all(x is not None for x in ints):
        return ints
    if not names:
        for i, v in enumerate(raw):
            if is_missing(v):
                raise LunaConvertError(f"{where}: example {i + 1} has no label; every example needs one")
        return [str(v).strip() if x is None else str(x) for v, x in zip(raw, ints)]
    for i, (v, x) in enumerate(zip(raw, ints)):
        if x is not None:
            out.append(x)
            continue
        key = normalize_label_name(v)
        if key not in names:
            raise LunaConvertError(
                f"{where}: example {i + 1} has label {v!r}; task {task.name!r} expects one of "
                f"{', '.join(task.label_names or ())} or a class id"
            )
        out.append(names[key])
    return out


def model_label_names(id2label: dict | None, num_labels: int) -> list[str] | None:
    """Model class names in index order, or None when they are generic (LABEL_0.., "0"..)."""
    if not id2label:
        return None
    names: dict[int, str] = {}
    for k, v in id2label.items():
        i = int_or_none(k)
        if i is None:
            return None
        names[i] = str(v)
    if sorted(names) != list(range(len(names))):
        return None
    ordered = [names[i] for i in range(len(names))]
    generic = True
    for i, n in enumerate(ordered):
        m = _GENERIC_LABEL.match(n.strip().lower())
        if not ((m and int(m.group(1)) == i) or n.strip() == str(i)):
            generic = False
    return None if generic else ordered


def token_label_names(id2label: dict | None, num_labels: int) -> tuple[str, ...]:
    """A token-classification model's tags in id order (its id2label), each O or B-/I-/E-/S-<type>."""
    names = model_label_names(id2label, num_labels)
    if names is None:
        raise LunaConvertError("the model's id2label has only generic names (LABEL_0, ...), so the data's tags cannot "
                               "be matched to its outputs nor entities found; name its tags in its config.json "
                               'id2label, e.g. {"0": "O", "1": "B-PER", "2": "I-PER"}')
    for name in names:
        split_tag(name)
    return tuple(names)


def short_list(items: Sequence, n: int = 8) -> str:
    """The first ``n`` items joined with commas, and how many there are in all when there are more."""
    items = [str(x) for x in items]
    return ", ".join(items[:n]) + (f", ... ({len(items)} in all)" if len(items) > n else "")


def align_tag_labels(dataset, id2label, num_labels: int):
    """Each sentence's tags (names or ids) as the model's tag ids."""
    names = token_label_names(id2label, num_labels)
    index = {normalize_label_name(n): i for i, n in enumerate(names)}
    sources = dataset["source"] if "source" in dataset.column_names else [f"example {i + 1}" for i in range(len(dataset))]
    aligned = []
    for tags, source in zip(dataset["label"], sources):
        ids = []
        for tag in tags:
            i = int_or_none(tag)
            if i is None:
                i = index.get(normalize_label_name(tag))
            elif not 0 <= i < len(names):
                raise LunaConvertError(f"{source}: tag id {i} is out of range: the model has {len(names)} tags "
                                       f"({short_list(names, 12)})")
            if i is None:
                raise LunaConvertError(f"{source}: tag {tag!r} is not among the model's tags ({short_list(names, 12)}); "
                                       "use the model finetuned on these tags or fix the data")
            ids.append(i)
        aligned.append(ids)
    return dataset.remove_columns("label").add_column("label", aligned)


def _align_image_labels(dataset, task: TaskSpec, id2label, num_labels: int):
    classes = list(getattr(dataset, "classes", []) or [])
    names = model_label_names(id2label, num_labels)
    if names is not None and classes:
        index = {normalize_label_name(n): i for i, n in enumerate(names)}
        if all(normalize_label_name(c) in index for c in classes):
            mapping = {i: index[normalize_label_name(c)] for i, c in enumerate(classes)}
            if any(k != v for k, v in mapping.items()):
                dataset.label_map = mapping
            return dataset
    if len(classes) > num_labels:
        raise LunaConvertError(
            f"the data has {len(classes)} classes but the model predicts {num_labels}; "
            f"use a model trained on these classes or remove the extra class folders"
        )
    return dataset


def align_labels(dataset, task: TaskSpec | str, id2label: dict[int, str] | None, num_labels: int):
    """Make the data's label ids index the model's classes.

    Maps string labels through the model's ``id2label`` (case/separator-insensitive) — or through
    ``task.label_names`` when the model's names are generic (LABEL_0, ...); permutes GLUE class ids
    when the model names the task's classes in another order; maps a token task's tags (names or ids) to
    the model's tag ids (see :func:`token_label_names`). Raises LunaConvertError when the data
    has more classes than the model or when names cannot be matched. Returns the dataset (a new one
    for text; image datasets get a ``label_map``).
    """
    task = get_task(task)
    if task.is_regression:
        return dataset
    if task.kind == "image" or not hasattr(dataset, "column_names"):
        return _align_image_labels(dataset, task, id2label, num_labels)
    if "label" not in dataset.column_names:
        raise LunaConvertError(f"the data for task {task.name!r} has no 'label' column")

    labels = list(dataset["label"])
    model_names = model_label_names(id2label, num_labels)
    model_index = {normalize_label_name(n): i for i, n in enumerate(model_names or [])}
    task_names = [normalize_label_name(n) for n in (task.label_names or ())]
    shown = f"model classes {model_names}" if model_names else f"{num_labels} model classes"
    changed = False
    new: list[int] = []

    if any(isinstance(y, str) for y in labels):
        if model_names is not None:
            lookup = model_index
            what = f"the model's id2label {model_names}"
        elif task_names:
            lookup = {n: i for i, n in enumerate(task_names)}
            what = f"task {task.name!r} labels {list(task.label_names or ())}"
        else:
            lookup = {}
            what = "the model's id2label, which only has generic names (LABEL_0, ...)"
        for y in labels:
            i = int_or_none(y)
            if i is None:
                key = normalize_label_name(y)
                if key not in lookup:
                    raise LunaConvertError(
                        f"data label {y!r} does not match {what}; write the labels as class ids 0..{num_labels - 1} "
                        f"or use a model whose config names these classes"
                    )
                i = lookup[key]
            new.append(i)
        changed = True
    else:
        new = [int(y) for y in labels]
        if model_names is not None and task_names:
            missing = [task.label_names[j] for j, n in enumerate(task_names) if n not in model_index]
            if missing:
                raise LunaConvertError(
                    f"the model's classes {model_names} do not include task {task.name!r} label(s) {missing}; "
                    f"use a model finetuned on {task.name} (or one with generic LABEL_0.. names to keep class ids)"
                )
            perm = [model_index[n] for n in task_names]
            if perm != list(range(len(perm))):
                bad = [y for y in new if y >= len(perm)]
                if bad:
                    raise LunaConvertError(
                        f"label id {bad[0]} is out of range for task {task.name!r} ({len(perm)} classes)"
                    )
                new = [perm[y] if y >= 0 else y for y in new]
                changed = True
                logger.info("remapped %s labels to the model's class order %s", task.name, model_names)

    present = sorted({y for y in new if y >= 0})
    if len(present) > num_labels or (present and present[-1] >= num_labels):
        raise LunaConvertError(
            f"the data has {len(present)} distinct label(s) {present[:10]} but the model has {shown} "
            f"(ids 0..{num_labels - 1}); "
            f"use a model with at least {max(len(present), present[-1] + 1)} classes or check --task"
        )
    if changed:  # plain int64 ids (a hub ClassLabel's names would no longer fit)
        dataset = dataset.remove_columns("label").add_column("label", new)
    return dataset
