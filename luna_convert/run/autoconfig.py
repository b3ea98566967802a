"""Your own checkpoint on your own data, without a recipe.

``luna-convert run --model M --data-dir D --method X`` with no recipe (or with one of the generic
tasks ``text-classification``, ``text-pair-classification``, ``text-regression``,
``text-pair-regression``, ``image-classification``) comes here before anything is trained:
:func:`resolve_own_data` looks at the loaded model and the data and fills in

* the task type: image model -> image classification; text model with one output (or
  ``problem_type="regression"``) -> regression, else classification; two text columns -> a pair task;
* the splits: train = the file/folder/split called ``train``; eval = ``validation``/``dev``/``val``/
  ``valid``, else ``test`` (or ``--train-split`` / ``--eval-split``);
* the text, text-pair and label columns (detected by name, or ``--text-column`` /
  ``--text-pair-column`` / ``--label-column``);
* how data labels map to the model's classes (names matched to ``id2label``; clear errors when
  they cannot be matched or the number of classes differs);
* the headline metric (accuracy for classification, Pearson for regression; ``--metric``);
* training defaults for the settings the user did not give (:func:`choose_hyperparameters`,
  :func:`choose_max_length`).

What it chose and why goes to ``config.resolved`` (saved in config.json and results.json) and is
printed before training. :func:`task_for` rebuilds the run's task from a config (also on resume and
``luna-convert eval``).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable, Sequence

from ..errors import LunaConvertError
from ..task_kinds import kind_of
from ..tasks import TaskSpec, get_task
from .. import data
from ..data import (TABLE_EXTENSIONS, canonical_split, model_label_names, normalize_label_name,
                    short_list)
from .config import RunConfig

__all__ = [
    "OWN_DATA_TASKS", "AUTO_KEYS", "needs_resolution", "mark_auto", "task_for", "infer_task",
    "detect_columns", "choose_hyperparameters", "choose_max_length", "model_position_limit",
    "check_positions", "resolve_own_data", "describe",
]

OWN_DATA_TASKS = ("text-classification", "text-pair-classification", "text-regression", "text-pair-regression",
                  "image-classification")
# Settings chosen from the model and data size when the user does not give them (CLI runs without a recipe).
AUTO_KEYS = ("train.lr", "train.batch_size", "train.epochs", "train.max_length")

# The defaults rule (documented in README.md, "Default training settings").
LARGE_MODEL_PARAMS = 100_000_000  # >= this many parameters: the smaller learning rate
LR_LARGE, LR_SMALL = 2e-5, 5e-5
BATCH_TEXT, BATCH_IMAGE = 32, 64
LARGE_DATA = 10_000  # >= this many training examples: 3 epochs
BASE_EPOCHS, MAX_EPOCHS = 3, 10
MIN_STEPS = 300  # smaller data: enough epochs (3..10) to reach about this many optimizer steps
MAX_STEPS = 20_000  # large data: fewer (fractional) epochs past this many steps
MAX_LENGTH_CAP = 512
LENGTH_PERCENTILE = 99
LENGTH_SAMPLE = 10_000  # training texts tokenized to measure lengths

TEXT_NAMES = ("text", "sentence", "content", "review", "document", "body", "question", "query", "premise",
              "sentence1", "question1", "text_a", "title")
PAIR_NAMES = (("sentence1", "sentence2"), ("premise", "hypothesis"), ("question1", "question2"),
              ("question", "sentence"), ("question", "passage"), ("question", "context"), ("text_a", "text_b"),
              ("text", "text_pair"), ("text1", "text2"), ("query", "document"))
LABEL_NAMES = ("label", "labels", "gold_label", "target", "class", "score", "category", "sentiment", "is_duplicate",
               "rating", "stars", "fine_label", "y")
METRIC_ALIASES = {"spearman": "spearmanr", "mcc": "matthews_correlation", "matthews": "matthews_correlation",
                  "f1": "macro_f1", "acc": "accuracy", "top5": "top5_accuracy", "mean_squared_error": "mse"}


# ------------------------------------------------------------------ config glue
def needs_resolution(config: RunConfig) -> bool:
    """True for runs on the user's own data that have not been resolved yet (no task, or a generic one)."""
    if config.resolved:
        return False
    return config.task is None or get_task(config.task).name in OWN_DATA_TASKS


