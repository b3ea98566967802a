"""Word-level tagged data (NER): CoNLL files (a word and its tag a line, blank lines between sentences)
and tables or ``datasets`` splits with a list of words and a list of tags per example (the hub's conll2003
layout: ``tokens``, ``ner_tags``)."""

from __future__ import annotations

import logging
from pathlib import Path

from ..errors import LunaConvertError
from ..tasks import TaskSpec
from .labels import int_or_none
from .tables import find_split_file, pick_column, read_table, read_text

logger = logging.getLogger(__name__)

CONLL_EXTENSIONS = (".txt", ".conll")
TOKEN_FILE_EXTENSIONS = (*CONLL_EXTENSIONS, ".jsonl", ".json", ".parquet")
WORD_COLUMN_ALIASES = ("words",)
TAG_COLUMN_ALIASES = ("tags", "ner", "labels", "label")
DOCSTART = "-DOCSTART-"  # CoNLL-2003's document separator line, not a word


def read_conll(path: Path) -> dict[str, list]:
    """Columns ``tokens``, ``ner_tags`` and ``source`` (file and first line, for messages) of a CoNLL file:
    one word a line with its tag in the last column (space or tab separated; other columns, such as
    CoNLL-2003's part-of-speech and chunk tags, are ignored), blank lines between sentences, ``-DOCSTART-``
    lines skipped."""
    text = read_text(path)
    cols: dict[str, list] = {"tokens": [], "ner_tags": [], "source": []}
    words: list[str] = []
    tags: list[str] = []
    first = 0

    def end_sentence() -> None:
        if words:
            cols["tokens"].append(list(words))
            cols["ner_tags"].append(list(tags))
            cols["source"].append(f"{path.name} line {first}")
            words.clear()
            tags.clear()

    for lineno, line in enumerate(text.splitlines(), 1):
        fields = [f.strip() for f in line.split("\t")] if "\t" in line else line.split()
        if not line.strip() or fields[0] == DOCSTART:
            end_sentence()
            continue
        if len(fields) < 2 or not fields[0] or not fields[-1]:
            raise LunaConvertError(f"{path}: line {lineno} ({line.strip()[:60]!r}) is not a word and its tag; expected "
                                   "one word a line with its tag in the last column, blank lines between sentences")
        if not words:
            first = lineno
        words.append(fields[0])
        tags.append(fields[-1])
    end_sentence()
    return cols


def token_dataset(cols: dict[str, list], where: str, sources: list[str] | None = None):
    """A ``datasets.Dataset`` of ``tokens`` (words), ``label`` (one tag a word: names, or ids when every tag
    is a whole number) and ``source`` (where each example is, for messages; default "<where> example i")
    from table columns; ``where`` names the data in messages."""
    import datasets

    used: set[str] = set()
    words_key = pick_column(cols, "tokens", WORD_COLUMN_ALIASES, used)
    tags_key = pick_column(cols, "ner_tags", TAG_COLUMN_ALIASES, used | {words_key})
    if words_key is None or tags_key is None:
        raise LunaConvertError(f"{where} has columns {list(cols)} but a token task needs a list of words ('tokens') "
                               "and a list of tags ('ner_tags') per example, or CoNLL .txt / .conll files")
    sources = sources or [f"{where} example {i + 1}" for i in range(len(cols[words_key]))]
    tokens, tags, kept_sources, empty = [], [], [], 0
    for words, word_tags, source in zip(cols[words_key], cols[tags_key], sources):
        if not isinstance(words, (list, tuple)) or not isinstance(word_tags, (list, tuple)):
            raise LunaConvertError(f"{source}: 'tokens' and 'ner_tags' must be lists (one entry a word), got "
                                   f"{type(words).__name__} and {type(word_tags).__name__}")
        if len(words) != len(word_tags):
            raise LunaConvertError(f"{source}: {len(words)} words but {len(word_tags)} tags; give one tag a word")
        if not words:
            empty += 1  # nothing to tag or score
            continue
        tokens.append([str(w) for w in words])
        tags.append(list(word_tags))
        kept_sources.append(source)
    if empty:
        logger.info("%s: skipped %d sentence(s) without words", where, empty)
    if not tokens:
        raise LunaConvertError(f"{where} has no sentences; expected words with their tags")
    ids = [[int_or_none(t) for t in row] for row in tags]
    if all(i is not None for row in ids for i in row):
        tags = ids
    else:
        tags = [[str(t) for t in row] for row in tags]
    return datasets.Dataset.from_dict({"tokens": tokens, "label": tags, "source": kept_sources})


def datasets_token_split(ds, where: str):
    """A ``datasets`` split with word and tag lists as :func:`token_dataset` returns it; a tag column of
    ``ClassLabel`` ids (the hub's conll2003) becomes tag names, so they can be matched to the model's."""
    columns = {c: list(ds[c]) for c in ds.column_names}
    for name, values in columns.items():
        inner = getattr(ds.features[name], "feature", None)  # a sequence feature's element type
        names = getattr(inner, "names", None)  # a ClassLabel's names
        if names:
            columns[name] = [[names[i] for i in row] for row in values]
    return token_dataset(columns, where)


def load_token_split(task: TaskSpec, split: str, data_dir: Path | None):
    """``split`` of a token task from the files in ``data_dir``: ``<split>.txt`` / ``.conll`` (CoNLL) or
    ``.jsonl`` / ``.json`` / ``.parquet`` tables with ``tokens`` and ``ner_tags``."""
    if data_dir is None:
        raise LunaConvertError(f"task {task.name!r} has no built-in dataset; pass --data-dir with CoNLL files "
                               "(train.txt, dev.txt) or JSON lines with 'tokens' and 'ner_tags', or hf:<dataset id>")
    path = find_split_file(task, data_dir, split, TOKEN_FILE_EXTENSIONS)
    if path.suffix.lower() in CONLL_EXTENSIONS:
        cols = read_conll(path)
        return token_dataset(cols, path.name, sources=cols.pop("source"))
    return token_dataset(read_table(path), path.name)
