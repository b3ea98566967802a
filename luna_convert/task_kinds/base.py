"""``TaskKind``: what differs between kinds of task output, as hooks the run, the engine, scoring, pre-flight
and the reports call. Its default hooks are a label an example (sequence classification and regression);
each other kind overrides what differs (``token.py``, ``span.py``, ``embedding.py``).

No torch at import: ``run.config`` checks a run's settings through its kind before torch is loaded."""

from __future__ import annotations

from .. import data
from ..errors import LunaConvertError
from ..metrics import sequence_metric_names, sequence_metrics
from ..tasks import TaskSpec


class TaskKind:
    """One kind of task output. ``name`` is the ``TaskSpec.level`` that picks it.

    Class attributes (facts the callers read, never the kind's name):
    ``auto_class``: the transformers auto class that loads its head (None: not a transformers head);
    ``head``: (architecture suffix of its head, what the head is called, the task that runs it), for kinds a
    plain classifier's head cannot stand in for; ``sentence_encoder``: the model is a text encoder plus pooling
    (sentence-transformers), loaded as such; ``span_logits``: its logits are start and end rows over positions
    (distillation and teacher KL normalise over positions, not classes); ``scored_against_teacher``: plain eval
    data is scored against the unconverted teacher's outputs, so evaluating a converted model loads it."""

    name = "sequence"
    auto_class: str | None = "AutoModelForSequenceClassification"
    head: tuple[str, str, str] | None = None
    sentence_encoder = False
    span_logits = False
    scored_against_teacher = False

    # ------------------------------------------------------------ data
    def read_files(self, task: TaskSpec, split: str, data_dir):
        """One text split read from the files in ``data_dir`` (None: the task's hub dataset)."""
        return data.read_sequence_split(task, split, data_dir)

    def read_datasets(self, task: TaskSpec, ds, where: str, split: str):
        """One text split of a hub dataset (``ds``, already subset) turned into the rows ``load_split`` returns."""
        return data.columns_to_dataset(task, data.datasets_value_columns(ds), where, split)

    def load_split(self, task: TaskSpec, split: str, data_dir=None, max_examples: int | None = None, seed: int = 0):
        """One split of ``task``'s data (see :func:`luna_convert.data.load_split`)."""
        return data.load_split(task, split, data_dir, max_examples, seed, reader=self)

    def align_labels(self, dataset, task: TaskSpec, id2label: dict | None, num_labels: int):
        """The data's labels as the model's class ids (see :func:`luna_convert.data.align_labels`)."""
        return data.align_labels(dataset, task, id2label, num_labels)

    def task_for_model(self, task: TaskSpec, loaded) -> TaskSpec:
        """The task as scored with ``loaded`` (a ``LoadedModel``): unchanged unless the model names its labels."""
        return task

    def task_for_data(self, task: TaskSpec, eval_split, metric_chosen: bool) -> TaskSpec:
        """The task as scored on this data (``eval_split()`` reads the evaluation split); ``metric_chosen``: the
        headline was asked for (``--metric``)."""
        return task

    def text_loader(self, task: TaskSpec, dataset, loaded, *, train: bool, batch_size: int, max_length: int,
                    seed: int, teacher_targets):
        """A text split's DataLoader for ``loaded``'s tokenizer and labels (``teacher_targets(texts)``: the
        teacher's embeddings of ``texts``, for kinds trained to them). It has ``num_truncated`` and ``longest``."""
        dataset = self.align_labels(dataset, task, loaded.id2label, loaded.num_labels)
        return data.make_text_dataloader(dataset, task, loaded.tokenizer, batch_size=batch_size,
                                         max_length=max_length, shuffle=train, seed=seed)

    # ------------------------------------------------------------ training
    def loss_fn(self, train):
        """The finetuning loss, given the run's ``train`` settings; None: the model's own (cross-entropy / MSE)."""
        return None

    def check_config(self, config) -> None:
        """Refuse run settings (a ``RunConfig``) that do not fit this kind, with one line naming the setting."""

    # ------------------------------------------------------------ scoring
    def metric_names(self, task: TaskSpec, num_classes: int | None = None) -> tuple[str, ...]:
        """Keys that :meth:`compute_metrics` returns for ``task``."""
        return sequence_metric_names(task, num_classes)

    def metric_choices(self, task: TaskSpec, num_classes: int | None = None) -> tuple[str, ...]:
        """The metrics ``--metric`` may name before the data is read."""
        return self.metric_names(task, num_classes)

    def compute_metrics(self, task: TaskSpec, predictions, labels) -> dict[str, float]:
        """Scores of ``predictions`` against ``labels`` (see :func:`luna_convert.metrics.sequence_metrics`)."""
        return sequence_metrics(task, predictions, labels)

    def loader_metrics(self, task: TaskSpec, logits, labels, loader) -> tuple[dict[str, float], int]:
        """Scores of a model's ``logits`` (stacked over ``loader``'s batches) against the loader's ``labels``, and
        the number of examples scored."""
        return self.compute_metrics(task, logits, labels), len(labels)

    # ------------------------------------------------------------ model cards
    def pipeline_tag(self, task: TaskSpec) -> str:
        """The hub's pipeline tag of a model for ``task`` (its model card's front matter)."""
        return "image-classification" if task.is_image else "text-classification"

    # ------------------------------------------------------------ models
    def check_encoder(self, is_sentence_encoder: bool, source: str) -> None:
        """A saved sentence embedding model runs only as a sentence-encoder kind, and that kind only on one."""
        if is_sentence_encoder and not self.sentence_encoder:
            raise LunaConvertError(f"{source} is a sentence embedding model; run it with --task embedding")
