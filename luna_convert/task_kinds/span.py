"""Extractive question answering (SQuAD v1.1): the answer is a span of the context, scored by SQuAD's F1 and
exact match of the best span's text."""

from __future__ import annotations

import numpy as np

from .. import data
from ..metrics import SPAN_METRICS, span_metrics
from ..tasks import TaskSpec
from .base import TaskKind

# The longest answer considered, in tokens (as transformers' run_qa and the SQuAD baselines decode).
MAX_ANSWER_TOKENS = 30


def best_span(start_logits: np.ndarray, end_logits: np.ndarray, allowed: np.ndarray,
              max_answer_tokens: int = MAX_ANSWER_TOKENS) -> tuple[int, int] | None:
    """The (start, end) token pair, end inclusive, with the highest start + end logit among the ``allowed``
    positions (the context's tokens), start <= end and at most ``max_answer_tokens`` tokens long; None when
    no position is allowed (truncation left no context)."""
    positions = np.flatnonzero(allowed)
    if positions.size == 0:
        return None
    scores = start_logits[positions][:, None].astype(np.float64) + end_logits[positions][None, :]
    length = positions[None, :] - positions[:, None] + 1  # end - start + 1 for each (start, end) pair
    scores[(length < 1) | (length > max_answer_tokens)] = -np.inf
    start, end = np.unravel_index(int(np.argmax(scores)), scores.shape)
    return int(positions[start]), int(positions[end])


def span_answers(logits: np.ndarray, examples) -> list[str]:
    """Each example's predicted answer text: its best span (:func:`best_span`) of ``logits`` [N, 2, S] (start
    and end logits a position) mapped back to the context through the example's token offsets
    (:class:`luna_convert.data.QAExample`); "" when its context was truncated away."""
    answers = []
    for row, example in zip(logits, examples):
        allowed = np.zeros(row.shape[-1], dtype=bool)
        context_tokens = [i for i, span in enumerate(example.offsets) if span is not None]
        allowed[context_tokens] = True
        span = best_span(row[0], row[1], allowed)
        answers.append("" if span is None else example.context[example.offsets[span[0]][0]:example.offsets[span[1]][1]])
    return answers


class SpanKind(TaskKind):
    name = "span"
    auto_class = "AutoModelForQuestionAnswering"
    head = ("ForQuestionAnswering", "question-answering", "qa")
    span_logits = True

    def read_files(self, task: TaskSpec, split: str, data_dir):
        return data.load_qa_split(task, split, data_dir)

    def read_datasets(self, task: TaskSpec, ds, where: str, split: str):
        return data.datasets_qa_split(ds, where)

    def align_labels(self, dataset, task: TaskSpec, id2label: dict | None, num_labels: int):
        """Answers are spans of the context: no labels to align with the model's."""
        return dataset

    def text_loader(self, task: TaskSpec, dataset, loaded, *, train: bool, batch_size: int, max_length: int,
                    seed: int, teacher_targets):
        return data.make_qa_dataloader(dataset, loaded.tokenizer, batch_size=batch_size, max_length=max_length,
                                       shuffle=train, seed=seed)

    def metric_names(self, task: TaskSpec, num_classes: int | None = None) -> tuple[str, ...]:
        return SPAN_METRICS

    def compute_metrics(self, task: TaskSpec, predictions, labels) -> dict[str, float]:
        """The predicted answer texts against each question's gold answer texts."""
        return span_metrics(task, predictions, labels)

    def loader_metrics(self, task: TaskSpec, logits, labels, loader) -> tuple[dict[str, float], int]:
        """The best span's text of each question against its gold answer texts."""
        examples = loader.qa_examples
        return self.compute_metrics(task, span_answers(logits, examples), [e.answers for e in examples]), len(labels)

    def pipeline_tag(self, task: TaskSpec) -> str:
        return "question-answering"
