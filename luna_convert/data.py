"""Loading task data (GLUE TSV / CSV / JSON lines / parquet / the hub cache / ImageFolder /
scikit-learn digits) and turning it into deterministic PyTorch DataLoaders.

Heavy libraries (datasets, transformers, torchvision, sklearn, pandas) are imported inside
the functions that need them.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from .errors import LunaConvertError, unknown_name
from .tasks import TaskSpec, get_task

__all__ = [
    "load_split",
    "align_labels",
    "make_text_dataloader",
    "image_transform",
    "make_image_dataloader",
    "ImageFolderDataset",
    "DigitsDataset",
    "normalize_label_name",
]

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".ppm", ".pgm", ".tif", ".tiff", ".gif")
TABLE_EXTENSIONS = (".tsv", ".csv", ".jsonl", ".json", ".parquet")

# split name -> file stems tried in data_dir, in order
_SPLIT_STEMS: dict[str, tuple[str, ...]] = {
    "train": ("train",),
    "validation": ("dev", "validation", "val", "valid"),
    "validation_matched": ("dev_matched", "validation_matched", "dev", "validation"),
    "validation_mismatched": ("dev_mismatched", "validation_mismatched"),
    "test": ("test",),
    "test_matched": ("test_matched",),
    "test_mismatched": ("test_mismatched",),
}
_IMAGE_SPLIT_DIRS: dict[str, tuple[str, ...]] = {
    "train": ("train",),
    "validation": ("validation", "val", "valid", "dev"),
    "test": ("test",),
}
_SPLIT_ALIASES = {"val": "validation", "valid": "validation", "dev": "validation", "dev_matched": "validation_matched",
                  "dev_mismatched": "validation_mismatched"}

# Other column names accepted in CSV / JSON / parquet files, renamed to the task's names
# (by position: single-text tasks, first and second text of pair tasks).
_SINGLE_TEXT_ALIASES = ("sentence", "text", "question", "content")
_PAIR_TEXT_ALIASES = (
    ("sentence1", "text", "premise", "question1", "question", "text_a"),
    ("sentence2", "text_pair", "hypothesis", "question2", "sentence", "text_b"),
)
_LABEL_ALIASES = ("labels", "gold_label", "is_duplicate", "score", "target", "class")

# Spellings of GLUE label names seen in published checkpoints' id2label.
_LABEL_SYNONYMS: dict[str, str] = {
    "neg": "negative",
    "pos": "positive",
    "not_acceptable": "unacceptable",
    "ungrammatical": "unacceptable",
    "grammatical": "acceptable",
    "not_paraphrase": "not_equivalent",
    "non_paraphrase": "not_equivalent",
    "paraphrase": "equivalent",
    "non_duplicate": "not_duplicate",
    "contradictory": "contradiction",
    "contradict": "contradiction",
    "entail": "entailment",
    "entails": "entailment",
    "non_entailment": "not_entailment",
}

_GENERIC_LABEL = re.compile(r"^label_?(\d+)$")


def normalize_label_name(name: Any) -> str:
    """Case- and separator-insensitive spelling of a class name ("Not Entailment" -> "not_entailment")."""
    s = re.sub(r"[\s\-]+", "_", str(name).strip().lower())
    return _LABEL_SYNONYMS.get(s, s)


# --------------------------------------------------------------------------------------
# small helpers


def canonical_split(split: str) -> str:
    s = str(split).strip().lower()
    return _SPLIT_ALIASES.get(s, s)


def _split_stems(task: TaskSpec, split: str) -> tuple[str, ...]:
    split = canonical_split(split)
    if task.glue_dir == "MNLI":
        if split == "validation":
            split = "validation_mismatched" if task.name == "mnli_mismatched" else "validation_matched"
        elif split == "test":
            split = "test_mismatched" if task.name == "mnli_mismatched" else "test_matched"
    if split not in _SPLIT_STEMS:
        return (split,)
    return _SPLIT_STEMS[split]


def _is_test_split(split: str) -> bool:
    return canonical_split(split).startswith("test")


def _try_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value == int(value) else None
    if isinstance(value, str):
        s = value.strip()
        if re.fullmatch(r"[+-]?\d+", s):
            return int(s)
        try:
            f = float(s)
        except ValueError:
            return None
        return int(f) if math.isfinite(f) and f == int(f) else None
    try:  # numpy scalars
        f = float(value)
    except (TypeError, ValueError):
        return None
    return int(f) if math.isfinite(f) and f == int(f) else None


def _is_missing(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, float) and math.isnan(value):
        return True
    return isinstance(value, str) and value.strip() == ""


def _convert_labels(task: TaskSpec, raw: Sequence[Any], where: str) -> list:
    """Raw label values -> float scores (regression), int class ids, or (generic tasks
    without label names) strings left for :func:`align_labels` to map."""
    out: list = []
    if task.is_regression:
        for i, v in enumerate(raw):
            try:
                f = float(v)
            except (TypeError, ValueError):
                f = float("nan")
            if _is_missing(v) or not math.isfinite(f):
                raise LunaConvertError(f"{where}: example {i + 1} has label {v!r}; task {task.name!r} needs a number")
            out.append(f)
        return out
    names = {normalize_label_name(n): i for i, n in enumerate(task.label_names or ())}
    ints = [_try_int(v) for v in raw]
    if all(x is not None for x in ints):
        return ints
    if not names:
        for i, v in enumerate(raw):
            if _is_missing(v):
                raise LunaConvertError(f"{where}: example {i + 1} has no label; every example needs one")
        return [str(v).strip() if x is None else str(x) for v, x in zip(raw, ints)]
    for i, (v, x) in enumerate(zip(raw, ints)):
        if x is not None:
            out.append(x)
            continue
        key = normalize_label_name(v)
        if key not in names:
            raise LunaConvertError(
                f"{where}: example {i + 1} has label {v!r}; task {task.name!r} expects one of "
                f"{', '.join(task.label_names or ())} or a class id"
            )
        out.append(names[key])
    return out


def _make_dataset(task: TaskSpec, columns: dict[str, list], labels: list):
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


def _subset_indices(n: int, max_examples: int | None, shuffle: bool, seed: int) -> list[int] | None:
    if max_examples is None or max_examples >= n:
        return None
    if max_examples < 1:
        raise LunaConvertError(f"max_examples must be at least 1, got {max_examples}")
    if not shuffle:
        return list(range(max_examples))
    import numpy as np

    return sorted(np.random.default_rng(seed).permutation(n)[:max_examples].tolist())


# --------------------------------------------------------------------------------------
# GLUE TSV files

_GLUE_TEXT_HEADERS: dict[str, tuple[str, ...]] = {
    # task -> header names of its text columns in the original GLUE files (in task.text_columns order)
    "sst2": ("sentence",),
    "mrpc": ("#1 String", "#2 String"),
    "stsb": ("sentence1", "sentence2"),
    "qqp": ("question1", "question2"),
    "mnli": ("sentence1", "sentence2"),
    "mnli_mismatched": ("sentence1", "sentence2"),
    "qnli": ("question", "sentence"),
    "rte": ("sentence1", "sentence2"),
}
_GLUE_LABEL_HEADERS: dict[str, str] = {
    "sst2": "label", "mrpc": "Quality", "stsb": "score", "qqp": "is_duplicate",
    "mnli": "gold_label", "mnli_mismatched": "gold_label", "qnli": "label", "rte": "label",
}


def _read_tsv_rows(path: Path) -> list[list[str]]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            return [row for row in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE) if row]
    except UnicodeDecodeError as e:
        raise LunaConvertError(f"{path} is not UTF-8 text ({e}); save it as UTF-8") from None


def _read_glue_tsv(task: TaskSpec, path: Path, split: str):
    rows = _read_tsv_rows(path)
    if not rows:
        raise LunaConvertError(f"{path} is empty; expected a GLUE {task.glue_dir} TSV file")
    test = _is_test_split(split)
    texts: dict[str, list] = {c: [] for c in task.text_columns}
    raw_labels: list = []
    skipped = 0

    if task.name == "cola":
        first = [c.strip() for c in rows[0]]
        if "sentence" in first and first[0] != "index" and len(first) < 4:
            return _read_table_split(task, path, split)  # a TSV with a "sentence<TAB>label" header
        if first and first[0] == "index" and "sentence" in first:  # test.tsv: "index<TAB>sentence", no labels
            si = first.index("sentence")
            for row in rows[1:]:
                if len(row) <= si:
                    skipped += 1
                    continue
                texts["sentence"].append(row[si])
                raw_labels.append(-1)
        else:  # train/dev: no header; source, label, original_label, sentence
            if len(rows[0]) < 4:
                raise LunaConvertError(
                    f"{path}: expected the GLUE CoLA layout without a header (source, label, original label, sentence) "
                    f"but the first row has {len(rows[0])} column(s)"
                )
            for row in rows:
                if len(row) < 4:
                    skipped += 1
                    continue
                texts["sentence"].append(row[3])
                raw_labels.append(row[1])
    else:
        header = [c.strip() for c in rows[0]]
        wanted = _GLUE_TEXT_HEADERS[task.name]
        missing = [h for h in wanted if h not in header]
        if missing and all(c in header for c in task.text_columns):
            return _read_table_split(task, path, split)  # a TSV with the hub's column names
        if missing:
            raise LunaConvertError(
                f"{path}: header has columns {header} but GLUE {task.glue_dir} needs {list(wanted)}; "
                f"use the original GLUE {task.glue_dir} files or a CSV/JSONL file with columns "
                f"{list(task.text_columns) + ['label']}"
            )
        text_idx = [header.index(h) for h in wanted]
        label_name = _GLUE_LABEL_HEADERS[task.name]
        if label_name in header:
            li = header.index(label_name)
            label_last = li == len(header) - 1  # GLUE readers take the last field (robust to stray tabs)
        elif test:
            li, label_last = None, False
        else:
            raise LunaConvertError(f"{path}: no {label_name!r} column in header {header}; this split needs labels")
        need = max(text_idx + ([li] if li is not None else [])) + 1
        for row in rows[1:]:
            if len(row) < need:
                skipped += 1
                continue
            if li is None:
                label = -1.0 if task.is_regression else -1
            else:
                label = row[-1] if label_last else row[li]
                if task.glue_dir == "MNLI" and label.strip() == "-":  # no gold label
                    skipped += 1
                    continue
            for c, i in zip(task.text_columns, text_idx):
                texts[c].append(row[i])
            raw_labels.append(label)
    if skipped:
        logger.warning("%s: skipped %d malformed row(s)", path, skipped)
    if not raw_labels:
        raise LunaConvertError(f"{path} has a header but no examples; expected GLUE {task.glue_dir} rows")
    labels = _convert_labels(task, raw_labels, str(path))
    return _make_dataset(task, texts, labels)


# --------------------------------------------------------------------------------------
# CSV / JSON lines / parquet / generic TSV


def read_table(path: Path) -> dict[str, list]:
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


def _pick_column(cols: dict[str, list], name: str, aliases: Sequence[str], used: set[str]) -> str | None:
    lower = {k.lower(): k for k in cols}
    for cand in (name, *aliases):
        key = cand if cand in cols else lower.get(cand.lower())
        if key is not None and key not in used:
            return key
    return None


def _read_table_split(task: TaskSpec, path: Path, split: str):
    return _columns_to_dataset(task, read_table(path), path, split)


def _columns_to_dataset(task: TaskSpec, cols: dict[str, list], path, split: str):
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
        key = _pick_column(cols, c, aliases, used)
        if key is None:
            raise LunaConvertError(
                f"{path} has columns {list(cols)} but task {task.name!r} needs text column(s) "
                f"{list(task.text_columns)} and {task.label_column!r}; rename the columns or choose another --task"
            )
        used.add(key)
        texts[c] = ["" if _is_missing(v) else str(v) for v in cols[key]]
    lkey = _pick_column(cols, task.label_column, _LABEL_ALIASES, used)
    if lkey is None:
        if _is_test_split(split):
            labels: list = [-1.0 if task.is_regression else -1] * n
            return _make_dataset(task, texts, labels)
        raise LunaConvertError(
            f"{path} has columns {list(cols)} but no label column {task.label_column!r}; "
            f"task {task.name!r} needs columns {list(task.text_columns) + [task.label_column]}"
        )
    labels = _convert_labels(task, cols[lkey], str(path))
    return _make_dataset(task, texts, labels)


# --------------------------------------------------------------------------------------
# text splits


def _resolve_text_dir(task: TaskSpec, data_dir: Path) -> Path:
    """Accept either the task's folder or a GLUE root folder holding e.g. SST-2/."""
    if task.glue_dir and (data_dir / task.glue_dir).is_dir():
        if not any((data_dir / f"{s}{e}").is_file() for s in ("train", "dev", "dev_matched") for e in TABLE_EXTENSIONS):
            return data_dir / task.glue_dir
    return data_dir


