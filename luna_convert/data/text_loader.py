"""Text DataLoaders: tokenising once (counting the examples cut to ``max_length``) and padding
each batch to its longest example; for token tasks, word tags carried over to the sub-word tokens; for
extractive QA, answers as start and end tokens of the context; for sentence embeddings, texts with float
targets (the teacher's embeddings, or similarity scores)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
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
            import numpy as np

            dtype = torch.float32 if self.regression else torch.long
            # np.asarray first: rows of a [N, D] target array stack at once (torch is slow on a list of arrays)
            out["labels"] = torch.as_tensor(np.asarray([it["labels"] for it in items]), dtype=dtype)
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
                     chunk_size: int = 4096, words: bool = False) -> tuple[dict[str, list[list[int]]], int, list | None]:
    """Tokenize ``dataset``'s text columns once. Returns (features, number of truncated examples, each
    example's word index per token when ``words`` (the text column holds lists of words), else None)."""
    task = get_task(task)
    missing = [c for c in task.text_columns if c not in dataset.column_names]
    if missing:
        raise LunaConvertError(
            f"the data has columns {dataset.column_names} but task {task.name!r} needs {list(task.text_columns)}"
        )
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
                         shuffle: bool = False, seed: int = 0, words: bool = False):
    """A DataLoader of padded batches: ``input_ids``, ``attention_mask``, ``token_type_ids`` (when the
    tokenizer makes them) and ``labels`` (long; float for regression; with ``words`` (a token task: lists of
    words, a tag a word), one a token, IGNORE_INDEX on padding, special tokens and sub-tokens after a word's
    first). Text is tokenized once here;
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
    values = [y for tags in labels for y in tags] if words else labels
    text_label = next((y for y in values if isinstance(y, str)), None)
    if text_label is not None:
        raise LunaConvertError(
            f"task {task.name!r} data has text labels such as {text_label!r}; "
            f"map them to class ids with align_labels first"
        )
    features, truncated, word_ids = tokenize_dataset(dataset, task, tokenizer, max_length=max_length, words=words)
    if words:
        labels = [align_word_labels(w, tags) for w, tags in zip(word_ids, labels)]
    else:
        labels = [float(y) for y in labels] if task.is_regression else [int(y) for y in labels]
    pad_id = getattr(tokenizer, "pad_token_id", None)
    if pad_id is None:
        pad_id = 0
    collate = _TextCollator(int(pad_id), getattr(tokenizer, "padding_side", "right"), task.is_regression,
                            token_level=words)
    generator = torch.Generator()
    generator.manual_seed(int(seed))
    loader = DataLoader(_TokenizedDataset(features, labels), batch_size=batch_size, shuffle=shuffle,
                        collate_fn=collate, generator=generator)
    loader.num_truncated = truncated
    loader.longest = max((len(ids) for ids in features["input_ids"]), default=0)  # tokens, after truncation
    loader.num_examples = len(labels)
    loader.max_length = max_length
    return loader


def make_embedding_dataloader(texts: Sequence[str], targets: Sequence, tokenizer, *, batch_size: int,
                              max_length: int = 128, shuffle: bool = False, seed: int = 0, chunk_size: int = 4096):
    """A DataLoader of padded batches of single ``texts`` with float ``labels``: ``targets`` one a text (a
    vector, the teacher's embedding [B, D]; or a number, a pair's similarity score [B]). ``num_truncated``,
    ``longest``, ``num_examples`` as :func:`make_text_dataloader`."""
    import torch
    from torch.utils.data import DataLoader

    if batch_size < 1:
        raise LunaConvertError(f"batch size must be at least 1, got {batch_size}")
    if len(texts) != len(targets):
        raise LunaConvertError(f"{len(texts)} texts but {len(targets)} targets; they must match one to one")
    features: dict[str, list[list[int]]] = {"input_ids": [], "attention_mask": []}
    truncated = 0
    for start in range(0, len(texts), chunk_size):
        batch, _, cut = _encode(tokenizer, [list(texts[start:start + chunk_size])], max_length, words=False)
        truncated += cut
        for k, v in batch.items():
            features.setdefault(k, []).extend(v)
    if len(features["attention_mask"]) != len(features["input_ids"]):
        features["attention_mask"] = [[1] * len(ids) for ids in features["input_ids"]]
    pad_id = getattr(tokenizer, "pad_token_id", None)
    collate = _TextCollator(int(pad_id or 0), getattr(tokenizer, "padding_side", "right"), regression=True)
    generator = torch.Generator()
    generator.manual_seed(int(seed))
    loader = DataLoader(_TokenizedDataset(features, list(targets)), batch_size=batch_size, shuffle=shuffle,
                        collate_fn=collate, generator=generator)
    loader.num_truncated = truncated
    loader.longest = max((len(ids) for ids in features["input_ids"]), default=0)
    loader.num_examples = len(texts)
    loader.max_length = max_length
    return loader


@dataclass(frozen=True)
class QAExample:
    """What scoring an extractive QA example needs besides the model's logits: its context, each token's
    character span in it (None for the question, special tokens and padding) and the gold answer texts."""

    context: str
    offsets: tuple[tuple[int, int] | None, ...]
    answers: tuple[str, ...]


def answer_token_span(offsets: Sequence[tuple[int, int] | None], start_char: int, end_char: int) -> tuple[int, int]:
    """The first and last token (inclusive) of the answer ``context[start_char:end_char]`` among the context
    tokens (``offsets`` None elsewhere), or (0, 0), the [CLS] position, when truncation cut the answer off."""
    context = [i for i, span in enumerate(offsets) if span is not None]
    if not context or offsets[context[0]][0] > start_char or offsets[context[-1]][1] < end_char:
        return 0, 0
    first = next(i for i in context if offsets[i][1] > start_char)
    last = next(i for i in reversed(context) if offsets[i][0] < end_char)
    return first, last


def tokenize_qa(dataset, tokenizer, max_length: int = 384,
                chunk_size: int = 4096) -> tuple[dict[str, list[list[int]]], list[list[int]], list[QAExample], int]:
    """Question + context pairs encoded with only the context cut to ``max_length`` tokens (no sliding window:
    the end of a long context is dropped). Returns (features, [start, end] token labels of the first answer,
    each example's :class:`QAExample`, number of examples cut)."""
    if not getattr(tokenizer, "is_fast", False):
        raise LunaConvertError(f"question answering needs a fast tokenizer (tokenizer.json) to map answers to "
                               f"tokens, but {type(tokenizer).__name__} is a slow one; save the model's fast tokenizer "
                               "beside it (AutoTokenizer.from_pretrained(..., use_fast=True).save_pretrained(folder))")
    features: dict[str, list[list[int]]] = {}
    labels: list[list[int]] = []
    examples: list[QAExample] = []
    truncated = 0
    for begin in range(0, len(dataset), chunk_size):
        rows = dataset[begin:begin + chunk_size]
        questions, contexts = rows["question"], rows["context"]
        try:
            # the overflow rows (what truncation cut off) only tell which examples were cut
            enc = tokenizer(questions, contexts, truncation="only_second", max_length=max_length, padding=False,
                            return_offsets_mapping=True, return_overflowing_tokens=True, verbose=False)
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises a plain Exception
            if "truncat" not in str(e).lower():
                raise
            lengths = [len(ids) for ids in tokenizer(questions, add_special_tokens=False)["input_ids"]]
            longest = max(range(len(lengths)), key=lengths.__getitem__)
            raise LunaConvertError(f"{rows['source'][longest]}: the question alone is {lengths[longest]} tokens, too "
                                   f"long to leave room for the context in train.max_length {max_length}; raise "
                                   "--max-length or shorten the question") from None
        sample = list(enc["overflow_to_sample_mapping"])
        truncated += sum(rows_of_example > 1 for rows_of_example in Counter(sample).values())
        for row, i in enumerate(sample):
            if row and sample[row - 1] == i:  # an overflow row: only each example's first row is kept
                continue
            for key in _ENCODING_KEYS:
                if key in enc:
                    features.setdefault(key, []).append(list(enc[key][row]))
            in_context = [s == 1 for s in enc.sequence_ids(row)]
            offsets = tuple(tuple(span) if keep else None for span, keep in zip(enc["offset_mapping"][row], in_context))
            start = rows["answer_starts"][i][0]
            labels.append(list(answer_token_span(offsets, start, start + len(rows["answers"][i][0]))))
            examples.append(QAExample(contexts[i], offsets, tuple(rows["answers"][i])))
    if "attention_mask" not in features:
        features["attention_mask"] = [[1] * len(ids) for ids in features.get("input_ids", [])]
    return features, labels, examples, truncated


def make_qa_dataloader(dataset, tokenizer, *, batch_size: int, max_length: int = 384, shuffle: bool = False,
                       seed: int = 0):
    """A DataLoader of padded question + context batches (right padding: the labels are token positions) with
    ``labels`` [B, 2]: the first answer's start and end token, (0, 0) where truncation cut it off.
    ``loader.qa_examples`` holds what scoring maps predicted spans back to text with, in loader order
    (when not shuffled); ``num_truncated``, ``longest``, ``num_examples`` as :func:`make_text_dataloader`."""
    import torch
    from torch.utils.data import DataLoader

    if batch_size < 1:
        raise LunaConvertError(f"batch size must be at least 1, got {batch_size}")
    features, labels, examples, truncated = tokenize_qa(dataset, tokenizer, max_length=max_length)
    pad_id = getattr(tokenizer, "pad_token_id", None)
    collate = _TextCollator(int(pad_id or 0), "right", regression=False)
    generator = torch.Generator()
    generator.manual_seed(int(seed))
    loader = DataLoader(_TokenizedDataset(features, labels), batch_size=batch_size, shuffle=shuffle,
                        collate_fn=collate, generator=generator)
    loader.qa_examples = examples
    loader.num_truncated = truncated
    loader.longest = max((len(ids) for ids in features["input_ids"]), default=0)
    loader.num_examples = len(labels)
    loader.max_length = max_length
    return loader