def mark_auto(config: RunConfig, given: dict) -> RunConfig:
    """Let :func:`resolve_own_data` choose every setting of :data:`AUTO_KEYS` that is not in ``given``;
    name an own-data run after its model and data folders (``outputs/<model>-<data>-<method>-<time>``)."""
    config.auto = [k for k in AUTO_KEYS if given.get(k) is None]
    if config.name is None and config.model and config.data_dir and needs_resolution(config):
        parts = [Path(str(config.model).rstrip("/")).name, Path(str(config.data_dir).rstrip("/")).name]
        config.name = "-".join("".join(ch if ch.isalnum() or ch in "._" else "-" for ch in p) for p in parts)
    return config


def _spec_to_dict(spec: TaskSpec) -> dict:
    return {f.name: (list(v) if isinstance(v, tuple) else v)
            for f in dataclasses.fields(spec) for v in [getattr(spec, f.name)]}


def _spec_from_dict(d: dict) -> TaskSpec:
    fields = {f.name for f in dataclasses.fields(TaskSpec)}
    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in fields}
    return TaskSpec(**kw)


def resolve_metric(spec: TaskSpec, metric: str | None, num_classes: int | None = None) -> str:
    """The headline metric key: ``metric`` (aliases accepted) if the task computes it, else the task's."""

    if not metric:
        return spec.headline
    names = kind_of(spec).metric_choices(spec, num_classes)
    key = str(metric).strip().lower().replace("-", "_")
    if key not in names:
        key = METRIC_ALIASES.get(key, key)
    if key not in names:
        raise LunaConvertError(f"--metric {metric} is not computed for task {spec.name!r}; choose one of "
                               f"{', '.join(names)}")
    return key


def task_for(config: RunConfig) -> TaskSpec:
    """The run's task: the resolved own-data task if there is one, else the named task; with
    ``train_split`` / ``metric`` from the config applied."""
    resolved = config.resolved or {}
    spec = _spec_from_dict(resolved["task_spec"]) if resolved.get("task_spec") else get_task(config.task)
    if config.train_split:
        spec = dataclasses.replace(spec, train_split=config.train_split)
    if config.metric:
        spec = dataclasses.replace(spec, headline=resolve_metric(spec, config.metric))
    return spec


# ------------------------------------------------------------------ inference rules
def infer_task(kind: str, num_labels: int, problem_type: str | None = None, pair: bool = False) -> str:
    """Generic task name for a model: image vs text, regression (one output or problem_type) vs
    classification, one text vs a pair of texts."""
    if kind == "image":
        return "image-classification"
    if problem_type == "multi_label_classification":
        raise LunaConvertError("multi-label classifiers (problem_type=multi_label_classification) are not supported; "
                               "convert a single-label classifier or a regression model")
    regression = num_labels == 1 or problem_type == "regression"
    return f"text-{'pair-' if pair else ''}{'regression' if regression else 'classification'}"


def _check_requested(requested: TaskSpec, kind: str, num_labels: int, problem_type: str | None, model: str) -> None:
    if requested.kind != kind:
        raise LunaConvertError(f"--task {requested.name} is for {requested.kind} models but {model} is an {kind} "
                               f"classifier; drop --task to infer it")
    if requested.is_regression and num_labels != 1:
        raise LunaConvertError(f"--task {requested.name} needs a model with one output but {model} predicts "
                               f"{num_labels} classes; use --task text-classification or drop --task")
    if requested.kind == "text" and not requested.is_regression and (num_labels == 1 or problem_type == "regression"):
        raise LunaConvertError(f"{model} is a regression model (one output) but --task {requested.name} is "
                               "classification; use --task text-regression or drop --task")


def _is_number(v) -> bool:
    if isinstance(v, bool):
        return True
    if isinstance(v, (int, float)):
        return True
    try:
        float(str(v).strip())
        return True
    except ValueError:
        return False


def _text_like(values: Sequence) -> bool:
    present = [v for v in values[:2000] if v is not None and str(v).strip() != ""]
    if not present or any(isinstance(v, (dict, list, bytes)) for v in present[:50]):
        return False
    return sum(not _is_number(v) for v in present) >= len(present) / 2


def _find(columns, name: str) -> str | None:
    if name in columns:
        return name
    lower = {c.lower(): c for c in columns}
    return lower.get(name.lower())


