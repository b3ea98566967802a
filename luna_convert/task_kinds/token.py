"""Token classification (NER): a tag a word, scored by entity-level F1."""

from __future__ import annotations

import dataclasses

from .. import data
from ..metrics import TOKEN_METRICS, token_metrics
from ..tasks import TaskSpec
from .base import TaskKind


class TokenKind(TaskKind):
    name = "token"
    auto_class = "AutoModelForTokenClassification"
    head = ("ForTokenClassification", "token-classification (NER)", "ner")

    def read_files(self, task: TaskSpec, split: str, data_dir):
        return data.load_token_split(task, split, data_dir)

    def read_datasets(self, task: TaskSpec, ds, where: str, split: str):
        return data.datasets_token_split(ds, where)

    def align_labels(self, dataset, task: TaskSpec, id2label: dict | None, num_labels: int):
        """Each word's tag (a name or an id) as the model's tag id (see :func:`luna_convert.data.token_label_names`)."""
        return data.align_tag_labels(dataset, id2label, num_labels)

    def task_for_model(self, task: TaskSpec, loaded) -> TaskSpec:
        """The tag names come from the model's id2label."""
        names = data.token_label_names(loaded.id2label, loaded.num_labels)
        return dataclasses.replace(task, label_names=names, num_labels=len(names))

    def text_loader(self, task: TaskSpec, dataset, loaded, *, train: bool, batch_size: int, max_length: int,
                    seed: int, teacher_targets):
        dataset = self.align_labels(dataset, task, loaded.id2label, loaded.num_labels)
        return data.make_text_dataloader(dataset, task, loaded.tokenizer, batch_size=batch_size,
                                         max_length=max_length, shuffle=train, seed=seed, words=True)

    def metric_names(self, task: TaskSpec, num_classes: int | None = None) -> tuple[str, ...]:
        return TOKEN_METRICS

    def compute_metrics(self, task: TaskSpec, predictions, labels) -> dict[str, float]:
        """Logits ``[N, S, C]`` or tag ids ``[N, S]`` against labels ``[N, S]`` (see
        :func:`luna_convert.metrics.token_metrics`)."""
        return token_metrics(task, predictions, labels)

    def pipeline_tag(self, task: TaskSpec) -> str:
        return "token-classification"
