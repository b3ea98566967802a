"""Task metrics computed with scikit-learn / scipy, keyed like the `evaluate` GLUE metric; entity-level
F1 for token tasks (NER) computed here as conlleval / seqeval's default mode does; exact match and F1 of
extractive QA answers as the official SQuAD v1.1 evaluation script computes them; for sentence embeddings,
the Spearman correlation of pair similarities with scores, or the agreement with the teacher's embeddings.

All values are floats on a 0..1 scale (correlations in -1..1), never percent. Degenerate
inputs (constant predictions, fewer than two examples) give 0.0 for correlations, not NaN.
"""

from __future__ import annotations

import re
import string
import warnings
from collections import Counter

import numpy as np

from .errors import LunaConvertError
from .tasks import IGNORE_INDEX, TaskSpec, get_task

__all__ = ["sequence_metrics", "sequence_metric_names", "token_metrics", "span_metrics", "embedding_metrics",
           "headline_metric", "recovered_pct", "LOWER_IS_BETTER", "entity_spans", "split_tag", "TOKEN_METRICS",
           "SPAN_METRICS", "normalize_answer", "answer_f1",
           "SIMILARITY_METRICS", "AGREEMENT_METRICS", "cosine_rows", "topk_agreement"]

# Error metrics: a smaller value is a better model.
LOWER_IS_BETTER = frozenset({"mse"})

_GLUE_KEYS: dict[str, tuple[str, ...]] = {
    "cola": ("matthews_correlation",),
    "sst2": ("accuracy",),
    "mrpc": ("accuracy", "f1"),
    "stsb": ("pearson", "spearmanr"),
    "qqp": ("accuracy", "f1"),
    "mnli": ("accuracy",),
    "mnli_mismatched": ("accuracy",),
    "qnli": ("accuracy",),
    "rte": ("accuracy",),
}
TOKEN_METRICS = ("entity_f1", "entity_precision", "entity_recall", "token_accuracy")
SPAN_METRICS = ("f1", "exact_match")
# sentence embeddings: scored sentence pairs (STS-B) / any texts, against the teacher's embeddings
SIMILARITY_METRICS = ("spearmanr", "pearson")
AGREEMENT_METRICS = ("teacher_cosine", "topk_agreement")
TOP_K = 10  # neighbours compared by topk_agreement (at most n - 1)
ENTITY_PREFIXES = ("B", "I", "E", "S")  # IOB1 / IOB2 (BIO) / IOBES chunk tags, as conlleval reads them


def headline_metric(task: TaskSpec | str) -> str:
    """Metric key of the task's headline score (the one "% recovered" is computed from)."""
    return get_task(task).headline


def recovered_pct(converted: float, teacher: float, metric: str) -> float | None:
    """% of the original score kept: 100 x converted / teacher, or 100 x teacher / converted for
    an error metric (so 100 means "as good", below 100 worse, in both cases). None where undefined."""
    if metric in LOWER_IS_BETTER:
        return 100.0 * teacher / converted if converted > 0 else None
    return 100.0 * converted / teacher if teacher > 0 else None


def sequence_metric_names(task: TaskSpec | str, num_classes: int | None = None) -> tuple[str, ...]:
    """Keys that :func:`sequence_metrics` returns for ``task`` (one prediction an example: a text or an image)."""
    task = get_task(task)
    if task.name in _GLUE_KEYS:
        return _GLUE_KEYS[task.name]
    if task.kind == "image":
        n = num_classes if num_classes is not None else task.num_labels
        return ("accuracy", "top5_accuracy") if (n is None or n >= 5) else ("accuracy",)
    if task.is_regression:
        return ("pearson", "spearmanr", "mse")
    return ("accuracy", "macro_f1", "matthews_correlation")


def _correlation(kind: str, x: np.ndarray, y: np.ndarray) -> float:
    """Pearson / Spearman correlation; 0.0 where it is undefined (constant input, n < 2)."""
    if x.size < 2 or not (np.isfinite(x).all() and np.isfinite(y).all()):
        return 0.0
    if np.ptp(x) == 0 or np.ptp(y) == 0:
        return 0.0
    from scipy import stats

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "pearson":
            r = stats.pearsonr(x, y)[0]
        else:
            r = stats.spearmanr(x, y)[0]
    r = float(r)
    return r if np.isfinite(r) else 0.0