def detect_columns(columns: dict[str, Sequence], text: str | None = None, pair: str | None = None,
                   label: str | None = None, where: str = "the data",
                   want_pair: bool | None = None) -> tuple[str, str | None, str, str]:
    """(text column, text-pair column or None, label column, why) from column names and values.

    Named columns must exist. Otherwise: label = the first of :data:`LABEL_NAMES`; texts = a known pair
    (:data:`PAIR_NAMES`), else a known text name (:data:`TEXT_NAMES`), else the text column with the
    longest values. ``want_pair`` True/False forces a pair / a single text (from ``--task``).
    """
    names = list(columns)
    shown = ", ".join(names) or "none"
    for value, flag in ((text, "--text-column"), (pair, "--text-pair-column"), (label, "--label-column")):
        if value is not None and _find(names, value) is None:
            raise LunaConvertError(f"column {value!r} ({flag}) is not in {where}; its columns are {shown}")
    why = []
    if label is not None:
        label, why = _find(names, label), why + ["label named"]
    else:
        label = next((_find(names, c) for c in LABEL_NAMES if _find(names, c)), None)
        if label is None:
            raise LunaConvertError(f"no label column in {where} (columns: {shown}); name it with --label-column")
        why.append("label by name")
    if pair is not None and want_pair is False:
        raise LunaConvertError("--text-pair-column was given but the task takes a single text; "
                               "drop it or use a text-pair task")
    if text is not None:
        text = _find(names, text)
        if pair is not None:
            pair = _find(names, pair)
        elif want_pair is not False:
            partner = next((b for a, b in PAIR_NAMES if a.lower() == text.lower() and _find(names, b)), None)
            pair = _find(names, partner) if partner else None
        why.append("text named")
    else:
        found = None
        if want_pair is not False and pair is None:
            found = next(((_find(names, a), _find(names, b)) for a, b in PAIR_NAMES
                          if _find(names, a) and _find(names, b) and label not in (_find(names, a), _find(names, b))),
                         None)
        if found:
            text, pair = found
            why.append("text pair by name")
        else:
            taken = {label, _find(names, pair) if pair else None}
            text = next((_find(names, c) for c in TEXT_NAMES if _find(names, c) and _find(names, c) not in taken),
                        None)
            if text is not None:
                why.append("text by name")
            else:
                candidates = [c for c in names if c not in taken and _text_like(list(columns[c]))]
                if not candidates:
                    raise LunaConvertError(f"no text column in {where} (columns: {shown}); name it with --text-column")
                text = max(candidates, key=lambda c: sum(len(str(v or "")) for v in list(columns[c])[:2000]))
                why.append("text = the column with the longest values")
            if pair is not None:
                pair = _find(names, pair)
    if want_pair and pair is None:
        raise LunaConvertError(f"the task needs two text columns but only {text!r} was found in {where} "
                               f"(columns: {shown}); name the second with --text-pair-column")
    if label in (text, pair):
        raise LunaConvertError(f"column {label!r} cannot be both a text and the label column; "
                               "name them with --text-column / --label-column")
    if pair == text:
        raise LunaConvertError(f"the text and text-pair columns are both {text!r}; name another with --text-pair-column")
    return text, pair, label, ", ".join(why)


def choose_hyperparameters(num_params: int, num_train: int, kind: str) -> dict[str, tuple[object, str]]:
    """{setting: (value, why)} for ``train.lr``, ``train.batch_size`` and ``train.epochs``."""
    lr = LR_LARGE if num_params >= LARGE_MODEL_PARAMS else LR_SMALL
    size = f"{_count(num_params)} parameters"
    out: dict[str, tuple[object, str]] = {
        "train.lr": (lr, f"{size} {'>=' if lr == LR_LARGE else '<'} {LARGE_MODEL_PARAMS // 1_000_000}M"),
    }
    base = BATCH_IMAGE if kind == "image" else BATCH_TEXT
    batch = max(1, min(base, num_train))
    out["train.batch_size"] = (batch, f"{kind} default" + (f" {base}, capped at {num_train} examples" if batch < base else ""))
    per_epoch = max(1, math.ceil(num_train / batch))
    if num_train >= LARGE_DATA:
        epochs, why = float(BASE_EPOCHS), f"{num_train:,} examples >= {LARGE_DATA:,}"
    else:
        epochs = float(min(MAX_EPOCHS, max(BASE_EPOCHS, math.ceil(MIN_STEPS / per_epoch))))
        why = f"{num_train:,} examples < {LARGE_DATA:,}: {BASE_EPOCHS}-{MAX_EPOCHS} epochs toward {MIN_STEPS} steps"
    if epochs * per_epoch > MAX_STEPS:
        epochs = round(MAX_STEPS / per_epoch, 2)
        why += f", capped at {MAX_STEPS:,} steps"
    out["train.epochs"] = (epochs, f"{why}; {math.ceil(epochs * per_epoch):,} steps")
    return out


