"""A task's data for one model: its splits, aligned to the model's labels and preprocessed into loaders, and
the number of optimiser steps a training config asks for."""

from __future__ import annotations

import math
from typing import Callable

from torch import nn

from .. import data
from ..conversion import is_converted
from ..engine.training import predict
from ..errors import LunaConvertError
from ..task_kinds import kind_of
from .autoconfig import check_positions
from .config import RunConfig

EXTRA_EVAL_SPLITS = {"mnli": ("validation_mismatched",)}  # scored besides the task's eval split
# A layer-selection candidate's eval split: the part of the training split it was not trained on
HOLDOUT_SPLIT = "held-out"


def holdout_of(config: RunConfig) -> float | None:
    """The fraction of the training split a layer-selection candidate holds out (None: an ordinary run)."""
    selection = config.selection or {}
    return selection.get("holdout") if selection.get("role") == "candidate" else None


class TaskData:
    """The task's splits and loaders for one model's preprocessing, as the task's kind (``self.kind``) reads,
    aligns and collates them. ``task`` is the task as scored: the kind's ``task_for_model`` and
    ``task_for_data`` (a token task gets its tag names from the model's id2label; the embedding task its
    headline from the eval data: Spearman where it holds scored sentence pairs, else the agreement with the
    teacher).

    The embedding task's targets are the teacher's embeddings of each split's texts, computed once a split
    (on ``accelerator``'s device) by ``teacher()`` (None: ``loaded.model``, which must then be unconverted:
    ask for the loaders before converting it)."""

    def __init__(self, config: RunConfig, loaded, task, accelerator=None,
                 teacher: Callable[[], nn.Module] | None = None):
        kind = kind_of(task)
        task = kind.task_for_model(task, loaded)
        t = config.train
        loaded_splits: dict = {}  # (split, limit) -> dataset: the embedding task reads its eval split twice

        self.skipped_images: dict[str, list[str]] = {}  # split -> images left out (skip_unreadable_images)
        holdout = holdout_of(config)
        self.eval_split = HOLDOUT_SPLIT if holdout else config.eval_split or task.eval_split

        def load(name: str, limit):
            if holdout and name in (task.train_split, HOLDOUT_SPLIT):  # a candidate: one seeded split of train
                whole = read(task.train_split, t.max_train_examples)
                kept, held = data.holdout_indices(len(whole), holdout, config.seed)
                part = held[:limit] if name == HOLDOUT_SPLIT and limit else kept if name != HOLDOUT_SPLIT else held
                return data.take(whole, part)
            return read(name, limit)

        def read(name: str, limit):
            if (name, limit) not in loaded_splits:
                with data.text_encoding(config.encoding):
                    dataset = kind.load_split(task, name, config.data_dir, max_examples=limit, seed=config.seed)
                # every image decoded now (up to a size), before the run writes anything
                dataset, self.skipped_images[name] = data.readable_images(dataset, config.skip_unreadable_images)
                loaded_splits[name, limit] = dataset
            return loaded_splits[name, limit]

        task = kind.task_for_data(task, lambda: load(self.eval_split, t.max_eval_examples), bool(config.metric))
        self.task, self.kind, self.loaded, self.config = task, kind, loaded, config
        self.accelerator, self.teacher = accelerator, teacher
        self.teacher_targets: dict[str, object] = {}  # split -> the teacher's embeddings of its texts [N, D]
        self.truncated_by_split: dict[str, int] = {}  # examples cut to max_length; each split counted once

        def split(name: str, limit, train: bool, batch_size: int):
            dataset = load(name, limit)
            if task.kind == "text":
                loader = kind.text_loader(task, dataset, loaded, train=train, batch_size=batch_size,
                                          max_length=t.max_length, seed=config.seed,
                                          teacher_targets=lambda texts: self.teacher_embeddings(name, texts))
                self.truncated_by_split[name] = loader.num_truncated
                check_positions(loaded, loader.longest, t.max_length)
            else:
                dataset = kind.align_labels(dataset, task, loaded.id2label, loaded.num_labels)  # names -> model ids
                _check_image_labels(dataset, loaded.num_labels, name)
                size = t.image_size or loaded.image_config["size"]
                transform = data.image_transform(loaded.image_config["mean"], loaded.image_config["std"], size,
                                                 train=train and t.augment)
                loader = data.make_image_dataloader(dataset, transform, batch_size=batch_size, shuffle=train,
                                                    seed=config.seed)
            return dataset, loader

        self.split = split

    def teacher_embeddings(self, split: str, texts: list[str]):
        """The teacher's embeddings [N, D] of ``split``'s ``texts`` (computed once a split)."""
        if split not in self.teacher_targets:
            teacher = self.teacher() if self.teacher is not None else self.loaded.model
            if is_converted(teacher):
                raise LunaConvertError("scoring a converted embedding model against its teacher needs the unconverted "
                                       "teacher: evaluate the run folder (its config names the teacher), or use eval "
                                       "data with scored sentence pairs (sentence1, sentence2, score)")
            accelerator = self.accelerator
            if accelerator is None:
                from accelerate import Accelerator

                accelerator = Accelerator()
            t = self.config.train
            loader = data.make_embedding_dataloader(texts, [0.0] * len(texts), self.loaded.tokenizer,
                                                    batch_size=t.eval_batch_size, max_length=t.max_length)
            teacher.to(accelerator.device)
            embeddings, _ = predict(accelerator, teacher, accelerator.prepare_data_loader(loader),
                                    f"teacher embeddings ({split})")
            self.teacher_targets[split] = embeddings
        return self.teacher_targets[split]

    @property
    def truncated(self) -> int:
        return sum(self.truncated_by_split.values())

    def train_loader(self, batch_size: int | None = None):
        t = self.config.train
        return self.split(self.task.train_split, t.max_train_examples, True, batch_size or t.batch_size)[1]

    def eval_loaders(self) -> dict:
        t = self.config.train
        names = [self.eval_split]
        if not self.config.eval_split and self.eval_split != HOLDOUT_SPLIT:
            names += list(EXTRA_EVAL_SPLITS.get(self.task.name, ()))
        return {n: self.split(n, t.max_eval_examples, False, t.eval_batch_size)[1] for n in names}


def _check_image_labels(dataset, num_labels: int, split: str) -> None:
    classes = getattr(dataset, "classes", None)
    if classes is not None and len(classes) > num_labels:
        raise LunaConvertError(
            f"the {split} split has {len(classes)} classes but the model predicts {num_labels}; "
            "use a model finetuned on these classes"
        )


def steps_for(config: RunConfig, loader, accelerator) -> int:
    t = config.train
    if t.max_steps is not None:  # 0 too: no finetuning
        return int(t.max_steps)
    per_process = math.ceil(len(loader) / accelerator.num_processes)
    # an epoch's last, short accumulation window is an update too (as accelerate does it)
    return max(1, math.ceil(t.epochs * math.ceil(per_process / t.grad_accum)))