def _class_predictions(task: TaskSpec, predictions: np.ndarray) -> np.ndarray:
    if predictions.ndim == 2 and predictions.shape[1] > 1:
        return predictions.argmax(axis=1)
    if predictions.ndim == 2:  # [N, 1]: one binary logit
        return (predictions[:, 0] > 0).astype(np.int64)
    if predictions.ndim == 1:  # already class ids
        return predictions.astype(np.int64)
    raise LunaConvertError(
        f"predictions for task {task.name!r} have shape {tuple(predictions.shape)}; expected logits [N, C] or class ids [N]"
    )


def split_tag(tag: str) -> tuple[str, str]:
    """(chunk prefix, entity type) of a tag: "B-PER" -> ("B", "PER"), "O" -> ("O", "")."""
    if tag == "O":
        return "O", ""
    prefix, sep, kind = tag.partition("-")
    if not sep or prefix not in ENTITY_PREFIXES or not kind:
        raise LunaConvertError(f"tag {tag!r} is not O or B-/I-/E-/S-<type>; entity F1 reads BIO (IOB2), IOB1 or "
                               "IOBES tags: name the model's labels that way in its config.json id2label")
    return prefix, kind


def entity_spans(tags) -> set[tuple[str, int, int]]:
    """The entities ``(type, start, end)`` (end inclusive) in one sentence's tags, by conlleval's rules:
    an entity starts at B- (or S-), at I-/E- after O, after an entity's end or after another type;
    it ends before O, B-, S- or another type, and after E- or S-."""
    spans: set[tuple[str, int, int]] = set()
    start, prev_prefix, prev_kind = None, "O", ""
    for i, tag in enumerate(list(tags) + ["O"]):  # a final O closes the last entity
        prefix, kind = split_tag(tag)
        ends = prev_prefix in ("E", "S") or (prev_prefix in ("B", "I") and prefix in ("B", "S", "O")) or (
            prev_prefix != "O" and kind != prev_kind)
        if start is not None and ends:
            spans.add((prev_kind, start, i - 1))
            start = None
        begins = prefix in ("B", "S") or (prefix in ("I", "E") and (prev_prefix in ("E", "S", "O") or kind != prev_kind))
        if begins:
            start = i
        prev_prefix, prev_kind = prefix, kind
    return spans


def token_metrics(task: TaskSpec, predictions, labels) -> dict[str, float]:
    """Entity-level micro precision / recall / F1 over the labelled positions of each sentence (a word's
    first sub-token), and the accuracy of those positions' tags. ``predictions``: logits ``[N, S, C]`` or tag
    ids ``[N, S]``; labels ``[N, S]``, ``IGNORE_INDEX`` where nothing is scored; tag names from
    ``task.label_names``."""
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    if labels.ndim != 2:
        raise LunaConvertError(f"labels for token task {task.name!r} have shape {tuple(labels.shape)}; expected [N, S]")
    if predictions.ndim == 3:
        predictions = predictions.argmax(axis=-1)
    if predictions.shape != labels.shape:
        raise LunaConvertError(f"predictions for token task {task.name!r} have shape {tuple(predictions.shape)}; "
                               f"expected logits [N, S, C] or tag ids [N, S] matching the labels {tuple(labels.shape)}")
    names = task.label_names
    if not names:
        raise LunaConvertError(f"task {task.name!r} has no tag names to find entities with; the model's id2label "
                               "must name its tags (O, B-PER, ...)")
    labels, predictions = labels.astype(np.int64), predictions.astype(np.int64)
    keep = labels != IGNORE_INDEX
    if not keep.any():
        raise LunaConvertError(f"no labelled tokens to score for task {task.name!r}; check the evaluation split")
    correct = predicted = gold = 0
    for row_labels, row_preds, row_keep in zip(labels, predictions, keep):
        gold_spans = entity_spans([names[i] for i in row_labels[row_keep]])
        pred_spans = entity_spans([names[i] for i in row_preds[row_keep]])
        correct += len(gold_spans & pred_spans)
        predicted += len(pred_spans)
        gold += len(gold_spans)
    precision = correct / predicted if predicted else 0.0
    recall = correct / gold if gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"entity_f1": f1, "entity_precision": precision, "entity_recall": recall,
            "token_accuracy": float(np.mean(predictions[keep] == labels[keep]))}


