"""Sentence embeddings (a sentence-transformers model): trained to the teacher's embedding of each text; scored
by the Spearman correlation with similarity scores where the eval data has scored sentence pairs (STS-B), else
by the agreement with the teacher's embeddings."""

from __future__ import annotations

import dataclasses
from functools import partial

from .. import data
from ..errors import LunaConvertError
from ..metrics import AGREEMENT_METRICS, SIMILARITY_METRICS, embedding_metrics
from ..tasks import EMBEDDING_LOSSES, TaskSpec
from .base import TaskKind


def embedding_loss(embeddings, targets, kind: str = "cosine"):
    """How far sentence embeddings [B, D] are from the teacher's [B, D]: the mean of 1 - cosine similarity
    ("cosine": the direction only, what similarity search reads) or the mean squared error ("mse")."""
    import torch.nn.functional as F

    embeddings, targets = embeddings.float(), targets.float()
    if kind == "cosine":
        return (1 - F.cosine_similarity(embeddings, targets, dim=-1)).mean()
    if kind == "mse":
        return F.mse_loss(embeddings, targets)
    raise LunaConvertError(f"unknown embedding loss {kind!r}; use one of {', '.join(EMBEDDING_LOSSES)}")


class EmbeddingKind(TaskKind):
    name = "embedding"
    auto_class = None
    sentence_encoder = True
    scored_against_teacher = True

    def read_files(self, task: TaskSpec, split: str, data_dir):
        return data.load_sentence_split(task, split, data_dir)

    def read_datasets(self, task: TaskSpec, ds, where: str, split: str):
        return data.sentence_dataset(data.datasets_value_columns(ds), where)

    def align_labels(self, dataset, task: TaskSpec, id2label: dict | None, num_labels: int):
        """Targets are scores or the teacher's embeddings: no classes to align."""
        return dataset

    def task_for_data(self, task: TaskSpec, eval_split, metric_chosen: bool) -> TaskSpec:
        """The headline the evaluation split allows: Spearman where it holds scored sentence pairs, else the
        agreement with the teacher. A ``--metric`` this data cannot give is refused, never swapped."""
        names = SIMILARITY_METRICS if data.has_similarity_scores(eval_split()) else AGREEMENT_METRICS
        if metric_chosen and task.headline not in names:
            has = "plain texts" if names is AGREEMENT_METRICS else "sentence pairs with similarity scores"
            raise LunaConvertError(f"--metric {task.headline} cannot be computed on this data ({has}); choose one "
                                   f"of {', '.join(names)}")
        return dataclasses.replace(task, headline=task.headline if task.headline in names else names[0])

    def text_loader(self, task: TaskSpec, dataset, loaded, *, train: bool, batch_size: int, max_length: int,
                    seed: int, teacher_targets):
        """Targets: the pairs' scores (an evaluation split of scored pairs, texts a0, b0, a1, b1, ...), else the
        teacher's embeddings of the texts."""
        scored = not train and data.has_similarity_scores(dataset)
        texts = data.embedding_texts(dataset, interleave_pairs=scored)
        targets = [score for score in dataset["label"] for _ in range(2)] if scored else teacher_targets(texts)
        loader = data.make_embedding_dataloader(texts, targets, loaded.tokenizer, batch_size=batch_size,
                                                max_length=max_length, shuffle=train, seed=seed)
        loader.scored_pairs = scored
        return loader

    def loss_fn(self, train):
        return partial(embedding_loss, kind=train.embedding_loss)

    def check_config(self, config) -> None:
        if config.distill.target == "logits":
            raise LunaConvertError("distill.target=logits does not fit --task embedding (a sentence encoder has no "
                                   "logits; its finetuning already matches the teacher's embeddings): use "
                                   "--set distill.target=attention or output")
        if config.train.teacher_kd:
            raise LunaConvertError("train.teacher_kd does not fit --task embedding (its finetuning already matches "
                                   "the teacher's embeddings): use --set train.teacher_kd=0")

    def metric_names(self, task: TaskSpec, num_classes: int | None = None) -> tuple[str, ...]:
        """Which set the data allows: :meth:`task_for_data` sets the headline from it."""
        return SIMILARITY_METRICS if task.headline in SIMILARITY_METRICS else AGREEMENT_METRICS

    def metric_choices(self, task: TaskSpec, num_classes: int | None = None) -> tuple[str, ...]:
        """Either set: which applies depends on the data, checked against it by :meth:`task_for_data`."""
        return SIMILARITY_METRICS + AGREEMENT_METRICS

    def compute_metrics(self, task: TaskSpec, predictions, labels) -> dict[str, float]:
        """See :func:`luna_convert.metrics.embedding_metrics`."""
        return embedding_metrics(task, predictions, labels)

    def loader_metrics(self, task: TaskSpec, logits, labels, loader) -> tuple[dict[str, float], int]:
        """Scored pairs are counted as pairs."""
        if getattr(loader, "scored_pairs", False):
            # texts a0, b0, a1, b1, ...: pair i is rows 2i and 2i + 1, both labelled with the pair's score
            logits, labels = logits.reshape(-1, 2, logits.shape[-1]), labels[0::2]
        return self.compute_metrics(task, logits, labels), len(labels)

    def pipeline_tag(self, task: TaskSpec) -> str:
        return "sentence-similarity"

    def check_encoder(self, is_sentence_encoder: bool, source: str) -> None:
        if not is_sentence_encoder:
            raise LunaConvertError(f"{source} is a luna-convert model folder of a classifier, not a sentence "
                                   "embedding model; --task embedding needs a sentence-transformers folder or a "
                                   "transformers encoder")