def _percentile(values: Sequence[int], q: float) -> int:
    s = sorted(values)
    if not s:
        return 0
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def choose_max_length(lengths: Sequence[int], limit: int | None) -> tuple[int, str]:
    """Tokens per example: the 99th percentile of the training lengths rounded up to a multiple of 8,
    between 16 and min(512, the model's positions)."""
    cap = min(MAX_LENGTH_CAP, limit) if limit else MAX_LENGTH_CAP
    p = _percentile(lengths, LENGTH_PERCENTILE)
    value = min(cap, max(16, 8 * math.ceil(p / 8)))
    return value, f"{LENGTH_PERCENTILE}th percentile {p} tokens, rounded up to 8, <= {cap}"


def model_position_limit(loaded) -> int | None:
    """Input positions the model was trained with (``max_position_embeddings``; RoBERTa-style
    models lose the padding offset), or None when it has no such limit."""
    config = getattr(loaded.model, "config", None)
    n = getattr(config, "max_position_embeddings", None)
    if not isinstance(n, int) or n <= 0:
        return None
    if getattr(config, "model_type", "") in ("roberta", "xlm-roberta", "camembert", "longformer", "data2vec-text"):
        n -= (getattr(config, "pad_token_id", 1) or 1) + 1
    return n


def check_positions(loaded, tokens: int, max_length: int | None = None) -> None:
    """A clear error when inputs of ``tokens`` tokens need more positions than the model has."""
    limit = model_position_limit(loaded)
    if limit is not None and tokens > limit:
        asked = f"--max-length {max_length}" if max_length else f"inputs of {tokens} tokens"
        raise LunaConvertError(
            f"{asked} needs {tokens} positions but {loaded.source or 'the model'} was trained with {limit} "
            f"(config.max_position_embeddings); converting to linear attention does not add positions: "
            f"use --max-length {limit} or less"
        )


# ------------------------------------------------------------------ splits
def _available_splits(data_dir, kind: str) -> tuple[list[str], str]:
    if data.datasets_source(data_dir) is not None:
        dd = data.load_datasets_dict(data_dir)
        what = "hub dataset" if data.datasets_source(data_dir) == "hub" else "save_to_disk folder"
        return list(dd), what
    path = Path(data_dir).expanduser()
    if not path.exists():
        raise LunaConvertError(f"data folder {path} does not exist; check --data-dir (a hub dataset is written "
                               "hf:<dataset id>)")
    if not path.is_dir():
        raise LunaConvertError(f"--data-dir {path} is a file; pass the folder that holds the split files")
    folders = sorted(p.name for p in path.iterdir() if p.is_dir() and any(q.is_dir() for q in p.iterdir()))
    files = sorted({p.stem for p in path.iterdir() if p.is_file() and p.suffix.lower() in data.TABLE_EXTENSIONS})
    if kind == "image":
        if not folders:
            raise LunaConvertError(f"{path} is not an ImageFolder: an image model needs {path}/train/<class>/<image> "
                                   "folders, a save_to_disk folder or hf:<id> with an image column")
        return folders, "ImageFolder"
    if not files:
        raise LunaConvertError(f"no data files in {path}: expected train and dev/validation files ending in "
                               f"{', '.join(data.TABLE_EXTENSIONS)}, a save_to_disk folder or hf:<id>")
    return files, "files"


def _pick_split(names: list[str], wanted: str | None, role: str, where: str, skip: str | None = None) -> str:
    flag = "--train-split" if role == "train" else "--eval-split"
    if wanted:
        w = str(wanted)
        if Path(w).suffix.lower() in TABLE_EXTENSIONS and Path(w).stem in names:
            w = Path(w).stem
        if w in names or any(canonical_split(n) == canonical_split(w) for n in names):
            return w
        raise LunaConvertError(f"no split {wanted!r} ({flag}) in {where}; found: {', '.join(names) or 'nothing'}")
    order = ("train",) if role == "train" else ("validation", "dev", "val", "valid", "test")
    for cand in order:
        hit = next((n for n in names if n.lower() == cand and n != skip), None)
        if hit:
            return hit
    raise LunaConvertError(f"no {'train' if role == 'train' else 'evaluation (validation/dev/test)'} split in {where}; "
                           f"found: {', '.join(names) or 'nothing'}; name one with {flag}")