_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD v1.1's answer normalisation: lower case, punctuation removed, the articles a / an / the removed,
    whitespace collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def answer_f1(prediction: str, gold: str) -> float:
    """SQuAD v1.1's F1 of the normalised answers' words (a bag of words: repeated words count repeatedly)."""
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(gold).split()
    same = sum((Counter(predicted) & Counter(expected)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(expected)
    return 2 * precision * recall / (precision + recall)


def span_metrics(task: TaskSpec, predictions, labels) -> dict[str, float]:
    """Exact match and F1, each the best over a question's gold answers, averaged over the questions."""
    predictions, labels = list(predictions), list(labels)
    if len(predictions) != len(labels):
        raise LunaConvertError(f"{len(predictions)} predicted answers but {len(labels)} questions for task "
                               f"{task.name!r}; they must match one to one")
    if not labels:
        raise LunaConvertError(f"no questions to score for task {task.name!r}; check the evaluation split")
    exact = f1 = 0.0
    for prediction, golds in zip(predictions, labels):
        if isinstance(golds, str) or not len(golds):
            raise LunaConvertError(f"the gold answers of task {task.name!r} must be a non-empty list of texts a "
                                   f"question, got {golds!r}")
        exact += max(float(normalize_answer(prediction) == normalize_answer(g)) for g in golds)
        f1 += max(answer_f1(prediction, g) for g in golds)
    return {"f1": f1 / len(labels), "exact_match": exact / len(labels)}


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The cosine similarity of each row of ``a`` with the same row of ``b`` ([N, D] each -> [N])."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    norms = np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-12)
    return (a * b).sum(-1) / norms


def _nearest(embeddings: np.ndarray, k: int, block: int = 1024) -> np.ndarray:
    """Each row's ``k`` nearest other rows by cosine similarity [N, k] (ties: the lower index first)."""
    unit = embeddings / np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)
    out = np.empty((len(unit), k), dtype=np.int64)
    for start in range(0, len(unit), block):  # N x N similarities a block of rows at a time
        sims = unit[start:start + block] @ unit.T
        rows = np.arange(sims.shape[0])
        sims[rows, start + rows] = -np.inf  # not its own neighbour
        out[start:start + block] = np.argsort(-sims, axis=1, kind="stable")[:, :k]
    return out


def topk_agreement(teacher: np.ndarray, student: np.ndarray, k: int = TOP_K) -> float:
    """For each text, the fraction of the teacher's ``k`` nearest texts (cosine, among the others; ``k`` at most
    n - 1) that are also among the student's ``k`` nearest, averaged over the texts."""
    teacher, student = np.asarray(teacher, dtype=np.float64), np.asarray(student, dtype=np.float64)
    k = min(k, len(teacher) - 1)
    if k < 1:
        raise LunaConvertError(f"top-k agreement needs at least 2 texts, got {len(teacher)}; evaluate on more texts")
    ours, theirs = _nearest(student, k), _nearest(teacher, k)
    return float(np.mean([len(set(a) & set(b)) / k for a, b in zip(ours, theirs)]))


def embedding_metrics(task: TaskSpec, predictions, labels) -> dict[str, float]:
    """Pair embeddings [M, 2, D] with similarity scores [M]: the Spearman and Pearson correlation of the pairs'
    cosine similarity with the scores. Embeddings [N, D] with the teacher's [N, D]: the mean cosine between
    the two (``teacher_cosine``) and :func:`topk_agreement`."""
    predictions, labels = np.asarray(predictions, dtype=np.float64), np.asarray(labels, dtype=np.float64)
    if predictions.ndim == 3 and predictions.shape[1] == 2 and labels.shape == predictions.shape[:1]:
        if len(labels) == 0:
            raise LunaConvertError(f"no sentence pairs to score for task {task.name!r}; check the evaluation split")
        similarity = cosine_rows(predictions[:, 0], predictions[:, 1])
        return {"spearmanr": _correlation("spearman", similarity, labels),
                "pearson": _correlation("pearson", similarity, labels)}
    if predictions.ndim == 2 and labels.shape == predictions.shape:
        if len(labels) == 0:
            raise LunaConvertError(f"no texts to score for task {task.name!r}; check the evaluation split")
        return {"teacher_cosine": float(np.mean(cosine_rows(predictions, labels))),
                "topk_agreement": topk_agreement(labels, predictions)}
    raise LunaConvertError(f"embeddings of shape {tuple(predictions.shape)} and labels of shape {tuple(labels.shape)} "
                           f"for task {task.name!r}; expected pairs [M, 2, D] with scores [M], or [N, D] with the "
                           "teacher's [N, D]")


def sequence_metrics(task: TaskSpec | str, predictions, labels) -> dict[str, float]:
    """Scores of one prediction an example (a text or an image) against ``labels`` for ``task``.

    ``predictions``: logits ``[N, C]`` (argmax taken here) or class ids ``[N]`` for classification;
    scores ``[N]`` or ``[N, 1]`` for regression. Classification labels below 0 (GLUE test splits use -1,
    PyTorch ignores -100) are left out.
    """
    task = get_task(task)
    predictions = np.asarray(predictions)
    labels = np.asarray(labels)
    n = predictions.shape[0] if predictions.ndim else 0
    if labels.ndim != 1 and not (labels.ndim == 2 and labels.shape[1] == 1):
        raise LunaConvertError(f"labels for task {task.name!r} have shape {tuple(labels.shape)}; expected [N]")
    labels = labels.reshape(-1)
    if n != labels.shape[0]:
        raise LunaConvertError(
            f"{n} predictions but {labels.shape[0]} labels for task {task.name!r}; they must match one to one"
        )

    if task.is_regression:
        if predictions.ndim == 2 and predictions.shape[1] == 1:
            predictions = predictions[:, 0]
        if predictions.ndim != 1:
            raise LunaConvertError(
                f"predictions for regression task {task.name!r} have shape {tuple(predictions.shape)}; expected [N] or [N, 1]"
            )
        x = predictions.astype(np.float64)
        y = labels.astype(np.float64)
        if n == 0:
            raise LunaConvertError(f"no examples to score for task {task.name!r}; check the evaluation split")
        out = {"pearson": _correlation("pearson", x, y), "spearmanr": _correlation("spearman", x, y)}
        if task.name != "stsb":
            out["mse"] = float(np.mean((x - y) ** 2))
        return out

    logits = predictions if predictions.ndim == 2 and predictions.shape[1] > 1 else None
    preds = _class_predictions(task, predictions)
    labels = labels.astype(np.int64)
    keep = labels >= 0
    if not keep.all():
        preds, labels = preds[keep], labels[keep]
        if logits is not None:
            logits = logits[keep]
    if labels.size == 0:
        raise LunaConvertError(
            f"no labelled examples to score for task {task.name!r} (test splits have no labels); evaluate on the validation split"
        )

    from sklearn.metrics import f1_score, matthews_corrcoef

    accuracy = float(np.mean(preds == labels))
    if task.name in _GLUE_KEYS:
        keys = _GLUE_KEYS[task.name]
        out: dict[str, float] = {}
        if "matthews_correlation" in keys:
            out["matthews_correlation"] = float(matthews_corrcoef(labels, preds))
        if "accuracy" in keys:
            out["accuracy"] = accuracy
        if "f1" in keys:
            out["f1"] = float(f1_score(labels, preds, pos_label=1, average="binary", zero_division=0.0))
        return out

    if task.kind == "image":
        out = {"accuracy": accuracy}
        if logits is not None and logits.shape[1] >= 5:
            top5 = np.argpartition(-logits, 4, axis=1)[:, :5]
            out["top5_accuracy"] = float(np.mean((top5 == labels[:, None]).any(axis=1)))
        return out

    return {
        "accuracy": accuracy,
        "macro_f1": float(f1_score(labels, preds, average="macro", zero_division=0.0)),
        "matthews_correlation": float(matthews_corrcoef(labels, preds)),
    }
