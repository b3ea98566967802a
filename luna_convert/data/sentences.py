"""Sentence embedding data: texts to embed, one a row (a ``sentence`` column, e.g. GLUE SST-2's TSVs, whose
labels are not needed), or sentence pairs (``sentence1``, ``sentence2``) with an optional numeric similarity
``label`` / ``score`` (GLUE STS-B's TSVs), from table files or a ``datasets`` split."""

from __future__ import annotations

import math
from pathlib import Path

from ..errors import LunaConvertError
from ..tasks import TaskSpec
from .labels import is_missing
from .tables import find_split_file, pick_column, read_table

SENTENCE_LAYOUT = ("a 'sentence' (or 'text') column, or 'sentence1' and 'sentence2' columns with an optional "
                   "numeric 'label' or 'score' (the similarity of the pair)")
PAIR_COLUMNS = ("sentence1", "sentence2")
SCORE_COLUMN = "label"


def _number(value) -> float | None:
    """``value`` as a finite float, else None."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def sentence_dataset(cols: dict[str, list], where: str):
    """A ``datasets.Dataset`` of ``sentence`` (single texts) or ``sentence1``, ``sentence2`` and, where the table
    has a numeric ``label`` / ``score`` column, ``label`` (float); ``where`` names the data in messages. Single
    texts keep no labels: the embedding task trains on the teacher's embeddings."""
    import datasets

    n = max((len(v) for v in cols.values()), default=0)
    if not cols or n == 0:
        raise LunaConvertError(f"{where} is empty; expected {SENTENCE_LAYOUT}")
    used: set[str] = set()
    pair = [pick_column(cols, name, (), used) for name in PAIR_COLUMNS]
    if None not in pair:
        out = {name: ["" if is_missing(v) else str(v) for v in cols[key]] for name, key in zip(PAIR_COLUMNS, pair)}
        score_key = pick_column(cols, SCORE_COLUMN, ("score", "similarity"), set(pair))
        if score_key is not None:
            scores = [_number(v) for v in cols[score_key]]
            bad = next((i for i, s in enumerate(scores) if s is None), None)
            if bad is not None:
                raise LunaConvertError(f"{where}: row {bad + 1} has {score_key} {cols[score_key][bad]!r}, not a number; "
                                       "the similarity score of a pair must be numeric (drop the column to score "
                                       "agreement with the teacher instead)")
            out[SCORE_COLUMN] = scores
        return datasets.Dataset.from_dict(out)
    key = pick_column(cols, "sentence", ("text",), used)
    if key is None:
        raise LunaConvertError(f"{where} has columns {list(cols)}; the embedding task needs {SENTENCE_LAYOUT}")
    return datasets.Dataset.from_dict({"sentence": ["" if is_missing(v) else str(v) for v in cols[key]]})


def has_similarity_scores(dataset) -> bool:
    """Whether ``dataset`` (:func:`sentence_dataset`'s) holds scored sentence pairs."""
    return SCORE_COLUMN in dataset.column_names


def embedding_texts(dataset, interleave_pairs: bool = False) -> list[str]:
    """The texts to embed: the sentences, or both sentences of every pair (all first sentences, then all second
    ones; ``interleave_pairs``: a0, b0, a1, b1, ..., so that rows 2i and 2i + 1 are pair i)."""
    if "sentence" in dataset.column_names:
        return list(dataset["sentence"])
    first, second = (list(dataset[c]) for c in PAIR_COLUMNS)
    if interleave_pairs:
        return [text for pair in zip(first, second) for text in pair]
    return first + second


def load_sentence_split(task: TaskSpec, split: str, data_dir: Path | None):
    """``split`` of the embedding task from a table file (TSV / CSV / JSON lines / parquet) in ``data_dir``."""
    if data_dir is None:
        raise LunaConvertError(f"task {task.name!r} has no built-in dataset; pass --data-dir with train / dev files "
                               f"holding {SENTENCE_LAYOUT} (e.g. GLUE's STS-B or SST-2 folder)")
    path = find_split_file(task, data_dir, split)
    return sentence_dataset(read_table(path), path.name)