def _raw_columns(data_dir, split: str, spec: TaskSpec, limit: int = 5000) -> tuple[dict[str, list], dict, str]:
    """A sample of a text split's raw columns, its ClassLabel names per column, and its name for messages."""

    if data.datasets_source(data_dir) is not None:
        import datasets

        dd = data.load_datasets_dict(data_dir)
        name = data.datasets_split_name(dd, split, str(data_dir))
        ds = dd[name]
        sample = ds.select(range(min(limit, len(ds))))
        keep = [c for c, f in ds.features.items() if isinstance(f, (datasets.Value, datasets.ClassLabel))]
        cols = {c: list(sample[c]) for c in keep}
        classes = {c: list(f.names) for c, f in ds.features.items() if isinstance(f, datasets.ClassLabel)}
        return cols, classes, f"{data_dir} split {name!r}"
    path = data.find_split_file(spec, Path(data_dir).expanduser(), split)
    cols = data.read_table(path)
    return {k: v[:limit] for k, v in cols.items()}, {}, path.name


# ------------------------------------------------------------------ the resolver
def resolve_own_data(config: RunConfig, loaded, say: Callable[[str], None] | None = None) -> dict:
    """Infer task, splits, columns, labels, metric and unset training settings for ``loaded`` on
    ``config.data_dir``. Updates ``config`` (``task``, ``train.*``, ``resolved``) and returns
    ``config.resolved``. Raises :class:`LunaConvertError` with a one-line message on data the
    model cannot use (missing/wrong columns, unmatched labels, empty splits, too many positions)."""

    data_dir = config.data_dir
    if not data_dir:
        raise LunaConvertError("your own data needs --data-dir: a folder of train/dev csv, tsv, jsonl or parquet files, "
                               "an ImageFolder, a save_to_disk folder, or hf:<dataset id>")
    model_name = config.model or loaded.source
    kind, num_labels = loaded.kind, loaded.num_labels
    mconf = getattr(loaded.model, "config", None)
    problem_type = getattr(mconf, "problem_type", None)
    requested = get_task(config.task) if config.task else None
    if requested is not None:
        _check_requested(requested, kind, num_labels, problem_type, model_name)
    t = config.train
    seed = config.seed
    columns: dict = {}
    labels: dict = {}

    names, source = _available_splits(data_dir, kind)
    where = f"{source} {data_dir}"
    train_split = _pick_split(names, config.train_split, "train", where)
    eval_split = _pick_split(names, config.eval_split, "eval", where, skip=train_split)

    if kind == "image":
        name = "image-classification"
        task_why = "image model"
        spec = dataclasses.replace(get_task(name), num_labels=num_labels, train_split=train_split,
                                   eval_split=eval_split)
        if data.datasets_source(data_dir) is not None and config.columns.label:
            spec = dataclasses.replace(spec, label_column=config.columns.label)
        train_ds = kind_of(spec).load_split(spec, train_split, data_dir, max_examples=t.max_train_examples, seed=seed)
        eval_ds = kind_of(spec).load_split(spec, eval_split, data_dir, max_examples=t.max_eval_examples, seed=seed)
        classes = list(getattr(train_ds, "classes", []) or [])
        model_names = data.model_label_names(loaded.id2label, num_labels)
        if len(classes) != num_labels:
            raise LunaConvertError(f"the data has {len(classes)} classes ({short_list(classes)}) but {model_name} predicts "
                                   f"{num_labels}; use the model finetuned on these classes")
        matched = model_names is not None and all(
            data.normalize_label_name(c) in {data.normalize_label_name(n) for n in model_names} for c in classes)
        labels = {"classes": classes, "model_classes": model_names,
                  "mapping": "class names matched to the model's id2label" if matched else
                  "class i = the i-th class name in sorted order" + (" (names do not match id2label)"
                                                                     if model_names else "")}
        if hasattr(train_ds, "label_column"):
            columns = {"image": train_ds.image_column, "label": train_ds.label_column}
    else:
        cols_cfg = config.columns
        generic = get_task("text-classification")
        raw, class_names, raw_where = _raw_columns(data_dir, train_split, generic)
        want_pair = requested.is_pair if requested is not None else None
        text, pair, label, col_why = detect_columns(raw, cols_cfg.text, cols_cfg.text_pair, cols_cfg.label, raw_where,
                                                    want_pair=want_pair)
        if requested is not None:
            name, task_why = requested.name, "--task"
        else:
            name = infer_task(kind, num_labels, problem_type, pair is not None)
            task_why = (("one model output" if num_labels == 1 else f"problem_type={problem_type}")
                        if "regression" in name else f"{num_labels} model classes")
            task_why += ", two text columns" if pair else ", one text column"
        base = get_task(name)
        label_names = _class_label_names(class_names.get(label), loaded, model_name) if not base.is_regression else None
        spec = dataclasses.replace(base, text_columns=(text, pair) if pair else (text,), label_column=label,
                                   num_labels=num_labels, label_names=label_names, train_split=train_split,
                                   eval_split=eval_split)
        columns = {"text": text, "text_pair": pair, "label": label, "why": col_why}
        train_ds = kind_of(spec).load_split(spec, train_split, data_dir, max_examples=t.max_train_examples, seed=seed)
        eval_ds = kind_of(spec).load_split(spec, eval_split, data_dir, max_examples=t.max_eval_examples, seed=seed)
        labels = _check_text_labels(spec, train_ds, eval_ds, loaded, model_name, eval_split)

    n_train, n_eval = len(train_ds), len(eval_ds)
    headline = resolve_metric(spec, config.metric, num_labels)
    spec = dataclasses.replace(spec, headline=headline)

    num_params = sum(p.numel() for p in loaded.model.parameters())
    limit = model_position_limit(loaded) if kind == "text" else None
    hparams, length_info = _resolve_settings(config, spec, loaded, train_ds, num_params, limit)

    resolved = {
        "task": spec.name,
        "task_why": task_why,
        "task_spec": _spec_to_dict(spec),
        "data": {"source": source, "data_dir": str(data_dir), "train_split": train_split, "eval_split": eval_split,
                 "train_examples": n_train, "eval_examples": n_eval},
        "columns": columns,
        "labels": labels,
        "metric": {"headline": headline, "all": list(kind_of(spec).metric_names(spec, num_labels)),
                   "why": "--metric" if config.metric else f"{'regression' if spec.is_regression else 'classification'} default"},
        "model": {"kind": kind, "parameters": num_params, "num_labels": num_labels, "max_positions": limit},
        "max_length": length_info,
        "hyperparameters": hparams,
    }
    config.task = spec.name
    config.resolved = resolved
    if say is not None:
        from rich.markup import escape

        for line in describe(resolved):
            say(escape(line))
    return resolved


