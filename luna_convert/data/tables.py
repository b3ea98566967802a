"""Local table files (CSV, TSV with a header, JSON lines / JSON, parquet): finding a split's file,
reading its columns, and renaming them to the task's text and label columns."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import sys
from contextvars import ContextVar
from pathlib import Path
from typing import Iterator, Sequence

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

# The text files' encoding for the readers below; a run sets it for its loading (``text_encoding``), so that every
# reader (tables, GLUE, CoNLL, QA, sentences, own-data detection) gets it without each call passing it on.
_ENCODING: ContextVar[str | None] = ContextVar("luna_convert_text_encoding", default=None)


@contextlib.contextmanager
def text_encoding(name: str | None) -> Iterator[None]:
    """Text data files are read in ``name`` inside this block (None: UTF-8, a BOM allowed)."""
    token = _ENCODING.set(name)
    try:
        yield
    finally:
        _ENCODING.reset(token)


def read_text(path: Path) -> str:
    """A text data file's content in the encoding in force (:func:`text_encoding`); bytes it cannot decode are
    a one-line error naming the file, the line and ``--encoding``."""
    raw = path.read_bytes()
    encoding = _ENCODING.get()
    try:
        text = raw.decode(encoding or "utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        utf16 = raw[:2] in (b"\xff\xfe", b"\xfe\xff")  # a UTF-16 byte-order mark (Excel's "Unicode text")
        example = "utf-16" if utf16 else "cp1252"
        raise LunaConvertError(
            f"{path} is not {encoding or 'UTF-8'} text: line {line} has byte 0x{raw[e.start]:02x} ({e.reason}); "
            f"pass the file's encoding with --encoding (e.g. --encoding {example}) or save it as UTF-8") from None
    return text.removeprefix("\ufeff")  # a UTF-8 byte-order mark read with --encoding utf-8


def read_rows(path: Path, delimiter: str) -> list[tuple[int, list[str]]]:
    """The non-blank rows of a CSV (``,``) or TSV (tab, no quoting) file, each with its line number."""
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    f = io.StringIO(read_text(path), newline="")
    if delimiter == "\t":
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
    else:
        reader = csv.reader(f)
    rows = []
    try:
        for row in reader:
            if row:
                rows.append((reader.line_num, row))
    except csv.Error as e:  # e.g. a quote left open at the end of the file
        raise LunaConvertError(f"{path}: line {reader.line_num} cannot be parsed ({e}); fix that row") from None
    return rows


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
        text = read_text(path)
        records: list | None = None
        if suffix == ".json":
            try:
                obj = json.loads(text) if text.strip() else []
            except (json.JSONDecodeError, RecursionError):
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
                except RecursionError:
                    raise LunaConvertError(f"{path}: line {lineno} nests too deeply to read; expected one flat object "
                                           "per line") from None
        if not all(isinstance(r, dict) for r in records):
            raise LunaConvertError(f"{path}: expected JSON objects (one per line, or a list of objects)")
        keys: list[str] = []
        for r in records:
            for k in r:
                if k not in keys:
                    keys.append(k)
        if not records:
            raise LunaConvertError(f"{path} is empty; expected JSON objects with the data's columns")
        return {k: [r.get(k) for r in records] for k in keys}
    # .csv / .tsv with a header row
    delimiter = "\t" if suffix == ".tsv" else ","
    rows = read_rows(path, delimiter)
    if not rows:
        raise LunaConvertError(f"{path} is empty; expected a header row naming the columns, then the data rows")
    header = [h.strip() for h in rows[0][1]]
    cols: dict[str, list] = {h: [] for h in header}
    for number, (line, row) in enumerate(rows[1:], 1):
        if len(row) > len(header) and any(field.strip() for field in row[len(header):]):
            hint = ("a text holding a tab splits its row: remove the tab" if delimiter == "\t" else
                    'a text holding a comma must be quoted ("...")')
            raise LunaConvertError(f"{path}: row {number} (line {line}) has {len(row)} fields but the header has "
                                   f"{len(header)}; {hint}")
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
