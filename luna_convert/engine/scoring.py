"""Scoring a model on a task's eval loaders: its predictions, scored as the task's kind scores them."""

from __future__ import annotations

from .training import predict


def score(accelerator, model, loaders: dict, task, kind) -> tuple[dict, int]:
    """Metrics on every eval split (extra splits prefixed by their name) and examples counted. ``kind``: the
    task's kind (``luna_convert.task_kinds``), whose ``loader_metrics`` turns the predictions into scores (QA's
    best spans, scored pairs' embeddings side by side) and counts the examples scored."""
    metrics, counted = {}, 0
    for i, (name, loader) in enumerate(loaders.items()):
        logits, labels = predict(accelerator, model, accelerator.prepare_data_loader(loader), f"eval {name}")
        values, examples = kind.loader_metrics(task, logits, labels, loader)
        prefix = "" if i == 0 else f"{name}/"
        metrics.update({f"{prefix}{k}": v for k, v in values.items()})
        counted += examples if i == 0 else 0
    return metrics, counted
