"""Data from the ``datasets`` library: a hub dataset ``hf:<id>[:<config>]`` or a folder written by
``save_to_disk``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import LunaConvertError
from ..tasks import TaskSpec
from .images import DatasetsImageDataset
from .labels import int_or_none, is_missing
from .splits import SPLIT_STEMS, canonical_split, subset_indices
from .tables import LABEL_COLUMN_ALIASES, pick_column

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
    for cand in (canon, *SPLIT_STEMS.get(canon, ())):
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
    values = {v for ds in dd.values() if column in ds.column_names for v in ds[column] if not is_missing(v)}
    ints = [int_or_none(v) for v in values]
    if values and all(i is not None for i in ints):
        return [str(i) for i in range(max(ints) + 1)]
    return sorted(str(v) for v in values)


def datasets_value_columns(ds) -> dict[str, list]:
    """A hub split's columns of plain values (numbers, strings, class labels), as lists."""
    import datasets

    return {c: list(ds[c]) for c, f in ds.features.items() if isinstance(f, (datasets.Value, datasets.ClassLabel))}


def load_datasets_split(task: TaskSpec, split: str, data_dir, max_examples: int | None, seed: int, reader):
    """``split`` of a hub dataset or save_to_disk folder, as load_split returns it for the task's kind
    (``reader``: see :func:`luna_convert.data.load_split`)."""
    dd = load_datasets_dict(data_dir)
    name = datasets_split_name(dd, split, str(data_dir))
    ds = dd[name]
    where = f"{data_dir} split {name!r}"
    if len(ds) == 0:
        raise LunaConvertError(f"{where} has no examples")
    idx = subset_indices(len(ds), max_examples, shuffle=canonical_split(split) == "train", seed=seed)
    if task.kind == "image":
        image_column = datasets_image_column(ds)
        label_column = pick_column({c: None for c in ds.column_names}, task.label_column,
                                   (*LABEL_COLUMN_ALIASES, "fine_label"), {image_column})
        if image_column is None or label_column is None:
            raise LunaConvertError(f"{where} has columns {ds.column_names} but image classification needs an image "
                                   f"column and a label column ({task.label_column!r})")
        out = DatasetsImageDataset(ds, image_column, label_column, datasets_class_names(dd, label_column))
        return out.subset(idx) if idx is not None else out
    if idx is not None:
        ds = ds.select(idx)
    return reader.read_datasets(task, ds, where, split)
