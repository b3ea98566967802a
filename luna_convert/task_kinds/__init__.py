"""Task kinds: one class per kind of task output, each owning what differs between them (how its data is read
and collated, which head and labels it checks, its loss and predictions, its metrics and headline, what the
model card says). A ``TaskSpec`` names its kind in ``level``; :func:`kind_of` is the one place that reads it.
The rest of the package calls the kind's hooks and never branches on its name (tests/test_task_kinds.py).

No torch at import (``run.config`` checks settings through the kind)."""

from __future__ import annotations

from ..errors import LunaConvertError, unknown_name
from ..tasks import TaskSpec, get_task
from .base import TaskKind
from .embedding import EmbeddingKind, embedding_loss
from .sequence import SequenceKind
from .span import SpanKind, best_span, span_answers
from .token import TokenKind

__all__ = ["TaskKind", "KINDS", "kind_of", "kind_named", "check_head", "load_split", "align_labels",
           "compute_metrics", "metric_names", "embedding_loss", "best_span", "span_answers"]

KINDS: dict[str, TaskKind] = {k.name: k for k in (SequenceKind(), TokenKind(), SpanKind(), EmbeddingKind())}


def kind_named(name: str | TaskKind) -> TaskKind:
    """The kind called ``name`` ("sequence", "token", "span", "embedding"); a kind is returned as it is."""
    if isinstance(name, TaskKind):
        return name
    try:
        return KINDS[name]
    except KeyError:
        raise unknown_name("task kind", str(name), KINDS) from None


def kind_of(task: TaskSpec | str) -> TaskKind:
    """The kind of ``task`` (a TaskSpec or a task name)."""
    return kind_named(get_task(task).level)


def check_head(kind: TaskKind, architectures: list[str], source: str) -> None:
    """A text checkpoint's head (its model classes) fits the task's kind: loading a token or QA head as a
    sequence one (or the other way) would silently replace the finetuned head with an untrained one."""
    for other in KINDS.values():
        if other.head is None:
            continue
        suffix, what, task = other.head
        has_head = any(a.endswith(suffix) for a in architectures)
        if has_head and kind is not other:
            raise LunaConvertError(f"{source} is a {what} model ({architectures[0]}); run it with --task {task}")
        if kind is other and architectures and not has_head:
            raise LunaConvertError(f"{source} is not a {what.split(' ')[0]} model (its architectures: "
                                   f"{', '.join(architectures)}); --task {task} needs one, e.g. Bert{suffix}")


# The kind's hooks for a task named by its TaskSpec or name: what callers outside a run use.

def load_split(task: TaskSpec | str, split: str, data_dir=None, max_examples: int | None = None, seed: int = 0):
    """One split of ``task``'s data, read as its kind reads it (see :func:`luna_convert.data.load_split`)."""
    task = get_task(task)
    return kind_of(task).load_split(task, split, data_dir, max_examples, seed)


def align_labels(dataset, task: TaskSpec | str, id2label: dict | None, num_labels: int):
    """The data's labels as the model's ids, as ``task``'s kind aligns them."""
    task = get_task(task)
    return kind_of(task).align_labels(dataset, task, id2label, num_labels)


def compute_metrics(task: TaskSpec | str, predictions, labels) -> dict[str, float]:
    """Scores of ``predictions`` against ``labels`` for ``task``: logits ``[N, C]`` or class ids ``[N]``
    (classification), scores ``[N]`` or ``[N, 1]`` (regression), logits ``[N, S, C]`` or tag ids ``[N, S]``
    (token tasks), answer texts and each question's gold texts (span tasks), embeddings (embedding tasks)."""
    task = get_task(task)
    return kind_of(task).compute_metrics(task, predictions, labels)


def metric_names(task: TaskSpec | str, num_classes: int | None = None) -> tuple[str, ...]:
    """Keys that :func:`compute_metrics` returns for ``task``."""
    task = get_task(task)
    return kind_of(task).metric_names(task, num_classes)
