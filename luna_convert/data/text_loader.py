"""Text DataLoaders: tokenising once (counting the examples cut to ``max_length``) and padding
each batch to its longest example."""

from __future__ import annotations

from typing import Any

from ..errors import LunaConvertError
from ..tasks import TaskSpec, get_task


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