def _resolve_settings(config: RunConfig, spec, loaded, train_ds, num_params: int,
                      limit: int | None) -> tuple[dict[str, dict], dict | None]:
    """The training settings left to ``auto`` chosen for this model and data (set in ``config``), each with why,
    and for text the max length with the token lengths it was chosen from."""
    t, kind, auto = config.train, loaded.kind, set(config.auto or ())
    hparams: dict[str, dict] = {}
    for key, (value, why) in choose_hyperparameters(num_params, len(train_ds), kind).items():
        if key in auto:
            config.set_setting(key, value)
            hparams[key] = {"value": value, "why": why}
        else:
            hparams[key] = {"value": config.setting(key), "why": "given"}
    length_info = None
    if kind == "text":
        lengths, sampled = _token_lengths(train_ds, spec, loaded.tokenizer, config.seed)
        if "train.max_length" in auto:
            value, why = choose_max_length(lengths, limit)
            t.max_length = value
        else:
            value, why = t.max_length, "given"
            check_positions(loaded, value, value)
        cut = sum(n > value for n in lengths)
        hparams["train.max_length"] = {"value": value, "why": why}
        length_info = {"max_length": value, "percentile_99": _percentile(lengths, 99), "longest": max(lengths, default=0),
                       "train_examples_cut": cut, "measured_on": sampled, "model_positions": limit}
    if t.max_steps is not None:
        hparams["train.max_steps"] = {"value": t.max_steps,
                                      "why": "given, overrides epochs" if t.max_steps else "given: no finetuning"}
    return hparams, length_info


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1_000_000 else f"{n:,}"


