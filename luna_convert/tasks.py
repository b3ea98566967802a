"""Task descriptions: which columns, labels, splits and headline metric each task uses.

Importing this module is instant (no torch / datasets / transformers)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import unknown_name

__all__ = ["TaskSpec", "TASKS", "TASK_ALIASES", "get_task", "GLUE_TASKS", "IMAGE_TASKS", "IGNORE_INDEX"]

# The label of positions that neither the loss nor the metrics count (sub-tokens after a word's first,
# special tokens, padding): PyTorch's cross_entropy ignores it by default.
IGNORE_INDEX = -100
# How far the embedding task's sentence embeddings are from the teacher's (engine.training.embedding_loss).
EMBEDDING_LOSSES = ("cosine", "mse")


@dataclass(frozen=True)
class TaskSpec:
    """What a task's data looks like and how it is scored.

    ``num_labels`` 1 means regression; ``None`` means "take it from the data or the model".
    ``label_names`` are the class names in index order (GLUE's order for GLUE tasks; a token task's
    tags come from the model's id2label). ``level`` names the task's kind of output, whose class in
    ``luna_convert.task_kinds`` owns what differs: "sequence" labels the whole text (or image), "token" every
    word of a text (NER), "span" answers a question with a span of its context (extractive QA), "embedding"
    turns each text into one vector (a sentence encoder: a text encoder plus pooling).
    """

    name: str
    kind: str  # "text" or "image"
    text_columns: tuple[str, ...] = ()
    label_column: str = "label"
    num_labels: int | None = None
    label_names: tuple[str, ...] | None = None
    headline: str = "accuracy"
    train_split: str = "train"
    eval_split: str = "validation"
    glue_config: str | None = None
    # Extra (not needed by callers): folder name of the task in the original GLUE download
    # ("SST-2", "MNLI", ...), used to accept a GLUE root folder as --data-dir.
    glue_dir: str | None = None
    level: str = "sequence"  # the kind: "sequence", "token", "span" or "embedding" (task_kinds.kind_of)

    @property
    def is_regression(self) -> bool:
        return self.num_labels == 1

    @property
    def is_text(self) -> bool:
        return self.kind == "text"

    @property
    def is_image(self) -> bool:
        return self.kind == "image"

    @property
    def is_pair(self) -> bool:
        return len(self.text_columns) == 2


_NLI3 = ("entailment", "neutral", "contradiction")
_NLI2 = ("entailment", "not_entailment")

_CIFAR10 = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")

_ALL: tuple[TaskSpec, ...] = (
    # GLUE (columns and label names as in the hub dataset nyu-mll/glue)
    TaskSpec("cola", "text", ("sentence",), num_labels=2, label_names=("unacceptable", "acceptable"),
             headline="matthews_correlation", glue_config="cola", glue_dir="CoLA"),
    TaskSpec("sst2", "text", ("sentence",), num_labels=2, label_names=("negative", "positive"),
             glue_config="sst2", glue_dir="SST-2"),
    TaskSpec("mrpc", "text", ("sentence1", "sentence2"), num_labels=2, label_names=("not_equivalent", "equivalent"),
             headline="f1", glue_config="mrpc", glue_dir="MRPC"),
    TaskSpec("stsb", "text", ("sentence1", "sentence2"), num_labels=1, headline="pearson",
             glue_config="stsb", glue_dir="STS-B"),
    TaskSpec("qqp", "text", ("question1", "question2"), num_labels=2, label_names=("not_duplicate", "duplicate"),
             glue_config="qqp", glue_dir="QQP"),
    TaskSpec("mnli", "text", ("premise", "hypothesis"), num_labels=3, label_names=_NLI3,
             eval_split="validation_matched", glue_config="mnli", glue_dir="MNLI"),
    TaskSpec("mnli_mismatched", "text", ("premise", "hypothesis"), num_labels=3, label_names=_NLI3,
             eval_split="validation_mismatched", glue_config="mnli", glue_dir="MNLI"),
    TaskSpec("qnli", "text", ("question", "sentence"), num_labels=2, label_names=_NLI2,
             glue_config="qnli", glue_dir="QNLI"),
    TaskSpec("rte", "text", ("sentence1", "sentence2"), num_labels=2, label_names=_NLI2,
             glue_config="rte", glue_dir="RTE"),
    # images
    TaskSpec("imagenet", "image", num_labels=1000),
    TaskSpec("digits", "image", num_labels=10, label_names=tuple(str(i) for i in range(10))),
    TaskSpec("cifar10", "image", num_labels=10, label_names=_CIFAR10),
    # generic tasks on the user's own data
    TaskSpec("text-classification", "text", ("sentence",)),
    TaskSpec("text-pair-classification", "text", ("sentence1", "sentence2")),
    TaskSpec("text-regression", "text", ("sentence",), num_labels=1, headline="pearson"),
    TaskSpec("text-pair-regression", "text", ("sentence1", "sentence2"), num_labels=1, headline="pearson"),
    TaskSpec("image-classification", "image"),
    # token classification (named entities): CoNLL-style words and tags, entity-level F1
    TaskSpec("ner", "text", ("tokens",), label_column="ner_tags", headline="entity_f1", level="token"),
    # extractive question answering (SQuAD v1.1): the answer is a span of the context; SQuAD's F1 and exact match
    TaskSpec("qa", "text", ("question", "context"), label_column="answers", headline="f1", level="span"),
    # sentence embeddings (a sentence-transformers model): trained to the teacher's embedding of unlabelled text;
    # scored by the Spearman correlation with similarity scores where the eval data has scored sentence pairs
    # (STS-B), else by agreement with the teacher (the headline then chosen from the data, see run.task_data)
    TaskSpec("embedding", "text", ("sentence",), headline="teacher_cosine", level="embedding"),
)

TASKS: dict[str, TaskSpec] = {t.name: t for t in _ALL}

GLUE_TASKS: tuple[str, ...] = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte")
IMAGE_TASKS: tuple[str, ...] = tuple(t.name for t in _ALL if t.kind == "image")

# Other spellings people use (GLUE folder names, evaluate's config names, ...).
TASK_ALIASES: dict[str, str] = {
    "sst-2": "sst2",
    "sts-b": "stsb",
    "mnli-m": "mnli",
    "mnli_matched": "mnli",
    "mnli-mm": "mnli_mismatched",
    "mnli-mismatched": "mnli_mismatched",
    "imagenet-1k": "imagenet",
    "imagenet1k": "imagenet",
    "cifar-10": "cifar10",
    "text_classification": "text-classification",
    "text_pair_classification": "text-pair-classification",
    "text_regression": "text-regression",
    "text_pair_regression": "text-pair-regression",
    "image_classification": "image-classification",
    "token-classification": "ner",
    "token_classification": "ner",
    "question-answering": "qa",
    "question_answering": "qa",
    "extractive-qa": "qa",
    "squad": "qa",
    "sentence-embedding": "embedding",
    "sentence_embedding": "embedding",
    "sentence-similarity": "embedding",
    "sentence_similarity": "embedding",
}


def get_task(name: str | TaskSpec) -> TaskSpec:
    """The TaskSpec called ``name`` (case-insensitive; GLUE folder spellings accepted)."""
    if isinstance(name, TaskSpec):
        return name
    key = str(name).strip().lower()
    key = TASK_ALIASES.get(key, key)
    try:
        return TASKS[key]
    except KeyError:
        raise unknown_name("task", str(name), TASKS) from None
