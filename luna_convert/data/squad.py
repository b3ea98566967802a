"""Extractive question answering data: SQuAD v1.1 JSON files (articles, paragraphs, questions) and tables or
``datasets`` splits with ``question``, ``context`` and ``answers`` per example (the hub's squad layout:
``answers`` is ``{"text": [...], "answer_start": [...]}``; a list of ``{"text", "answer_start"}`` works too)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import LunaConvertError
from ..tasks import TaskSpec
from .labels import int_or_none, is_missing
from .tables import find_split_file, read_table, read_text

QA_FILE_EXTENSIONS = (".json", ".jsonl", ".parquet")
SQUAD_LAYOUT = ('SQuAD v1.1 JSON ({"data": [{"paragraphs": [{"context", "qas": [{"id", "question", '
                '"answers": [{"text", "answer_start"}]}]}]}]}) or JSON lines with question, context and answers')


def is_squad_json(obj) -> bool:
    """Whether a parsed JSON file is SQuAD's nested layout (a list of articles with paragraphs under ``data``)."""
    return (isinstance(obj, dict) and isinstance(obj.get("data"), list)
            and all(isinstance(a, dict) and "paragraphs" in a for a in obj["data"]))


def flatten_squad(obj: dict, where: str) -> dict[str, list]:
    """Columns ``id``, ``question``, ``context``, ``answers`` (a list of ``{"text", "answer_start"}``) and
    ``source`` (for messages) of a parsed SQuAD JSON file, one row a question."""
    cols: dict[str, list] = {"id": [], "question": [], "context": [], "answers": [], "source": []}
    for a, article in enumerate(obj["data"]):
        paragraphs = article.get("paragraphs")
        if not isinstance(paragraphs, list):
            raise LunaConvertError(f"{where}: article {a + 1} has no list of 'paragraphs'; expected {SQUAD_LAYOUT}")
        for p, paragraph in enumerate(paragraphs):
            if not isinstance(paragraph, dict) or not isinstance(paragraph.get("qas"), list):
                raise LunaConvertError(f"{where}: article {a + 1} paragraph {p + 1} has no list of 'qas'; "
                                       f"expected {SQUAD_LAYOUT}")
            for q, qa in enumerate(paragraph["qas"]):
                qa = qa if isinstance(qa, dict) else {}
                qid = qa.get("id")
                cols["id"].append(qid)
                cols["question"].append(qa.get("question"))
                cols["context"].append(paragraph.get("context"))
                cols["answers"].append(qa.get("answers"))
                cols["source"].append(f"{where} question {qid!r}" if qid is not None
                                      else f"{where} article {a + 1} paragraph {p + 1} question {q + 1}")
    return cols


def _answer_list(answers, source: str) -> list[tuple[str, int]]:
    """``(text, answer_start)`` pairs from either answers layout."""
    if isinstance(answers, dict) and "text" in answers:  # the hub's squad: parallel lists
        texts, starts = answers.get("text"), answers.get("answer_start")
        if not isinstance(texts, (list, tuple)) or not isinstance(starts, (list, tuple)) or len(texts) != len(starts):
            raise LunaConvertError(f"{source}: 'answers' must hold lists 'text' and 'answer_start' of the same length")
        pairs = list(zip(texts, starts))
    elif isinstance(answers, (list, tuple)):
        if not all(isinstance(x, dict) for x in answers):
            raise LunaConvertError(f"{source}: 'answers' must be a list of {{\"text\", \"answer_start\"}} objects")
        pairs = [(x.get("text"), x.get("answer_start")) for x in answers]
    else:
        raise LunaConvertError(f"{source}: missing 'answers'; expected a list of {{\"text\", \"answer_start\"}}")
    return pairs


def qa_dataset(cols: dict[str, list], where: str):
    """A ``datasets.Dataset`` of ``id``, ``question``, ``context``, ``answers`` (their texts), ``answer_starts``
    (their character offsets in the context) and ``source`` from table columns, every answer checked to
    stand at its ``answer_start`` in the context; ``where`` names the data in messages."""
    import datasets

    n = max((len(v) for v in cols.values()), default=0)
    if n == 0:
        raise LunaConvertError(f"{where} has no questions; expected {SQUAD_LAYOUT}")
    for column in ("question", "context", "answers"):
        if column not in cols:
            raise LunaConvertError(f"{where} has columns {list(cols)} but no {column!r}; expected {SQUAD_LAYOUT}")
    sources = cols.get("source") or [f"{where} example {i + 1}" for i in range(n)]
    ids = cols.get("id") or [None] * n
    out: dict[str, list] = {"id": [], "question": [], "context": [], "answers": [], "answer_starts": [], "source": []}
    for i in range(n):
        source, question, context = sources[i], cols["question"][i], cols["context"][i]
        for name, value in (("question", question), ("context", context)):
            if is_missing(value) or not isinstance(value, str):
                raise LunaConvertError(f"{source}: missing {name!r} (a non-empty string); expected {SQUAD_LAYOUT}")
        pairs = _answer_list(cols["answers"][i], source)
        if not pairs:
            raise LunaConvertError(f"{source}: no answers; every question needs one (SQuAD v2's unanswerable "
                                   "questions are not supported)")
        texts, starts = [], []
        for text, start in pairs:
            begin = int_or_none(start)
            if not isinstance(text, str) or not text or begin is None:
                raise LunaConvertError(f"{source}: an answer needs a non-empty 'text' and a whole-number "
                                       f"'answer_start', got {text!r} at {start!r}")
            found = context[begin:begin + len(text)]
            if found != text:
                raise LunaConvertError(f"{source}: answer {text[:40]!r} is not at answer_start {begin} of the context "
                                       f"(which reads {found[:40]!r} there); answer_start is the answer's character "
                                       "offset in the context")
            texts.append(text)
            starts.append(begin)
        out["id"].append(str(ids[i]) if ids[i] is not None else str(i))
        out["question"].append(question)
        out["context"].append(context)
        out["answers"].append(texts)
        out["answer_starts"].append(starts)
        out["source"].append(source)
    return datasets.Dataset.from_dict(out)


def datasets_qa_split(ds, where: str):
    """A ``datasets`` split with the hub's squad columns as :func:`qa_dataset` returns it."""
    return qa_dataset({c: list(ds[c]) for c in ds.column_names}, where)


def read_qa_file(path: Path):
    """One QA file: SQuAD v1.1 JSON, or a table (JSON lines, a JSON list, parquet) with question, context, answers."""
    if path.suffix.lower() == ".json":
        text = read_text(path)
        try:
            obj = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            obj = None  # maybe JSON lines named .json: read as a table
        if is_squad_json(obj):
            return qa_dataset(flatten_squad(obj, path.name), path.name)
    return qa_dataset(read_table(path), path.name)


def load_qa_split(task: TaskSpec, split: str, data_dir: Path | None):
    """``split`` of a QA task from the files in ``data_dir``: ``<split>.json`` (SQuAD v1.1) or ``.jsonl`` /
    ``.parquet`` tables with question, context and answers."""
    if data_dir is None:
        raise LunaConvertError(f"task {task.name!r} has no built-in dataset; pass --data-dir with SQuAD files "
                               "(train.json, dev.json) or JSON lines, or hf:rajpurkar/squad")
    return read_qa_file(find_split_file(task, data_dir, split, QA_FILE_EXTENSIONS))
