"""Text DataLoaders: tokenising once (counting the examples cut to ``max_length``) and padding
each batch to its longest example; for token tasks, word tags carried over to the sub-word tokens."""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import LunaConvertError
from ..tasks import IGNORE_INDEX, TaskSpec, get_task

_ENCODING_KEYS = ("input_ids", "attention_mask", "token_type_ids")


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
    def __init__(self, pad_token_id: int, padding_side: str, regression: bool, token_level: bool = False):
        self.pad_token_id = pad_token_id
        self.padding_side = padding_side
        self.regression = regression
        self.token_level = token_level  # labels are one per token, padded like the inputs

    def __call__(self, items: list[dict]) -> dict:
        import torch

        longest = max(len(it["input_ids"]) for it in items)

        def padded(key: str, pad: int) -> list[list[int]]:
            rows = []
            for it in items:
                seq = list(it[key])
                fill = [pad] * (longest - len(seq))
                rows.append(fill + seq if self.padding_side == "left" else seq + fill)
            return rows

        out: dict[str, Any] = {}
        for key in items[0]:
            if key != "labels":
                out[key] = torch.tensor(padded(key, self.pad_token_id if key == "input_ids" else 0), dtype=torch.long)
        if self.token_level:
            out["labels"] = torch.tensor(padded("labels", IGNORE_INDEX), dtype=torch.long)
        else:
            dtype = torch.float32 if self.regression else torch.long
            out["labels"] = torch.tensor([it["labels"] for it in items], dtype=dtype)
        return out


def _texts(dataset, column: str) -> list[str]:
    return ["" if v is None else str(v) for v in dataset[column]]


def _encode(tokenizer, parts: list[list], max_length: int, words: bool):
    """One chunk of examples encoded whole, those longer than ``max_length`` tokens encoded again cut to it.
    Returns (features, each example's word index per token when ``words`` (pre-split words) else None,
    number of examples cut)."""
    options = {"is_split_into_words": True} if words else {}
    enc = tokenizer(*parts, truncation=False, padding=False, verbose=False, **options)
    batch = {k: list(enc[k]) for k in _ENCODING_KEYS if k in enc}
    word_ids = [enc.word_ids(i) for i in range(len(batch["input_ids"]))] if words else None
    long = [i for i, ids in enumerate(batch["input_ids"]) if len(ids) > max_length]
    if long:
        sub = [[p[i] for i in long] for p in parts]
        cut = tokenizer(*sub, truncation=True, max_length=max_length, padding=False, verbose=False, **options)
        for j, i in enumerate(long):
            for k in batch:
                batch[k][i] = cut[k][j]
            if words:
                word_ids[i] = cut.word_ids(j)
    return batch, word_ids, len(long)


def align_word_labels(word_ids: Sequence[int | None], word_labels: Sequence[int]) -> list[int]:
    """Per-token labels from per-word labels: a word's first sub-token gets the word's label; its other
    sub-tokens and special tokens (word id None) get IGNORE_INDEX, so each word is trained and scored once."""
    out, previous = [], None
    for word in word_ids:
        out.append(IGNORE_INDEX if word is None or word == previous else int(word_labels[word]))
        previous = word
    return out


def tokenize_dataset(dataset, task: TaskSpec | str, tokenizer, max_length: int = 128,
                     chunk_size: int = 4096) -> tuple[dict[str, list[list[int]]], int, list | None]:
    """Tokenize ``dataset``'s text columns once. Returns (features, number of truncated examples, each
    example's word index per token for a token task (its ``tokens`` are words), else None)."""
    task = get_task(task)
    missing = [c for c in task.text_columns if c not in dataset.column_names]
    if missing:
        raise LunaConvertError(
            f"the data has columns {dataset.column_names} but task {task.name!r} needs {list(task.text_columns)}"
        )
    words = task.is_token_level
    if words and not getattr(tokenizer, "is_fast", False):
        raise LunaConvertError(f"task {task.name!r} needs a fast tokenizer (tokenizer.json) to map words to sub-word "
                               f"tokens, but {type(tokenizer).__name__} is a slow one; save the model's fast tokenizer "
                               "beside it (AutoTokenizer.from_pretrained(..., use_fast=True).save_pretrained(folder))")
    cols = [list(dataset[c]) if words else _texts(dataset, c) for c in task.text_columns]
    n = len(cols[0]) if cols else 0
    features: dict[str, list[list[int]]] = {}
    word_ids: list | None = [] if words else None
    truncated = 0
    for start in range(0, n, chunk_size):
        batch, chunk_words, cut = _encode(tokenizer, [c[start:start + chunk_size] for c in cols], max_length, words)
        truncated += cut
        for k, v in batch.items():
            features.setdefault(k, []).extend(v)
        if words:
            word_ids.extend(chunk_words)
    if not features:
        features = {"input_ids": [], "attention_mask": []}
    if "attention_mask" not in features:
        features["attention_mask"] = [[1] * len(ids) for ids in features["input_ids"]]
    return features, truncated, word_ids


def make_text_dataloader(dataset, task: TaskSpec | str, tokenizer, *, batch_size: int, max_length: int = 128,
                         shuffle: bool = False, seed: int = 0):
    """A DataLoader of padded batches: ``input_ids``, ``attention_mask``, ``token_type_ids`` (when the
    tokenizer makes them) and ``labels`` (long; float for regression; for a token task, one a token,
    IGNORE_INDEX on padding, special tokens and sub-tokens after a word's first). Text is tokenized once here;
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
    values = [y for tags in labels for y in tags] if task.is_token_level else labels
    text_label = next((y for y in values if isinstance(y, str)), None)
    if text_label is not None:
        raise LunaConvertError(
            f"task {task.name!r} data has text labels such as {text_label!r}; "
            f"map them to class ids with align_labels first"
        )
    features, truncated, word_ids = tokenize_dataset(dataset, task, tokenizer, max_length=max_length)
    if task.is_token_level:
        labels = [align_word_labels(w, tags) for w, tags in zip(word_ids, labels)]
    else:
        labels = [float(y) for y in labels] if task.is_regression else [int(y) for y in labels]
    pad_id = getattr(tokenizer, "pad_token_id", None)
    if pad_id is None:
        pad_id = 0
    collate = _TextCollator(int(pad_id), getattr(tokenizer, "padding_side", "right"), task.is_regression,
                            token_level=task.is_token_level)
    generator = torch.Generator()
    generator.manual_seed(int(seed))
    loader = DataLoader(_TokenizedDataset(features, labels), batch_size=batch_size, shuffle=shuffle,
                        collate_fn=collate, generator=generator)
    loader.num_truncated = truncated
    loader.longest = max((len(ids) for ids in features["input_ids"]), default=0)  # tokens, after truncation
    loader.num_examples = len(labels)
    loader.max_length = max_length
    return loader