def find_split_file(task: TaskSpec, data_dir: Path, split: str) -> Path:
    stems = _split_stems(task, split)
    for stem in stems:
        for ext in TABLE_EXTENSIONS:
            p = data_dir / f"{stem}{ext}"
            if p.is_file():
                return p
    present = sorted(p.name for p in data_dir.iterdir() if p.is_file())
    expected = ", ".join(f"{stems[0]}{e}" for e in TABLE_EXTENSIONS)
    raise LunaConvertError(
        f"no file for split {split!r} in {data_dir} (looked for {expected}); found: {', '.join(present) or 'nothing'}"
    )


def _load_hub_split(task: TaskSpec, split: str):
    if task.glue_config is None:
        raise LunaConvertError(
            f"task {task.name!r} has no built-in dataset; pass --data-dir with {split}.csv / .jsonl / .parquet files "
            f"holding columns {list(task.text_columns) + [task.label_column]}"
        )
    hub_split = canonical_split(split)
    if task.glue_config == "mnli" and hub_split in ("validation", "test"):
        suffix = "mismatched" if task.name == "mnli_mismatched" else "matched"
        hub_split = f"{hub_split}_{suffix}"
    try:
        import datasets

        ds = datasets.load_dataset("nyu-mll/glue", task.glue_config, split=hub_split)
    except Exception as e:  # noqa: BLE001 - offline / not cached / bad split all end here
        reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise LunaConvertError(
            f"cannot load GLUE {task.glue_config!r} split {hub_split!r} from the Hugging Face hub or its cache ({reason}); "
            f"download the GLUE files and pass --data-dir pointing at the {task.glue_dir} folder "
            f"(train.tsv, dev.tsv) and --model with a local model path"
        ) from None
    keep = [c for c in ds.column_names if c in task.text_columns or c == "label"]
    missing = [c for c in (*task.text_columns, "label") if c not in keep]
    if missing:
        raise LunaConvertError(f"hub dataset nyu-mll/glue {task.glue_config!r} lacks columns {missing}")
    ds = ds.select_columns(keep)
    if task.is_regression and not str(getattr(ds.features["label"], "dtype", "")).startswith("float"):
        import datasets

        ds = ds.cast_column("label", datasets.Value("float32"))
    return ds