def _class_label_names(names: list[str] | None, loaded, model_name: str) -> tuple[str, ...] | None:
    """A ClassLabel's names when they name the model's classes (so ids are permuted to the model's
    order); None when the model's names are generic (ids kept); an error when both name classes but differ."""

    if not names:
        return None
    model_names = model_label_names(loaded.id2label, loaded.num_labels)
    if model_names is None:
        return None
    index = {normalize_label_name(n) for n in model_names}
    missing = [n for n in names if normalize_label_name(n) not in index]
    if missing:
        raise LunaConvertError(f"data classes {short_list(missing)} are not among {model_name}'s id2label "
                               f"({short_list(model_names)}); use the model finetuned on this data")
    return tuple(names)


def _check_text_labels(spec: TaskSpec, train_ds, eval_ds, loaded, model_name: str, eval_split: str) -> dict:
    model_names = model_label_names(loaded.id2label, loaded.num_labels)
    if spec.is_regression:
        values = [float(y) for y in train_ds["label"]]
        return {"mapping": "regression targets", "range": [min(values), max(values)]}
    raw = sorted({str(y) for y in train_ds["label"]})
    string_labels = any(isinstance(y, str) for y in train_ds["label"])
    train_ds = kind_of(spec).align_labels(train_ds, spec, loaded.id2label, loaded.num_labels)
    eval_aligned = kind_of(spec).align_labels(eval_ds, spec, loaded.id2label, loaded.num_labels)
    present = sorted({int(y) for y in train_ds["label"] if int(y) >= 0})
    if len(present) != loaded.num_labels:
        raise LunaConvertError(f"the train split has {len(present)} classes ({short_list(raw)}) but {model_name} "
                               f"predicts {loaded.num_labels}; use the model finetuned on this data or check "
                               "--label-column")
    if not any(int(y) >= 0 for y in eval_aligned["label"]):
        raise LunaConvertError(f"the {eval_split!r} split has no labels; name a labelled split with --eval-split")
    if string_labels or spec.label_names:
        mapping = "label names matched to the model's id2label"
    else:
        mapping = "class ids used as they are"
    return {"classes": raw, "model_classes": model_names, "mapping": mapping}


def _token_lengths(dataset, spec: TaskSpec, tokenizer, seed: int) -> tuple[list[int], int]:
    import random

    n = len(dataset)
    idx = list(range(n))
    if n > LENGTH_SAMPLE:
        idx = sorted(random.Random(seed).sample(idx, LENGTH_SAMPLE))
        dataset = dataset.select(idx)
    cols = [["" if v is None else str(v) for v in dataset[c]] for c in spec.text_columns]
    enc = tokenizer(*cols, truncation=False, padding=False, verbose=False)
    return [len(ids) for ids in enc["input_ids"]], len(idx)


def describe(resolved: dict) -> list[str]:
    """The resolved settings as printable lines."""
    d, c, m = resolved["data"], resolved["columns"], resolved["model"]

    def row(label: str, text: str) -> str:
        return f"  {label:<11}{text}"

    lines = [f"own data: task {resolved['task']} ({resolved['task_why']})",
             row("data", f"{d['source']} {d['data_dir']}: train={d['train_split']} ({d['train_examples']:,} examples), "
                         f"eval={d['eval_split']} ({d['eval_examples']:,})")]
    if c:
        shown = " ".join(f"{k}={v}" for k, v in c.items() if k != "why" and v)
        lines.append(row("columns", shown + (f" ({c['why']})" if c.get("why") else "")))
    lab = resolved["labels"]
    classes = f"{short_list(lab['classes'])}: " if lab.get("classes") is not None else ""
    lines.append(row("labels", classes + lab["mapping"]))
    mt = resolved["metric"]
    others = ", ".join(k for k in mt["all"] if k != mt["headline"])
    lines.append(row("metric", f"{mt['headline']} ({mt['why']})" + (f"; also {others}" if others else "")))
    lines.append(row("model", f"{_count(m['parameters'])} parameters, {m['num_labels']} output(s)"
                              + (f", {m['max_positions']} positions" if m.get("max_positions") else "")))
    for key, h in resolved["hyperparameters"].items():
        lines.append(row(key.split(".")[-1], f"{h['value']} ({h['why']})"))
    ml = resolved.get("max_length")
    if ml:
        lines.append(row("lengths", f"longest {ml['longest']} tokens; {ml['train_examples_cut']} of "
                                    f"{ml['measured_on']:,} training examples measured will be cut to {ml['max_length']}"))
    return lines
