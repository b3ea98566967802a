"""GLUE data: the original TSV files (each task's own layout) and the hub's ``nyu-mll/glue``."""

from __future__ import annotations

import logging
from pathlib import Path

from ..errors import LunaConvertError
from ..tasks import TaskSpec
from .labels import parse_labels
from .splits import canonical_split, is_test_split
from .tables import read_rows, read_table_split, task_dataset

logger = logging.getLogger(__name__)

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
    return [row for _, row in read_rows(path, "\t")]


def read_glue_tsv(task: TaskSpec, path: Path, split: str):
    """A GLUE TSV file in its task's original layout (or a TSV with the hub's column names) as a Dataset."""
    rows = _read_tsv_rows(path)
    if not rows:
        raise LunaConvertError(f"{path} is empty; expected a GLUE {task.glue_dir} TSV file")
    test = is_test_split(split)
    texts: dict[str, list] = {c: [] for c in task.text_columns}
    raw_labels: list = []
    skipped = 0

    if task.name == "cola":
        first = [c.strip() for c in rows[0]]
        if "sentence" in first and first[0] != "index" and len(first) < 4:
            return read_table_split(task, path, split)  # a TSV with a "sentence<TAB>label" header
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
            return read_table_split(task, path, split)  # a TSV with the hub's column names
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
    labels = parse_labels(task, raw_labels, str(path))
    return task_dataset(task, texts, labels)


def load_glue_hub_split(task: TaskSpec, split: str):
    """``split`` of the task's GLUE dataset from the hub (``nyu-mll/glue``) or its cache."""
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
