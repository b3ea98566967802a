"""The five LRA tasks' splits (generated, or read from a user's folders), their cache, and DataLoaders.

Every task has three splits: ``train``; ``dev``, held out of training (where the budget is chosen); and
``test``, the split a run reports. Generated sets (ListOps, Pathfinder) come from fixed data seeds, so every
run and method sees the same examples, and are cached as one ``.npz`` per set under the cache folder, named by
a hash of everything that made them. Batches are ``input_ids`` (uint8 values widened to int64, padded with
0) and ``attention_mask``; Retrieval adds ``pair_ids`` and ``pair_mask`` for the second document.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ..errors import LunaConvertError, unknown_name
from ..fileio import atomic_write_bytes
from . import folders, listops, pathfinder

SPLITS = ("train", "dev", "test")
# data seeds of the generated splits: fixed, so that run seeds change the model and order, never the data
SPLIT_SEEDS = {"train": 1, "dev": 2, "test": 3}
CACHE_VERSION = 1  # bump when a generator changes what it draws


@dataclass(frozen=True)
class TaskInfo:
    name: str
    vocab: int  # token ids 0..vocab-1 (0 also pads)
    num_classes: int | None  # None: the number of class folders
    generated: bool
    pair: bool = False
    summary: str = ""


TASKS = {
    "listops": TaskInfo("listops", len(listops.VOCAB), listops.NUM_CLASSES, True,
                        summary="nested MAX/MIN/MED/SM expressions, 10 classes (generated)"),
    "image": TaskInfo("image", 256, None, False, summary="ImageFolder as 1,024-pixel grayscale sequences"),
    "pathfinder": TaskInfo("pathfinder", 256, 2, True, summary="32 x 32 dashed curves, joined or not (generated)"),
    "text": TaskInfo("text", 256, None, False, summary="byte-level classification of your text files"),
    "retrieval": TaskInfo("retrieval", 256, 2, False, pair=True, summary="byte-level document-pair matching"),
}


def task_info(name: str) -> TaskInfo:
    if name not in TASKS:
        raise unknown_name("LRA task", name, TASKS)
    return TASKS[name]


@dataclass
class Split:
    sequences: list  # uint8 arrays
    labels: np.ndarray
    pairs: list | None = None  # Retrieval: the second document of each pair
    class_names: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.labels)

    def lengths(self) -> np.ndarray:
        return np.array([len(s) for s in self.sequences])


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "luna_convert" / "lra"


# ------------------------------------------------------------------ generated sets
def generator_settings(task: str, data) -> object:
    if task == "listops":
        return listops.ListOpsSettings(min_length=data.min_length, max_length=data.max_length)
    return pathfinder.PathfinderSettings(difficulty=data.difficulty)


def generate_split(task: str, settings, count: int, seed: int) -> Split:
    module = listops if task == "listops" else pathfinder
    sequences, labels = module.generate(count, seed, settings)
    return Split(sequences, labels)


def cache_key(task: str, settings, count: int, seed: int) -> str:
    made_of = json.dumps({"task": task, "settings": asdict(settings), "count": count, "seed": seed,
                          "version": CACHE_VERSION}, sort_keys=True)
    return hashlib.sha256(made_of.encode()).hexdigest()[:16]


def save_split(path: Path, split: Split) -> None:
    import io

    lengths = split.lengths()
    buffer = io.BytesIO()
    np.savez(buffer, tokens=np.concatenate(split.sequences) if split.sequences else np.zeros(0, np.uint8),
             lengths=lengths, labels=split.labels)
    atomic_write_bytes(path, buffer.getvalue())  # a killed run never leaves half a cache file


def load_split(path: Path) -> Split | None:
    try:
        with np.load(path) as f:
            tokens, lengths, labels = f["tokens"], f["lengths"], f["labels"]
    except (OSError, ValueError, KeyError):
        return None  # unreadable: made again
    return Split(np.split(tokens, np.cumsum(lengths)[:-1]), labels)


def cached_generated_split(task: str, settings, count: int, seed: int, cache_dir: Path | None) -> Split:
    if cache_dir is None:
        return generate_split(task, settings, count, seed)
    path = Path(cache_dir) / f"{task}-{cache_key(task, settings, count, seed)}.npz"
    split = load_split(path) if path.is_file() else None
    if split is None:
        split = generate_split(task, settings, count, seed)
        save_split(path, split)
    return split


# ------------------------------------------------------------------ every task
def held_out(split: Split, fraction: float, seed: int) -> tuple[Split, Split]:
    """(the rest, a seeded ``fraction`` of ``split``): a dev split taken out of training data."""
    order = np.random.default_rng(seed).permutation(len(split))
    n_dev = max(1, int(round(fraction * len(split))))
    dev_idx, rest_idx = np.sort(order[:n_dev]), np.sort(order[n_dev:])

    def pick(idx):
        return Split([split.sequences[i] for i in idx], split.labels[idx],
                     None if split.pairs is None else [split.pairs[i] for i in idx], split.class_names)

    return pick(rest_idx), pick(dev_idx)


def first(split: Split, count: int | None, seed: int) -> Split:
    """A seeded subset of ``count`` examples (all when None or more than there are), in the original order."""
    if count is None or count >= len(split):
        return split
    idx = np.sort(np.random.default_rng(seed).permutation(len(split))[:count])
    return Split([split.sequences[i] for i in idx], split.labels[idx],
                 None if split.pairs is None else [split.pairs[i] for i in idx], split.class_names)


def folder_split(task: str, data_dir, split: str, data) -> Split:
    if task == "image":
        sequences, labels, names = folders.read_image_split(data_dir, split)
        return Split(sequences, labels, class_names=names)
    if task == "text":
        sequences, labels, names = folders.read_text_split(data_dir, split, data.max_bytes)
        return Split(sequences, labels, class_names=names)
    first_docs, second_docs, labels = folders.read_retrieval_split(data_dir, split, data.max_bytes)
    return Split(first_docs, labels, pairs=second_docs, class_names=["different", "same"])


def has_own_dev(task: str, data_dir) -> bool:
    root = Path(data_dir).expanduser()
    if task == "retrieval":
        return folders.retrieval_file(root, "dev") is not None
    return folders.split_folder(root, "dev") is not None


def build_splits(task: str, data, data_dir=None, cache_dir: Path | None = None) -> dict[str, Split]:
    """train, dev and test of ``task`` with the sizes in ``data`` (a ``DataSettings``)."""
    info = task_info(task)
    counts = {"train": data.train_examples, "dev": data.dev_examples, "test": data.test_examples}
    if info.generated:
        settings = generator_settings(task, data)
        return {s: cached_generated_split(task, settings, counts[s], SPLIT_SEEDS[s], cache_dir) for s in SPLITS}
    train = folder_split(task, data_dir, "train", data)
    test = folder_split(task, data_dir, "test", data)
    if has_own_dev(task, data_dir):
        dev = folder_split(task, data_dir, "dev", data)
    else:  # held out of the training folder: the budget is never chosen on the test split
        train, dev = held_out(train, data.dev_fraction, SPLIT_SEEDS["dev"])
    splits = {"train": train, "dev": dev, "test": test}
    for name, split in splits.items():
        if not len(split):
            raise LunaConvertError(f"lra {task}: the {name} split is empty")
        if not info.pair and split.class_names != train.class_names:
            raise LunaConvertError(f"lra {task}: the {name} split's classes {split.class_names} differ from "
                                   f"train's {train.class_names}; use the same class folders in every split")
    return {s: first(split, counts[s], SPLIT_SEEDS[s]) for s, split in splits.items()}


# ------------------------------------------------------------------ loaders
class SequenceDataset(Dataset):
    def __init__(self, split: Split):
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i):
        pair = None if self.split.pairs is None else self.split.pairs[i]
        return self.split.sequences[i], pair, int(self.split.labels[i])


def pad_batch(sequences) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(1, max(len(s) for s in sequences))
    ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    mask = torch.zeros(len(sequences), longest, dtype=torch.long)
    for row, s in enumerate(sequences):
        ids[row, :len(s)] = torch.from_numpy(np.asarray(s, dtype=np.int64))
        mask[row, :len(s)] = 1
    return ids, mask


def collate(items) -> dict:
    sequences, pairs, labels = zip(*items)
    ids, mask = pad_batch(sequences)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor(labels, dtype=torch.long)}
    if pairs[0] is not None:
        batch["pair_ids"], batch["pair_mask"] = pad_batch(pairs)
    return batch


def make_loader(split: Split, batch_size: int, shuffle: bool, seed: int) -> DataLoader:
    generator = torch.Generator()
    generator.manual_seed(int(seed))
    return DataLoader(SequenceDataset(split), batch_size=batch_size, shuffle=shuffle, collate_fn=collate,
                      generator=generator)


def split_summary(split: Split) -> dict:
    """Size, length spread and class counts: what a run records about its data."""
    lengths = split.lengths()
    out = {"examples": len(split), "min_length": int(lengths.min()), "mean_length": float(lengths.mean()),
           "max_length": int(lengths.max()),
           "class_counts": np.bincount(split.labels, minlength=max(2, int(split.labels.max()) + 1)).tolist()}
    if split.pairs is not None:
        out["max_pair_length"] = max(len(p) for p in split.pairs)
    return out
