"""Split names: their spellings (dev, val, ...), the file stems tried for each, and deterministic subsets."""

from __future__ import annotations

from ..errors import LunaConvertError
from ..tasks import TaskSpec

# split name -> file stems tried in data_dir, in order
SPLIT_STEMS: dict[str, tuple[str, ...]] = {
    "train": ("train",),
    "validation": ("dev", "validation", "val", "valid"),
    "validation_matched": ("dev_matched", "validation_matched", "dev", "validation"),
    "validation_mismatched": ("dev_mismatched", "validation_mismatched"),
    "test": ("test",),
    "test_matched": ("test_matched",),
    "test_mismatched": ("test_mismatched",),
}
_SPLIT_ALIASES = {"val": "validation", "valid": "validation", "dev": "validation", "dev_matched": "validation_matched",
                  "dev_mismatched": "validation_mismatched"}


def canonical_split(split: str) -> str:
    """The split's usual name: lower case, and dev / val / valid as validation."""
    s = str(split).strip().lower()
    return _SPLIT_ALIASES.get(s, s)


def split_stems(task: TaskSpec, split: str) -> tuple[str, ...]:
    """The file stems tried, in order, for ``split`` of ``task`` (MNLI's matched / mismatched included)."""
    split = canonical_split(split)
    if task.glue_dir == "MNLI":
        if split == "validation":
            split = "validation_mismatched" if task.name == "mnli_mismatched" else "validation_matched"
        elif split == "test":
            split = "test_mismatched" if task.name == "mnli_mismatched" else "test_matched"
    if split not in SPLIT_STEMS:
        return (split,)
    return SPLIT_STEMS[split]


def is_test_split(split: str) -> bool:
    """Whether ``split`` is a test split, whose examples may have no labels."""
    return canonical_split(split).startswith("test")


def subset_indices(n: int, max_examples: int | None, shuffle: bool, seed: int) -> list[int] | None:
    """Sorted indices of ``max_examples`` of ``n`` examples (drawn with ``seed`` when ``shuffle``, else the
    first ones), or None when all are kept."""
    if max_examples is None or max_examples >= n:
        return None
    if max_examples < 1:
        raise LunaConvertError(f"max_examples must be at least 1, got {max_examples}")
    if not shuffle:
        return list(range(max_examples))
    import numpy as np

    return sorted(np.random.default_rng(seed).permutation(n)[:max_examples].tolist())


def holdout_indices(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(kept, held out): a seeded ``fraction`` of ``n`` examples held out (at least one, and at least one kept),
    each list sorted; the same (n, fraction, seed) always gives the same parts."""
    if n < 2:
        raise LunaConvertError(f"holding out part of a split needs at least 2 examples, got {n}")
    import numpy as np

    held = min(n - 1, max(1, round(n * fraction)))
    order = np.random.default_rng([seed, n]).permutation(n)
    return sorted(order[held:].tolist()), sorted(order[:held].tolist())


def take(dataset, indices: list[int]):
    """The examples ``indices`` of a split: a ``datasets.Dataset`` (``select``) or an image dataset (``subset``)."""
    return dataset.select(indices) if hasattr(dataset, "select") else dataset.subset(indices)
