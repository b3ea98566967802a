"""``load_split``: one split of a task's data, from whichever source ``data_dir`` names."""

from __future__ import annotations

from pathlib import Path

from ..errors import LunaConvertError
from ..tasks import TaskSpec, get_task
from .glue import load_glue_hub_split, read_glue_tsv
from .hub import datasets_source, load_datasets_split
from .images import load_image_split
from .splits import canonical_split, subset_indices
from .tables import TABLE_EXTENSIONS, find_split_file, read_table_split


def _resolve_text_dir(task: TaskSpec, data_dir: Path) -> Path:
    """Accept either the task's folder or a GLUE root folder holding e.g. SST-2/."""
    if task.glue_dir and (data_dir / task.glue_dir).is_dir():
        if not any((data_dir / f"{s}{e}").is_file() for s in ("train", "dev", "dev_matched") for e in TABLE_EXTENSIONS):
            return data_dir / task.glue_dir
    return data_dir


def read_sequence_split(task: TaskSpec, split: str, data_dir: Path | None):
    """One split of a text task with a label an example: the hub's GLUE (no ``data_dir``), a GLUE TSV, or a
    CSV / TSV / JSON lines / parquet table."""
    if data_dir is None:
        return load_glue_hub_split(task, split)
    data_dir = _resolve_text_dir(task, data_dir)
    path = find_split_file(task, data_dir, split)
    if path.suffix.lower() == ".tsv" and task.glue_config is not None:
        return read_glue_tsv(task, path, split)
    return read_table_split(task, path, split)


def load_split(task: TaskSpec | str, split: str, data_dir: str | Path | None = None,
               max_examples: int | None = None, seed: int = 0, *, reader):
    """One split of ``task``'s data; ``reader`` is the task's kind (``luna_convert.task_kinds``), which reads a
    text split's files (``reader.read_files(task, split, data_dir)``) and turns a hub split into its rows
    (``reader.read_datasets(task, ds, where, split)``).

    Text tasks: a ``datasets.Dataset`` with columns ``task.text_columns`` + ``"label"`` (int class
    ids; float for regression; -1 on unlabelled test splits; strings only for generic tasks whose
    files hold class names — :func:`align_labels` maps those). Token tasks: columns ``tokens`` (a list of
    words), ``label`` (a list of tags, names or ids) and ``source`` (where each sentence is). Span (QA) tasks:
    ``id``, ``question``, ``context``, ``answers`` (texts), ``answer_starts`` and ``source``. Embedding tasks:
    ``sentence``, or ``sentence1``, ``sentence2`` and a float ``label`` where pairs are scored. Image tasks: a torch-style dataset of
    ``(PIL.Image RGB, int label)`` with a ``classes`` attribute.

    ``max_examples``: a deterministic subset — ``max_examples`` rows drawn with ``seed`` for the
    train split, the first ``max_examples`` for evaluation splits (class-balanced for ImageFolders).
    """
    task = get_task(task)
    if task.name == "digits":
        data_dir = None  # shipped with scikit-learn
    if data_dir is not None and datasets_source(data_dir) is not None:  # save_to_disk folder or hf:<id>
        return load_datasets_split(task, split, data_dir, max_examples, seed, reader)
    if data_dir is not None:
        data_dir = Path(data_dir).expanduser()
        if not data_dir.exists():
            raise LunaConvertError(f"data folder {data_dir} does not exist; check --data-dir "
                                   f"(a hub dataset is written hf:<dataset id>)")
        if not data_dir.is_dir():
            raise LunaConvertError(f"--data-dir {data_dir} is a file; pass the folder that holds the split files")
    if task.kind == "image":
        return load_image_split(task, split, data_dir, max_examples, seed)

    ds = reader.read_files(task, split, data_dir)
    if len(ds) == 0:
        raise LunaConvertError(f"split {split!r} of task {task.name!r} has no examples")
    train = canonical_split(split) == "train"
    idx = subset_indices(len(ds), max_examples, shuffle=train, seed=seed)
    if idx is not None:
        ds = ds.select(idx)
    return ds