def _load_text_split(task: TaskSpec, split: str, data_dir: Path | None):
    if data_dir is None:
        return _load_hub_split(task, split)
    data_dir = _resolve_text_dir(task, data_dir)
    path = find_split_file(task, data_dir, split)
    if path.suffix.lower() == ".tsv" and task.glue_config is not None:
        return _read_glue_tsv(task, path, split)
    return _read_table_split(task, path, split)


# --------------------------------------------------------------------------------------
# image splits


class _ImageDatasetBase:
    """Shared bits: ``classes``, ``targets``, ``label_map`` (applied by align_labels)."""

    classes: list[str]
    label_map: dict[int, int] | None = None

    def _target(self, y: int) -> int:
        return self.label_map.get(y, y) if self.label_map else y


class ImageFolderDataset(_ImageDatasetBase):
    """(PIL RGB image, class id) pairs from ``root/<class>/**/*.{jpg,png,...}``."""

    def __init__(self, root: Path, classes: list[str], samples: list[tuple[str, int]]):
        self.root = Path(root)
        self.classes = list(classes)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.samples = list(samples)
        self.label_map = None

    @property
    def targets(self) -> list[int]:
        return [self._target(y) for _, y in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        from PIL import Image

        path, y = self.samples[index]
        with Image.open(path) as img:
            img = img.convert("RGB")
        return img, self._target(y)

    def subset(self, indices: Sequence[int]) -> "ImageFolderDataset":
        out = ImageFolderDataset(self.root, self.classes, [self.samples[i] for i in indices])
        out.label_map = self.label_map
        return out

    def __repr__(self) -> str:
        return f"ImageFolderDataset(root={str(self.root)!r}, classes={len(self.classes)}, samples={len(self)})"


class DigitsDataset(_ImageDatasetBase):
    """scikit-learn's 8x8 digits as 32x32 RGB PIL images, classes "0".."9"."""

    def __init__(self, images, labels, size: int = 32):
        import numpy as np

        self.images = np.asarray(images, dtype=np.uint8)  # [N, 8, 8]
        self.labels = [int(y) for y in labels]
        self.size = size
        self.classes = [str(i) for i in range(10)]
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.label_map = None

    @property
    def targets(self) -> list[int]:
        return [self._target(y) for y in self.labels]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        from PIL import Image

        img = Image.fromarray(self.images[index])  # uint8 [8, 8] -> mode "L"
        img = img.resize((self.size, self.size), Image.NEAREST).convert("RGB")
        return img, self._target(self.labels[index])

    def subset(self, indices: Sequence[int]) -> "DigitsDataset":
        out = DigitsDataset(self.images[list(indices)], [self.labels[i] for i in indices], self.size)
        out.label_map = self.label_map
        return out

    def __repr__(self) -> str:
        return f"DigitsDataset(samples={len(self)})"


def _load_digits_split(split: str) -> DigitsDataset:
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    s = canonical_split(split)
    if s not in ("train", "validation"):
        raise unknown_name("split", split, ["train", "validation"])
    d = load_digits()
    images = np.clip(np.rint(d.images * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    idx_train, idx_val = train_test_split(
        np.arange(len(d.target)), test_size=0.2, stratify=d.target, random_state=0, shuffle=True
    )
    idx = idx_train if s == "train" else idx_val
    return DigitsDataset(images[idx], d.target[idx])


def _image_split_dir(data_dir: Path, split: str) -> Path:
    s = canonical_split(split)
    names = _IMAGE_SPLIT_DIRS.get(s, (split,))
    for name in names:
        if (data_dir / name).is_dir():
            return data_dir / name
    present = sorted(p.name for p in data_dir.iterdir() if p.is_dir())
    raise LunaConvertError(
        f"no folder for split {split!r} in {data_dir} (looked for {', '.join(names)}); "
        f"expected an ImageFolder layout {data_dir}/{names[0]}/<class>/<image>.jpg; found folders: {', '.join(present) or 'none'}"
    )


def _class_dirs(split_dir: Path) -> list[str]:
    return sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


def _load_image_folder(task: TaskSpec, data_dir: Path, split: str) -> ImageFolderDataset:
    split_dir = _image_split_dir(data_dir, split)
    classes = _class_dirs(split_dir)
    if not classes:
        raise LunaConvertError(
            f"{split_dir} has no class folders; expected {split_dir}/<class name>/<image>.jpg|png"
        )
    # Class ids must agree across splits even when one split lacks a class: take the union of the
    # class folders of all split folders next to this one (sorted names, as torchvision/timm do).
    siblings = {split_dir}
    for names in _IMAGE_SPLIT_DIRS.values():
        for name in names:
            if (data_dir / name).is_dir():
                siblings.add(data_dir / name)
    all_classes = sorted({c for d in siblings for c in _class_dirs(d)})
    class_to_idx = {c: i for i, c in enumerate(all_classes)}
    samples: list[tuple[str, int]] = []
    for c in classes:
        for dirpath, dirnames, filenames in os.walk(split_dir / c, followlinks=True):
            dirnames.sort()
            for fn in sorted(filenames):
                if fn.lower().endswith(IMAGE_EXTENSIONS) and not fn.startswith("."):
                    samples.append((os.path.join(dirpath, fn), class_to_idx[c]))
    if not samples:
        raise LunaConvertError(
            f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {split_dir}; expected {split_dir}/<class name>/<image>.jpg|png"
        )
    return ImageFolderDataset(split_dir, all_classes, samples)


def _interleave_by_class(labels: Sequence[int]) -> list[int]:
    """Indices ordered round-robin over classes, so any prefix is class-balanced."""
    by_class: dict[int, list[int]] = {}
    for i, y in enumerate(labels):
        by_class.setdefault(y, []).append(i)
    order: list[int] = []
    queues = [by_class[k] for k in sorted(by_class)]
    depth = max((len(q) for q in queues), default=0)
    for j in range(depth):
        for q in queues:
            if j < len(q):
                order.append(q[j])
    return order


def _load_image_split(task: TaskSpec, split: str, data_dir: Path | None, max_examples: int | None, seed: int):
    if task.name == "digits":
        ds = _load_digits_split(split)
        if max_examples is not None:
            train = canonical_split(split) == "train"
            idx = _subset_indices(len(ds), max_examples, shuffle=train, seed=seed)
            if idx is not None:
                ds = ds.subset(idx)
        return ds
    if data_dir is None:
        raise LunaConvertError(
            f"task {task.name!r} needs --data-dir: an ImageFolder with train/<class>/*.jpg and val/<class>/*.jpg"
        )
    ds = _load_image_folder(task, data_dir, split)
    if max_examples is not None and max_examples < len(ds):
        if max_examples < 1:
            raise LunaConvertError(f"max_examples must be at least 1, got {max_examples}")
        if canonical_split(split) == "train":
            idx = _subset_indices(len(ds), max_examples, shuffle=True, seed=seed)
        else:  # ImageFolder order is sorted by class: take a class-balanced prefix instead
            idx = sorted(_interleave_by_class([y for _, y in ds.samples])[:max_examples])
        ds = ds.subset(idx)
    return ds


# --------------------------------------------------------------------------------------
# public: load_split


def load_split(task: TaskSpec | str, split: str, data_dir: str | Path | None = None,
               max_examples: int | None = None, seed: int = 0):
    """One split of ``task``'s data.

    Text tasks: a ``datasets.Dataset`` with columns ``task.text_columns`` + ``"label"`` (int class
    ids; float for regression; -1 on unlabelled test splits; strings only for generic tasks whose
    files hold class names — :func:`align_labels` maps those). Image tasks: a torch-style dataset of
    ``(PIL.Image RGB, int label)`` with a ``classes`` attribute.

    ``max_examples``: a deterministic subset — ``max_examples`` rows drawn with ``seed`` for the
    train split, the first ``max_examples`` for evaluation splits (class-balanced for ImageFolders).
    """
    task = get_task(task)
    if task.name == "digits":
        data_dir = None  # shipped with scikit-learn
    if data_dir is not None and datasets_source(data_dir) is not None:  # save_to_disk folder or hf:<id>
        return _load_datasets_split(task, split, data_dir, max_examples, seed)
    if data_dir is not None:
        data_dir = Path(data_dir).expanduser()
        if not data_dir.exists():
            raise LunaConvertError(f"data folder {data_dir} does not exist; check --data-dir "
                                   f"(a hub dataset is written hf:<dataset id>)")
        if not data_dir.is_dir():
            raise LunaConvertError(f"--data-dir {data_dir} is a file; pass the folder that holds the split files")
    if task.kind == "image":
        return _load_image_split(task, split, data_dir, max_examples, seed)

    ds = _load_text_split(task, split, data_dir)
    if len(ds) == 0:
        raise LunaConvertError(f"split {split!r} of task {task.name!r} has no examples")
    train = canonical_split(split) == "train"
    idx = _subset_indices(len(ds), max_examples, shuffle=train, seed=seed)
    if idx is not None:
        ds = ds.select(idx)
    return ds


# --------------------------------------------------------------------------------------
# public: align_labels


def model_label_names(id2label: dict | None, num_labels: int) -> list[str] | None:
    """Model class names in index order, or None when they are generic (LABEL_0.., "0"..)."""
    if not id2label:
        return None
    names: dict[int, str] = {}
    for k, v in id2label.items():
        i = _try_int(k)
        if i is None:
            return None
        names[i] = str(v)
    if sorted(names) != list(range(len(names))):
        return None
    ordered = [names[i] for i in range(len(names))]
    generic = True
    for i, n in enumerate(ordered):
        m = _GENERIC_LABEL.match(n.strip().lower())
        if not ((m and int(m.group(1)) == i) or n.strip() == str(i)):
            generic = False
    return None if generic else ordered


def _align_image_labels(dataset, task: TaskSpec, id2label, num_labels: int):
    classes = list(getattr(dataset, "classes", []) or [])
    names = model_label_names(id2label, num_labels)
    if names is not None and classes:
        index = {normalize_label_name(n): i for i, n in enumerate(names)}
        if all(normalize_label_name(c) in index for c in classes):
            mapping = {i: index[normalize_label_name(c)] for i, c in enumerate(classes)}
            if any(k != v for k, v in mapping.items()):
                dataset.label_map = mapping
            return dataset
    if len(classes) > num_labels:
        raise LunaConvertError(
            f"the data has {len(classes)} classes but the model predicts {num_labels}; "
            f"use a model trained on these classes or remove the extra class folders"
        )
    return dataset


def align_labels(dataset, task: TaskSpec | str, id2label: dict[int, str] | None, num_labels: int):
    """Make the data's label ids index the model's classes.

    Maps string labels through the model's ``id2label`` (case/separator-insensitive) — or through
    ``task.label_names`` when the model's names are generic (LABEL_0, ...); permutes GLUE class ids
    when the model names the task's classes in another order. Raises LunaConvertError when the data
    has more classes than the model or when names cannot be matched. Returns the dataset (a new one
    for text; image datasets get a ``label_map``).
    """
    task = get_task(task)
    if task.is_regression:
        return dataset
    if task.kind == "image" or not hasattr(dataset, "column_names"):
        return _align_image_labels(dataset, task, id2label, num_labels)
    if "label" not in dataset.column_names:
        raise LunaConvertError(f"the data for task {task.name!r} has no 'label' column")

    labels = list(dataset["label"])
    model_names = model_label_names(id2label, num_labels)
    model_index = {normalize_label_name(n): i for i, n in enumerate(model_names or [])}
    task_names = [normalize_label_name(n) for n in (task.label_names or ())]
    shown = f"model classes {model_names}" if model_names else f"{num_labels} model classes"
    changed = False
    new: list[int] = []

    if any(isinstance(y, str) for y in labels):
        if model_names is not None:
            lookup = model_index
            what = f"the model's id2label {model_names}"
        elif task_names:
            lookup = {n: i for i, n in enumerate(task_names)}
            what = f"task {task.name!r} labels {list(task.label_names or ())}"
        else:
            lookup = {}
            what = "the model's id2label, which only has generic names (LABEL_0, ...)"
        for y in labels:
            i = _try_int(y)
            if i is None:
                key = normalize_label_name(y)
                if key not in lookup:
                    raise LunaConvertError(
                        f"data label {y!r} does not match {what}; write the labels as class ids 0..{num_labels - 1} "
                        f"or use a model whose config names these classes"
                    )
                i = lookup[key]
            new.append(i)
        changed = True
    else:
        new = [int(y) for y in labels]
        if model_names is not None and task_names:
            missing = [task.label_names[j] for j, n in enumerate(task_names) if n not in model_index]
            if missing:
                raise LunaConvertError(
                    f"the model's classes {model_names} do not include task {task.name!r} label(s) {missing}; "
                    f"use a model finetuned on {task.name} (or one with generic LABEL_0.. names to keep class ids)"
                )
            perm = [model_index[n] for n in task_names]
            if perm != list(range(len(perm))):
                bad = [y for y in new if y >= len(perm)]
                if bad:
                    raise LunaConvertError(
                        f"label id {bad[0]} is out of range for task {task.name!r} ({len(perm)} classes)"
                    )
                new = [perm[y] if y >= 0 else y for y in new]
                changed = True
                logger.info("remapped %s labels to the model's class order %s", task.name, model_names)

    present = sorted({y for y in new if y >= 0})
    if len(present) > num_labels or (present and present[-1] >= num_labels):
        raise LunaConvertError(
            f"the data has {len(present)} distinct label(s) {present[:10]} but the model has {shown} "
            f"(ids 0..{num_labels - 1}); "
            f"use a model with at least {max(len(present), present[-1] + 1)} classes or check --task"
        )
    if changed:  # plain int64 ids (a hub ClassLabel's names would no longer fit)
        dataset = dataset.remove_columns("label").add_column("label", new)
    return dataset


# --------------------------------------------------------------------------------------
# public: DataLoaders


class _TokenizedDataset:
    def __init__(self, features: dict[str, list[list[int]]], labels: list):
        self.features = features
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        item = {k: v[i] for k, v in self.features.items()}
        item["labels"] = self.labels[i]
        return item


class _TextCollator:
    def __init__(self, pad_token_id: int, padding_side: str, regression: bool):
        self.pad_token_id = pad_token_id
        self.padding_side = padding_side
        self.regression = regression

    def __call__(self, items: list[dict]) -> dict:
        import torch

        longest = max(len(it["input_ids"]) for it in items)
        out: dict[str, Any] = {}
        for key in items[0]:
            if key == "labels":
                continue
            pad = self.pad_token_id if key == "input_ids" else 0
            rows = []
            for it in items:
                seq = list(it[key])
                fill = [pad] * (longest - len(seq))
                rows.append(fill + seq if self.padding_side == "left" else seq + fill)
            out[key] = torch.tensor(rows, dtype=torch.long)
        dtype = torch.float32 if self.regression else torch.long
        out["labels"] = torch.tensor([it["labels"] for it in items], dtype=dtype)
        return out


def _texts(dataset, column: str) -> list[str]:
    return ["" if v is None else str(v) for v in dataset[column]]


def tokenize_dataset(dataset, task: TaskSpec | str, tokenizer, max_length: int = 128,
                     chunk_size: int = 4096) -> tuple[dict[str, list[list[int]]], int]:
    """Tokenize ``dataset``'s text columns once. Returns (features, number of truncated examples)."""
    task = get_task(task)
    missing = [c for c in task.text_columns if c not in dataset.column_names]
    if missing:
        raise LunaConvertError(
            f"the data has columns {dataset.column_names} but task {task.name!r} needs {list(task.text_columns)}"
        )
    cols = [_texts(dataset, c) for c in task.text_columns]
    n = len(cols[0]) if cols else 0
    features: dict[str, list[list[int]]] = {}
    truncated = 0
    keys = ("input_ids", "attention_mask", "token_type_ids")
    for start in range(0, n, chunk_size):
        parts = [c[start:start + chunk_size] for c in cols]
        enc = tokenizer(*parts, truncation=False, padding=False, verbose=False)
        batch = {k: list(enc[k]) for k in keys if k in enc}
        long = [i for i, ids in enumerate(batch["input_ids"]) if len(ids) > max_length]
        if long:
            truncated += len(long)
            sub = [[p[i] for i in long] for p in parts]
            enc2 = tokenizer(*sub, truncation=True, max_length=max_length, padding=False, verbose=False)
            for k in batch:
                for j, i in enumerate(long):
                    batch[k][i] = enc2[k][j]
        for k, v in batch.items():
            features.setdefault(k, []).extend(v)
    if not features:
        features = {"input_ids": [], "attention_mask": []}
    if "attention_mask" not in features:
        features["attention_mask"] = [[1] * len(ids) for ids in features["input_ids"]]
    return features, truncated


def make_text_dataloader(dataset, task: TaskSpec | str, tokenizer, *, batch_size: int, max_length: int = 128,
                         shuffle: bool = False, seed: int = 0):
    """A DataLoader of padded batches: ``input_ids``, ``attention_mask``, ``token_type_ids`` (when the
    tokenizer makes them) and ``labels`` (long; float for regression). Text is tokenized once here;
    each batch is padded to its longest example. Shuffling uses a ``torch.Generator`` seeded with
    ``seed``. ``loader.num_truncated`` counts examples cut to ``max_length``."""
    import torch
    from torch.utils.data import DataLoader

    task = get_task(task)
    if batch_size < 1:
        raise LunaConvertError(f"batch size must be at least 1, got {batch_size}")
    if "label" not in dataset.column_names:
        raise LunaConvertError(f"the data for task {task.name!r} has no 'label' column")
    labels = list(dataset["label"])
    if any(isinstance(y, str) for y in labels):
        raise LunaConvertError(
            f"task {task.name!r} data has text labels such as {next(y for y in labels if isinstance(y, str))!r}; "
            f"map them to class ids with align_labels first"
        )
    labels = [float(y) for y in labels] if task.is_regression else [int(y) for y in labels]
    features, truncated = tokenize_dataset(dataset, task, tokenizer, max_length=max_length)
    pad_id = getattr(tokenizer, "pad_token_id", None)
    if pad_id is None:
        pad_id = 0
    collate = _TextCollator(int(pad_id), getattr(tokenizer, "padding_side", "right"), task.is_regression)
    generator = torch.Generator()
    generator.manual_seed(int(seed))
    loader = DataLoader(_TokenizedDataset(features, labels), batch_size=batch_size, shuffle=shuffle,
                        collate_fn=collate, generator=generator)
    loader.num_truncated = truncated
    loader.longest = max((len(ids) for ids in features["input_ids"]), default=0)  # tokens, after truncation
    loader.num_examples = len(labels)
    loader.max_length = max_length
    return loader


def image_transform(mean, std, image_size: int, train: bool, *, crop_pct: float = 0.875, hflip: bool = True,
                    interpolation: str = "bicubic"):
    """torchvision transform: train = RandomResizedCrop(scale 0.5-1) + horizontal flip; eval =
    Resize(image_size / crop_pct) + CenterCrop(image_size); then ToTensor + Normalize.
    ``crop_pct`` / ``interpolation`` can come from timm's ``resolve_data_config``."""
    from torchvision import transforms as T

    if isinstance(image_size, (tuple, list)):
        image_size = int(image_size[-1])
    image_size = int(image_size)
    try:
        interp = T.InterpolationMode(str(interpolation).lower())
    except ValueError:
        choices = [m.value for m in T.InterpolationMode]
        raise unknown_name("interpolation", str(interpolation), choices) from None
    norm = [T.ToTensor(), T.Normalize(mean=[float(m) for m in mean], std=[float(s) for s in std])]
    if train:
        ops = [T.RandomResizedCrop(image_size, scale=(0.5, 1.0), interpolation=interp)]
        if hflip:
            ops.append(T.RandomHorizontalFlip())
        return T.Compose(ops + norm)
    resize = int(math.floor(image_size / crop_pct)) if crop_pct and crop_pct < 1 else image_size
    return T.Compose([T.Resize(resize, interpolation=interp), T.CenterCrop(image_size), *norm])


class _TransformedImages:
    """Applies ``transform`` to each image. Random transforms draw from torch's generator re-seeded
    from (seed, epoch, index) inside a forked RNG: an example's augmentation does not depend on what
    was loaded before it (so a resumed run sees the same pixels) and loading never consumes the
    global RNG that dropout uses. Training loops call ``set_epoch`` so each epoch differs."""

    def __init__(self, dataset, transform, seed: int = 0):
        self.dataset = dataset
        self.transform = transform
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        import torch

        img, y = self.dataset[i]
        if self.transform is None:
            return img, int(y)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(((self.seed * 1_000_003 + self.epoch) * 1_000_033 + int(i)) % (2**63))
            return self.transform(img), int(y)


def _collate_images(items):
    import torch

    pixels = torch.stack([x for x, _ in items])
    return {"pixel_values": pixels.float(), "labels": torch.tensor([y for _, y in items], dtype=torch.long)}


def make_image_dataloader(dataset, transform, *, batch_size: int, shuffle: bool = False, seed: int = 0,
                          num_workers: int = 0):
    """A DataLoader of ``{"pixel_values": float [B,3,H,W], "labels": long [B]}``; the transform
    runs in the workers. Shuffling uses a ``torch.Generator`` seeded with ``seed``."""
    import torch
    from torch.utils.data import DataLoader

    if batch_size < 1:
        raise LunaConvertError(f"batch size must be at least 1, got {batch_size}")
    generator = torch.Generator()
    generator.manual_seed(int(seed))
    loader = DataLoader(_TransformedImages(dataset, transform, seed), batch_size=batch_size, shuffle=shuffle,
                        num_workers=num_workers, collate_fn=_collate_images, generator=generator,
                        persistent_workers=False)
    loader.num_examples = len(dataset)
    loader.classes = list(getattr(dataset, "classes", []) or [])
    return loader


# --------------------------------------------------------------------------------------
# datasets sources: a folder written by ``save_to_disk`` or a hub dataset ``hf:<id>[:<config>]``

HUB_PREFIX = "hf:"
_HUB_CACHE: dict[str, Any] = {}


def datasets_source(data_dir: str | Path) -> str | None:
    """``"hub"`` for ``hf:<id>``, ``"saved"`` for a folder written by ``save_to_disk``, else None."""
    s = str(data_dir)
    if s.startswith(HUB_PREFIX):
        return "hub"
    path = Path(s).expanduser()
    if path.is_dir() and ((path / "dataset_dict.json").is_file()
                          or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file())):
        return "saved"
    return None


def load_datasets_dict(data_dir: str | Path):
    """The ``datasets.DatasetDict`` behind a save_to_disk folder or ``hf:<id>[:<config>]``; a single
    saved ``Dataset`` becomes the ``train`` split."""
    import datasets

    s = str(data_dir)
    kind = datasets_source(s)
    if kind == "hub":
        if s in _HUB_CACHE:
            return _HUB_CACHE[s]
        name, _, config = s[len(HUB_PREFIX):].partition(":")
        if not name:
            raise LunaConvertError("--data-dir hf: needs a dataset id, e.g. hf:stanfordnlp/imdb or hf:nyu-mll/glue:sst2")
        try:
            dd = datasets.load_dataset(name, config or None)
        except Exception as e:  # noqa: BLE001 - offline / unknown id / bad config all end here
            reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            raise LunaConvertError(
                f"cannot load hub dataset {name!r}{f' config {config!r}' if config else ''} ({reason}); "
                "without a hub connection, save it with save_to_disk elsewhere and pass that folder as --data-dir"
            ) from None
    elif kind == "saved":
        try:
            dd = datasets.load_from_disk(str(Path(s).expanduser()))
        except Exception as e:  # noqa: BLE001 - any reader failure is a bad folder
            raise LunaConvertError(f"cannot read the saved dataset in {s} ({type(e).__name__}: "
                                   f"{str(e).splitlines()[0][:160] if str(e) else ''})") from None
    else:
        raise LunaConvertError(f"{s} is neither a save_to_disk folder nor hf:<dataset id>")
    if isinstance(dd, datasets.Dataset):
        dd = datasets.DatasetDict({"train": dd})
    if kind == "hub":
        _HUB_CACHE[s] = dd
    return dd


def datasets_split_name(dd, split: str, where: str) -> str:
    """The key of ``split`` in a DatasetDict (``validation`` also finds dev/val/valid)."""
    if split in dd:
        return split
    canon = canonical_split(split)
    for cand in (canon, *_SPLIT_STEMS.get(canon, ())):
        if cand in dd:
            return cand
    raise LunaConvertError(f"{where} has no split {split!r}; its splits are {', '.join(dd) or 'none'}; "
                           "name them with --train-split / --eval-split")


def datasets_image_column(ds) -> str | None:
    """The first column holding images (a ``datasets.Image`` feature, else one named image/img)."""
    import datasets

    for name, feature in ds.features.items():
        if isinstance(feature, datasets.Image):
            return name
    return next((c for c in ds.column_names if c.lower() in ("image", "img")), None)


def datasets_class_names(dd, column: str) -> list[str]:
    """Class names of a label column over all splits: a ClassLabel's names, else the sorted distinct
    values (integers give "0".."max")."""
    import datasets

    for ds in dd.values():
        feature = ds.features.get(column)
        if isinstance(feature, datasets.ClassLabel):
            return list(feature.names)
    values = {v for ds in dd.values() if column in ds.column_names for v in ds[column] if not _is_missing(v)}
    ints = [_try_int(v) for v in values]
    if values and all(i is not None for i in ints):
        return [str(i) for i in range(max(ints) + 1)]
    return sorted(str(v) for v in values)


class DatasetsImageDataset(_ImageDatasetBase):
    """(PIL RGB image, class id) pairs from a ``datasets.Dataset`` with an image and a label column."""

    def __init__(self, dataset, image_column: str, label_column: str, classes: list[str]):
        self.dataset = dataset
        self.image_column, self.label_column = image_column, label_column
        self.classes = list(classes)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.label_map = None

    def _class_id(self, y) -> int:
        i = _try_int(y)
        if i is None:
            i = self.class_to_idx[str(y)]
        return self._target(i)

    @property
    def targets(self) -> list[int]:
        return [self._class_id(y) for y in self.dataset[self.label_column]]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        from PIL import Image

        row = self.dataset[int(index)]
        img = row[self.image_column]
        if isinstance(img, dict):  # undecoded {"bytes", "path"}
            import io

            img = Image.open(io.BytesIO(img["bytes"])) if img.get("bytes") else Image.open(img["path"])
        elif not isinstance(img, Image.Image):
            import numpy as np

            img = Image.fromarray(np.asarray(img, dtype=np.uint8))
        return img.convert("RGB"), self._class_id(row[self.label_column])

    def subset(self, indices: Sequence[int]) -> "DatasetsImageDataset":
        out = DatasetsImageDataset(self.dataset.select(list(indices)), self.image_column, self.label_column,
                                   self.classes)
        out.label_map = self.label_map
        return out

    def __repr__(self) -> str:
        return f"DatasetsImageDataset(classes={len(self.classes)}, samples={len(self)})"


def _load_datasets_split(task: TaskSpec, split: str, data_dir, max_examples: int | None, seed: int):
    import datasets

    dd = load_datasets_dict(data_dir)
    name = datasets_split_name(dd, split, str(data_dir))
    ds = dd[name]
    where = f"{data_dir} split {name!r}"
    if len(ds) == 0:
        raise LunaConvertError(f"{where} has no examples")
    idx = _subset_indices(len(ds), max_examples, shuffle=canonical_split(split) == "train", seed=seed)
    if task.kind == "image":
        image_column = datasets_image_column(ds)
        label_column = _pick_column({c: None for c in ds.column_names}, task.label_column,
                                    (*_LABEL_ALIASES, "fine_label"), {image_column})
        if image_column is None or label_column is None:
            raise LunaConvertError(f"{where} has columns {ds.column_names} but image classification needs an image "
                                   f"column and a label column ({task.label_column!r})")
        out = DatasetsImageDataset(ds, image_column, label_column, datasets_class_names(dd, label_column))
        return out.subset(idx) if idx is not None else out
    if idx is not None:
        ds = ds.select(idx)
    cols = {c: list(ds[c]) for c, f in ds.features.items() if isinstance(f, (datasets.Value, datasets.ClassLabel))}
    return _columns_to_dataset(task, cols, where, split)
