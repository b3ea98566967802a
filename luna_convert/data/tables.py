"""Local table files (CSV, TSV with a header, JSON lines / JSON, parquet): finding a split's file,
reading its columns, and renaming them to the task's text and label columns."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Sequence

from ..errors import LunaConvertError
from ..tasks import TaskSpec
from .labels import is_missing, parse_labels
from .splits import is_test_split, split_stems

TABLE_EXTENSIONS = (".tsv", ".csv", ".jsonl", ".json", ".parquet")

# Other column names accepted in CSV / JSON / parquet files, renamed to the task's names
# (by position: single-text tasks, first and second text of pair tasks).
_SINGLE_TEXT_ALIASES = ("sentence", "text", "question", "content")
_PAIR_TEXT_ALIASES = (
    ("sentence1", "text", "premise", "question1", "question", "text_a"),
    ("sentence2", "text_pair", "hypothesis", "question2", "sentence", "text_b"),
)
LABEL_COLUMN_ALIASES = ("labels", "gold_label", "is_duplicate", "score", "target", "class")


def task_dataset(task: TaskSpec, columns: dict[str, list], labels: list):
    """A ``datasets.Dataset`` of the task's text columns and ``"label"`` (int64 class ids or float64 scores)."""
    import datasets

    data = {c: columns[c] for c in task.text_columns}
    data["label"] = labels
    if labels and all(isinstance(x, int) for x in labels) and not task.is_regression:
        features = datasets.Features({**{c: datasets.Value("string") for c in task.text_columns},
                                      "label": datasets.Value("int64")})
    elif task.is_regression:
        features = datasets.Features({**{c: datasets.Value("string") for c in task.text_columns},
                                      "label": datasets.Value("float64")})
    else:
        features = None
    return datasets.Dataset.from_dict(data, features=features)


def read_table(path: Path) -> dict[str, list]:
    """The columns (name -> values) of a CSV / TSV with a header, JSON lines / JSON or parquet file."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pydict()
        except Exception as e:  # noqa: BLE001 - any reader failure is a bad file
            raise LunaConvertError(f"cannot read parquet file {path}: {e}") from None
    if suffix in (".jsonl", ".json"):
        text = path.read_text(encoding="utf-8-sig")
        records: list | None = None
        if suffix == ".json":
            try:
                obj = json.loads(text) if text.strip() else []
            except json.JSONDecodeError:
                obj = None  # maybe JSON lines named .json
            if isinstance(obj, dict) and "data" in obj and isinstance(obj["data"], list):
                obj = obj["data"]
            if isinstance(obj, dict) and obj and all(isinstance(v, list) for v in obj.values()):
                return {k: list(v) for k, v in obj.items()}
            if isinstance(obj, list):
                records = obj
        if records is None:
            records = []
            for lineno, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise LunaConvertError(f"{path}: line {lineno} is not valid JSON ({e.msg}); expected one object per line") from None
        if not all(isinstance(r, dict) for r in records):
            raise LunaConvertError(f"{path}: expected JSON objects (one per line, or a list of objects)")
        keys: list[str] = []
        for r in records:
            for k in r:
                if k not in keys:
                    keys.append(k)
        return {k: [r.get(k) for r in records] for k in keys}
    # .csv / .tsv with a header row
    delimiter = "\t" if suffix == ".tsv" else ","
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    with open(path, encoding="utf-8-sig", newline="") as f:
        if delimiter == "\t":
            reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        else:
            reader = csv.reader(f)
        rows = [row for row in reader if row]
    if not rows:
        return {}
    header = [h.strip() for h in rows[0]]
    cols: dict[str, list] = {h: [] for h in header}
    for row in rows[1:]:
        for i, h in enumerate(header):
            cols[h].append(row[i] if i < len(row) else None)
    return cols


def pick_column(cols: dict[str, list], name: str, aliases: Sequence[str], used: set[str]) -> str | None:
    """The column of ``cols`` named ``name`` or else one of ``aliases`` (any case), not in ``used``; None if none."""
    lower = {k.lower(): k for k in cols}
    for cand in (name, *aliases):
        key = cand if cand in cols else lower.get(cand.lower())
        if key is not None and key not in used:
            return key
    return None


def read_table_split(task: TaskSpec, path: Path, split: str):
    """A table file as the task's Dataset."""
    return columns_to_dataset(task, read_table(path), path, split)


def columns_to_dataset(task: TaskSpec, cols: dict[str, list], path, split: str):
    """A table's columns (name -> values) as the task's Dataset; ``path`` names the source in errors."""
    n = max((len(v) for v in cols.values()), default=0)
    if not cols or n == 0:
        raise LunaConvertError(
            f"{path} is empty; expected rows with columns {list(task.text_columns) + [task.label_column]}"
        )
    used: set[str] = set()
    texts: dict[str, list] = {}
    for c in task.text_columns:
        pos = task.text_columns.index(c)
        aliases = _SINGLE_TEXT_ALIASES if len(task.text_columns) == 1 else _PAIR_TEXT_ALIASES[min(pos, 1)]
        key = pick_column(cols, c, aliases, used)
        if key is None:
            raise LunaConvertError(
                f"{path} has columns {list(cols)} but task {task.name!r} needs text column(s) "
                f"{list(task.text_columns)} and {task.label_column!r}; rename the columns or choose another --task"
            )
        used.add(key)
        texts[c] = ["" if is_missing(v) else str(v) for v in cols[key]]
    lkey = pick_column(cols, task.label_column, LABEL_COLUMN_ALIASES, used)
    if lkey is None:
        if is_test_split(split):
            labels: list = [-1.0 if task.is_regression else -1] * n
            return task_dataset(task, texts, labels)
        raise LunaConvertError(
            f"{path} has columns {list(cols)} but no label column {task.label_column!r}; "
            f"task {task.name!r} needs columns {list(task.text_columns) + [task.label_column]}"
        )
    labels = parse_labels(task, cols[lkey], str(path))
    return task_dataset(task, texts, labels)


def find_split_file(task: TaskSpec, data_dir: Path, split: str, extensions: Sequence[str] = TABLE_EXTENSIONS) -> Path:
    """The file in ``data_dir`` that holds ``split`` (e.g. dev.tsv or validation.csv for validation), ending in
    one of ``extensions`` (tried in order)."""
    stems = split_stems(task, split)
    for stem in stems:
        for ext in extensions:
            p = data_dir / f"{stem}{ext}"
            if p.is_file():
                return p
    present = sorted(p.name for p in data_dir.iterdir() if p.is_file())
    expected = ", ".join(f"{stems[0]}{e}" for e in extensions)
    raise LunaConvertError(
        f"no file for split {split!r} in {data_dir} (looked for {expected}); found: {', '.join(present) or 'nothing'}"
    )
