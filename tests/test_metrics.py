"""Task metrics against hand-computed values and scikit-learn / scipy."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import f1_score, matthews_corrcoef

from luna_convert.errors import LunaConvertError, UnknownNameError
from luna_convert.metrics import headline_metric
from luna_convert.task_kinds import compute_metrics, kind_of, metric_names
from luna_convert.tasks import GLUE_TASKS, TASKS, TaskSpec, get_task


def one_hot_logits(preds, num_classes):
    logits = np.full((len(preds), num_classes), -1.0)
    logits[np.arange(len(preds)), preds] = 2.0
    return logits


# ---------------------------------------------------------------- tasks


def test_task_registry_fields():
    for name in ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "imagenet", "digits", "cifar10",
                 "text-classification", "text-pair-classification", "text-regression", "image-classification"):
        assert name in TASKS
        t = get_task(name)
        assert t.name == name and t.kind in ("text", "image")
    assert get_task("mnli").eval_split == "validation_matched"
    assert get_task("mnli").label_names == ("entailment", "neutral", "contradiction")
    assert get_task("qqp").text_columns == ("question1", "question2")
    assert get_task("qnli").text_columns == ("question", "sentence")
    assert get_task("stsb").is_regression and not get_task("sst2").is_regression
    assert get_task("text-regression").is_regression
    assert get_task("sst2").glue_config == "sst2"
    assert get_task("imagenet").num_labels == 1000 and get_task("imagenet").kind == "image"
    for name in GLUE_TASKS:
        assert get_task(name).glue_config is not None


def test_get_task_aliases_and_unknown():
    assert get_task("SST-2").name == "sst2"
    assert get_task("STS-B").name == "stsb"
    assert get_task("mnli-mm").eval_split == "validation_mismatched"
    spec = get_task("cola")
    assert get_task(spec) is spec
    with pytest.raises(UnknownNameError) as e:
        get_task("sst3")
    msg = str(e.value)
    assert "sst2" in msg and "Did you mean" in msg and "\n" not in msg
    assert isinstance(e.value, LunaConvertError)


def test_taskspec_is_frozen():
    spec = get_task("rte")
    with pytest.raises(Exception):
        spec.name = "x"  # type: ignore[misc]


def test_import_tasks_and_metrics_is_light():
    code = ("import sys, luna_convert.tasks, luna_convert.metrics, luna_convert.data, luna_convert.task_kinds; "
            "heavy = [m for m in ('torch', 'datasets', 'transformers', 'timm', 'torchvision', 'sklearn') "
            "if m in sys.modules]; "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


# ---------------------------------------------------------------- headline


@pytest.mark.parametrize("name,key", [
    ("cola", "matthews_correlation"), ("sst2", "accuracy"), ("mrpc", "f1"), ("stsb", "pearson"),
    ("qqp", "accuracy"), ("mnli", "accuracy"), ("qnli", "accuracy"), ("rte", "accuracy"),
    ("imagenet", "accuracy"), ("digits", "accuracy"), ("cifar10", "accuracy"),
    ("text-classification", "accuracy"), ("text-regression", "pearson"),
])
def test_headline_metric(name, key):
    assert headline_metric(get_task(name)) == key
    assert headline_metric(name) == key


def test_headline_is_among_computed_keys():
    rng = np.random.default_rng(0)
    for name, spec in TASKS.items():
        if kind_of(spec).name == "span":  # QA: answer texts against each question's gold texts
            out = compute_metrics(spec, ["the cat", "a dog"], [["cat"], ["dog", "the cat"]])
            assert headline_metric(spec) in out and set(out) == set(metric_names(spec)), name
            continue
        if kind_of(spec).name == "embedding":  # embeddings against the teacher's, or pairs against similarity scores
            teacher = rng.normal(size=(20, 8))
            out = compute_metrics(spec, teacher + 0.1 * rng.normal(size=(20, 8)), teacher)
            assert headline_metric(spec) in out and set(out) == set(metric_names(spec)), name
            pairs = dataclasses.replace(spec, headline="spearmanr")
            out = compute_metrics(pairs, rng.normal(size=(20, 2, 8)), rng.random(20) * 5)
            assert "spearmanr" in out and set(out) == set(metric_names(pairs)), name
            continue
        n_cls = spec.num_labels or 3
        token = kind_of(spec).name == "token"
        shape = (20, 6) if token else (20,)  # token tasks: a label a token
        if token:  # tag names come from the model
            spec = dataclasses.replace(spec, label_names=("O", "B-X", "I-X"))
        labels = rng.random(20) * 5 if spec.is_regression else rng.integers(0, n_cls, shape)
        preds = rng.random(20) * 5 if spec.is_regression else rng.normal(size=(*shape, n_cls))
        out = compute_metrics(spec, preds, labels)
        assert headline_metric(spec) in out, name
        assert set(out) == set(metric_names(spec, n_cls)), name
        assert all(isinstance(v, float) and math.isfinite(v) for v in out.values())


# ---------------------------------------------------------------- classification


def test_accuracy_hand_computed():
    labels = np.array([0, 1, 1, 0])
    logits = one_hot_logits([0, 1, 0, 0], 2)  # 3 of 4 right
    assert compute_metrics(get_task("sst2"), logits, labels) == {"accuracy": 0.75}


def test_mrpc_accuracy_and_f1_hand_computed():
    labels = np.array([1, 1, 0, 0, 1])
    preds = np.array([1, 0, 0, 1, 1])
    # TP=2, FP=1, FN=1 -> precision 2/3, recall 2/3, F1 2/3; accuracy 3/5
    out = compute_metrics(get_task("mrpc"), one_hot_logits(preds, 2), labels)
    assert set(out) == {"accuracy", "f1"}
    assert out["accuracy"] == pytest.approx(0.6)
    assert out["f1"] == pytest.approx(2 / 3)
    assert out["f1"] == pytest.approx(f1_score(labels, preds))
    assert set(compute_metrics("qqp", one_hot_logits(preds, 2), labels)) == {"accuracy", "f1"}


def test_cola_matthews_hand_computed():
    labels = np.array([1, 1, 0, 0])
    preds = np.array([1, 0, 0, 0])
    # TP=1 TN=2 FP=0 FN=1: (1*2 - 0*1) / sqrt(1*2*3*2) = 2/sqrt(12)
    out = compute_metrics(get_task("cola"), one_hot_logits(preds, 2), labels)
    assert set(out) == {"matthews_correlation"}
    assert out["matthews_correlation"] == pytest.approx(2 / math.sqrt(12))
    assert out["matthews_correlation"] == pytest.approx(matthews_corrcoef(labels, preds))


def test_matches_sklearn_on_random_data():
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 2, 200)
    logits = rng.normal(size=(200, 2)) + np.eye(2)[labels] * 0.7
    preds = logits.argmax(1)
    assert compute_metrics("cola", logits, labels)["matthews_correlation"] == pytest.approx(matthews_corrcoef(labels, preds))
    assert compute_metrics("qqp", logits, labels)["f1"] == pytest.approx(f1_score(labels, preds))
    assert compute_metrics("rte", logits, labels)["accuracy"] == pytest.approx(np.mean(preds == labels))


def test_mnli_three_class_accuracy():
    labels = np.array([0, 1, 2, 2, 1, 0])
    preds = np.array([0, 1, 2, 0, 0, 0])
    assert compute_metrics("mnli", one_hot_logits(preds, 3), labels) == {"accuracy": pytest.approx(4 / 6)}
    assert set(compute_metrics("mnli_mismatched", one_hot_logits(preds, 3), labels)) == {"accuracy"}


def test_generic_classification_keys_and_values():
    labels = np.array([0, 1, 2, 2, 1, 0, 2])
    preds = np.array([0, 1, 2, 0, 1, 1, 2])
    out = compute_metrics("text-classification", one_hot_logits(preds, 3), labels)
    assert set(out) == {"accuracy", "macro_f1", "matthews_correlation"}
    assert out["accuracy"] == pytest.approx(5 / 7)
    assert out["macro_f1"] == pytest.approx(f1_score(labels, preds, average="macro"))
    assert out["matthews_correlation"] == pytest.approx(matthews_corrcoef(labels, preds))


def test_class_ids_and_single_logit_accepted():
    labels = np.array([0, 1, 1, 0])
    assert compute_metrics("sst2", np.array([0, 1, 0, 0]), labels)["accuracy"] == 0.75
    assert compute_metrics("sst2", np.array([[-1.0], [2.0], [-0.5], [-3.0]]), labels)["accuracy"] == 0.75


def test_unlabelled_examples_are_ignored_and_all_unlabelled_errors():
    labels = np.array([0, 1, -1, -100])
    logits = one_hot_logits([0, 0, 1, 1], 2)
    assert compute_metrics("sst2", logits, labels)["accuracy"] == 0.5
    with pytest.raises(LunaConvertError, match="no labelled examples"):
        compute_metrics("sst2", logits, np.full(4, -1))


def test_length_mismatch_errors():
    with pytest.raises(LunaConvertError, match="3 predictions but 2 labels"):
        compute_metrics("sst2", one_hot_logits([0, 1, 1], 2), np.array([0, 1]))


def test_constant_predictions_no_warnings():
    labels = np.array([0, 1, 0, 1, 1])
    logits = one_hot_logits([1, 1, 1, 1, 1], 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compute_metrics("cola", logits, labels)["matthews_correlation"] == 0.0
        assert compute_metrics("mrpc", one_hot_logits([0] * 5, 2), labels)["f1"] == 0.0
        out = compute_metrics("text-classification", logits, labels)
    assert all(math.isfinite(v) for v in out.values())


# ---------------------------------------------------------------- regression


def test_stsb_pearson_spearman():
    labels = np.array([0.0, 1.0, 2.0, 3.0, 4.5])
    preds = np.array([0.2, 0.9, 2.5, 2.9, 5.0])
    out = compute_metrics(get_task("stsb"), preds, labels)
    assert set(out) == {"pearson", "spearmanr"}
    assert out["pearson"] == pytest.approx(pearsonr(preds, labels)[0])
    assert out["spearmanr"] == pytest.approx(1.0)  # same ranking
    # [N, 1] predictions as a regression head gives them
    assert compute_metrics("stsb", preds[:, None], labels) == out


def test_pearson_hand_computed():
    # x = (1,2,3), y = (1,3,2): cov = 0.5 (sample: 1), var 1 and 1 -> r = 0.5
    out = compute_metrics("text-regression", np.array([1.0, 2.0, 3.0]), np.array([1.0, 3.0, 2.0]))
    assert out["pearson"] == pytest.approx(0.5)
    assert out["spearmanr"] == pytest.approx(0.5)
    assert out["mse"] == pytest.approx((0 + 1 + 1) / 3)
    assert out["spearmanr"] == pytest.approx(spearmanr([1, 2, 3], [1, 3, 2])[0])


def test_regression_degenerate_cases_are_finite_and_quiet():
    labels = np.array([0.0, 1.0, 2.0, 3.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = compute_metrics("stsb", np.full(4, 2.5), labels)
        assert out == {"pearson": 0.0, "spearmanr": 0.0}
        out = compute_metrics("text-regression", np.array([1.0]), np.array([2.0]))
        assert out["pearson"] == 0.0 and out["mse"] == pytest.approx(1.0)
        out = compute_metrics("stsb", np.array([1.0, np.nan, 2.0, 3.0]), labels)
        assert out["pearson"] == 0.0


# ---------------------------------------------------------------- images


def test_image_top1_top5():
    logits = np.zeros((3, 10))
    for i, order in enumerate([[3, 1, 2, 4, 5], [0, 9, 8, 7, 6], [2, 3, 4, 5, 6]]):
        for rank, cls in enumerate(order):
            logits[i, cls] = 10 - rank
    labels = np.array([3, 6, 9])  # top-1 hit; top-5 hit at rank 5; miss
    out = compute_metrics(get_task("imagenet"), logits, labels)
    assert out["accuracy"] == pytest.approx(1 / 3)
    assert out["top5_accuracy"] == pytest.approx(2 / 3)


def test_image_fewer_than_five_classes_has_no_top5():
    task = TaskSpec("tiny-images", "image", num_labels=3)
    spec = get_task("image-classification")
    out = compute_metrics(spec, one_hot_logits([0, 1, 2, 2], 3), np.array([0, 1, 2, 1]))
    assert out == {"accuracy": 0.75}
    assert metric_names(task) == ("accuracy",)


# ---------------------------------------------------------------- % recovered
def test_recovered_pct_reads_the_same_way_for_scores_and_errors():
    from luna_convert.metrics import recovered_pct

    assert recovered_pct(0.9, 0.95, "accuracy") == pytest.approx(100 * 0.9 / 0.95)
    assert recovered_pct(0.5, 0.4, "mse") == pytest.approx(80.0)  # a larger error: below 100
    assert recovered_pct(0.4, 0.5, "mse") == pytest.approx(125.0)
    assert recovered_pct(0.3, 0.0, "matthews_correlation") is None
    assert recovered_pct(0.0, 0.2, "mse") is None
