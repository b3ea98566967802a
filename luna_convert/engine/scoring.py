"""Scoring a model on a task's eval loaders; for extractive QA, the best answer span of each example first; for
scored sentence pairs, the two embeddings of each pair side by side."""

from __future__ import annotations

import numpy as np

from ..metrics import compute_metrics
from .training import predict

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


def score(accelerator, model, loaders: dict, task) -> tuple[dict, int]:
    """Metrics on every eval split (extra splits prefixed by their name) and examples counted."""
    metrics, counted = {}, 0
    for i, (name, loader) in enumerate(loaders.items()):
        logits, labels = predict(accelerator, model, accelerator.prepare_data_loader(loader), f"eval {name}")
        if task.is_span_level:  # predicted answer texts against the gold answer texts
            examples = loader.qa_examples
            values = compute_metrics(task, span_answers(logits, examples), [e.answers for e in examples])
        elif task.is_embedding_level and getattr(loader, "scored_pairs", False):
            # texts a0, b0, a1, b1, ...: pair i is rows 2i and 2i + 1, both labelled with the pair's score
            logits, labels = logits.reshape(-1, 2, logits.shape[-1]), labels[0::2]
            values = compute_metrics(task, logits, labels)
        else:
            values = compute_metrics(task, logits, labels)
        prefix = "" if i == 0 else f"{name}/"
        metrics.update({f"{prefix}{k}": v for k, v in values.items()})
        counted += len(labels) if i == 0 else 0
    return metrics, counted
