"""A task's data for one model: its splits, aligned to the model's labels and preprocessed into loaders, and
the number of optimiser steps a training config asks for."""

from __future__ import annotations

import dataclasses
import math

from .. import data
from ..errors import LunaConvertError
from .autoconfig import check_positions
from .config import RunConfig

EXTRA_EVAL_SPLITS = {"mnli": ("validation_mismatched",)}  # scored besides the task's eval split


class TaskData:
    """The task's splits and loaders for one model's preprocessing. ``task`` is the task as scored: a token
    task gets its tag names (``label_names``) from the model's id2label."""

    def __init__(self, config: RunConfig, loaded, task, accelerator=None):
        if task.is_token_level:
            names = data.token_label_names(loaded.id2label, loaded.num_labels)
            task = dataclasses.replace(task, label_names=names, num_labels=len(names))
        self.task, self.loaded, self.config = task, loaded, config
        t = config.train
        self.truncated_by_split: dict[str, int] = {}  # examples cut to max_length; each split counted once

        def split(name: str, limit, train: bool, batch_size: int):
            dataset = data.load_split(task, name, config.data_dir, max_examples=limit, seed=config.seed)
            if task.is_span_level:  # answers are spans of the context: no labels to align with the model's
                loader = data.make_qa_dataloader(dataset, loaded.tokenizer, batch_size=batch_size,
                                                 max_length=t.max_length, shuffle=train, seed=config.seed)
                self.truncated_by_split[name] = loader.num_truncated
                check_positions(loaded, loader.longest, t.max_length)
            elif task.kind == "text":
                dataset = data.align_labels(dataset, task, loaded.id2label, loaded.num_labels)
                loader = data.make_text_dataloader(dataset, task, loaded.tokenizer, batch_size=batch_size,
                                                   max_length=t.max_length, shuffle=train, seed=config.seed)
                self.truncated_by_split[name] = getattr(loader, "num_truncated", 0)
                check_positions(loaded, getattr(loader, "longest", 0), t.max_length)
            else:
                dataset = data.align_labels(dataset, task, loaded.id2label, loaded.num_labels)  # names -> model ids
                _check_image_labels(dataset, loaded.num_labels, name)
                size = t.image_size or loaded.image_config["size"]
                transform = data.image_transform(loaded.image_config["mean"], loaded.image_config["std"], size,
                                                 train=train and t.augment)
                loader = data.make_image_dataloader(dataset, transform, batch_size=batch_size, shuffle=train,
                                                    seed=config.seed)
            return dataset, loader

        self.split = split

    @property
    def truncated(self) -> int:
        return sum(self.truncated_by_split.values())

    def train_loader(self, batch_size: int | None = None):
        t = self.config.train
        return self.split(self.task.train_split, t.max_train_examples, True, batch_size or t.batch_size)[1]

    def eval_loaders(self) -> dict:
        t = self.config.train
        names = [self.config.eval_split or self.task.eval_split]
        if not self.config.eval_split:
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
    if t.max_steps:
        return int(t.max_steps)
    per_process = math.ceil(len(loader) / accelerator.num_processes)
    # an epoch's last, short accumulation window is an update too (as accelerate does it)
    return max(1, math.ceil(t.epochs * math.ceil(per_process / t.grad_accum)))
