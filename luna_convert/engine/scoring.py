"""Scoring a model on a task's eval loaders."""

from __future__ import annotations

from ..metrics import compute_metrics
from .training import predict


def score(accelerator, model, loaders: dict, task) -> tuple[dict, int]:
    """Metrics on every eval split (extra splits prefixed by their name) and examples counted."""
    metrics, counted = {}, 0
    for i, (name, loader) in enumerate(loaders.items()):
        logits, labels = predict(accelerator, model, accelerator.prepare_data_loader(loader), f"eval {name}")
        values = compute_metrics(task, logits, labels)
        prefix = "" if i == 0 else f"{name}/"
        metrics.update({f"{prefix}{k}": v for k, v in values.items()})
        counted += len(labels) if i == 0 else 0
    return metrics, counted
