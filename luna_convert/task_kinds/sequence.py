"""Sequence classification and regression: a label an example (a text, a text pair or an image); the hooks are
:class:`~luna_convert.task_kinds.base.TaskKind`'s own."""

from __future__ import annotations

from .base import TaskKind


class SequenceKind(TaskKind):
    name = "sequence"
