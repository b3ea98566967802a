"""Sentence embeddings (--task embedding): sentence-transformers folders, pooling, the loss against the teacher's
embeddings, the Spearman and agreement scores, whole runs, and loading the result in sentence-transformers."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import luna_convert
from luna_convert import data
from luna_convert.engine.training import embedding_loss
from luna_convert.errors import LunaConvertError
from luna_convert.metrics import compute_metrics, cosine_rows, metric_names, topk_agreement
from luna_convert.run.config import RunConfig
from luna_convert.run.models import load_model
from luna_convert.run.pipeline import evaluate_model, run_conversion
from luna_convert.sentence_embedding import SentenceEmbedder, pool
from luna_convert.tasks import get_task
from builders import WORDS, config_for, run_cli, saved_tokenizer, write_bert_checkpoint, write_sst2

EMBEDDING = get_task("embedding")
LEGACY_KEYS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens"}


def write_sentence_model(folder: Path, pooling: str = "mean", normalize: bool = True,
                         modules: list[dict] | None = None) -> Path:
    """A tiny sentence-transformers folder: a BertModel and its tokenizer at the root, 1_Pooling/config.json
    (the legacy pooling_mode_* keys) and, with ``normalize``, a Normalize module; ``modules`` replaces the list."""
    import transformers

    write_bert_checkpoint(folder)
    encoder = transformers.AutoModel.from_pretrained(folder)  # the classifier's encoder, saved as a BertModel
    encoder.save_pretrained(folder)
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, **{key: mode == pooling for mode, key in LEGACY_KEYS.items()},
         "pooling_mode_mean_sqrt_len_tokens": False}))
    listed = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
              {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        listed.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules if modules is not None else listed))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32, "do_lower_case": False}))
    return folder


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(2, 9)))


def write_stsb(folder: Path, n_train: int = 24, n_dev: int = 12) -> Path:
    """train.tsv and dev.tsv in GLUE STS-B's layout (index, genre, ..., sentence1, sentence2, score): the
    score is 5 x the share of the words two sentences have in common."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.tsv", n_train), ("dev.tsv", n_dev)):
        rows = ["index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"]
        for i in range(n):
            a, b = sentence(rng), sentence(rng)
            if i % 2:  # half the pairs share most of their words
                b = " ".join(a.split()[:-1] + [rng.choice(WORDS)])
            shared = len(set(a.split()) & set(b.split())) / len(set(a.split()) | set(b.split()))
            rows.append(f"{i}\tmain-forums\tf\t2015\t{i}\tnone\tnone\t{a}\t{b}\t{5 * shared:.3f}")
        (folder / name).write_text("\n".join(rows) + "\n")
    return folder


@pytest.fixture(scope="module")
def sentence_model(tmp_path_factory):
    return write_sentence_model(tmp_path_factory.mktemp("st") / "tiny-st")


def embed(model, tokenizer, texts: list[str]) -> torch.Tensor:
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model.eval()(**batch)


# ------------------------------------------------------------------ pooling and loading


@pytest.mark.parametrize("mode", ["mean", "cls", "max"])
def test_pooling_modes_equal_a_hand_computation_over_the_real_tokens(mode):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, 4, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    expected = []
    for row, m in zip(hidden, mask):
        real = row[: int(m.sum())]  # right padding: the real tokens come first
        expected.append({"mean": real.mean(0), "cls": real[0], "max": real.max(0).values}[mode])
    torch.testing.assert_close(pool(hidden, mask, mode), torch.stack(expected))


@pytest.mark.parametrize("mode, normalize", [("mean", True), ("cls", False), ("max", False)])
def test_a_sentence_transformers_folder_keeps_its_pooling_and_normalisation(tmp_path, mode, normalize):
    folder = write_sentence_model(tmp_path / "st", pooling=mode, normalize=normalize)
    loaded = load_model(str(folder), level="embedding")
    model = loaded.model
    assert isinstance(model, SentenceEmbedder) and (model.pooling, model.normalize) == (mode, normalize)
    assert "modules.json" in loaded.note and mode in loaded.note
    texts = ["good movie", "the plot was very bad"]
    batch = loaded.tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model.encoder.eval()(**batch).last_hidden_state
    expected = pool(hidden, batch["attention_mask"], mode)
    if normalize:
        expected = expected / expected.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(embed(model, loaded.tokenizer, texts), expected)


def test_a_plain_encoder_folder_gets_mean_pooling_and_says_so(tmp_path):
    folder = write_bert_checkpoint(tmp_path / "bert")  # a classifier checkpoint: its encoder is used
    loaded = load_model(str(folder), level="embedding")
    assert loaded.model.pooling == "mean" and not loaded.model.normalize
    assert "no modules.json" in loaded.note and "mean pooling" in loaded.note


# ------------------------------------------------------------------ loss and metrics


def test_embedding_loss_is_one_minus_cosine_or_the_squared_error():
    a = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    b = torch.tensor([[0.0, 2.0], [2.0, 2.0]])
    # row 1: orthogonal (1 - 0), row 2: same direction (1 - 1)
    assert embedding_loss(a, b, "cosine").item() == pytest.approx(0.5)
    assert embedding_loss(a, b, "mse").item() == pytest.approx(np.mean((a.numpy() - b.numpy()) ** 2))
    with pytest.raises(LunaConvertError, match="unknown embedding loss 'l1'"):
        embedding_loss(a, b, "l1")


def test_spearman_of_pair_similarities_matches_scipy():
    from scipy import stats

    rng = np.random.default_rng(0)
    pairs = rng.normal(size=(20, 2, 8))
    scores = rng.uniform(0, 5, size=20)
    similarity = np.array([a @ b / np.linalg.norm(a) / np.linalg.norm(b) for a, b in pairs])
    metrics = compute_metrics(EMBEDDING, pairs, scores)
    assert metrics["spearmanr"] == pytest.approx(stats.spearmanr(similarity, scores)[0], abs=1e-12)
    assert metrics["pearson"] == pytest.approx(stats.pearsonr(similarity, scores)[0], abs=1e-12)
    # a known value: similarities ranked exactly as the scores
    angles = np.array([0.1, 0.5, 0.9, 1.3])
    ordered = np.stack([np.stack([[1.0, 0.0], [np.cos(t), np.sin(t)]]) for t in angles])
    assert compute_metrics(EMBEDDING, ordered, np.array([4.0, 3.0, 2.0, 1.0]))["spearmanr"] == pytest.approx(1.0)


def test_agreement_with_the_teacher_on_known_values():
    teacher = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    student = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    expected_cosine = np.mean([1.0, 1 / np.sqrt(2), 1.0])
    metrics = compute_metrics(EMBEDDING, student, teacher)
    assert metrics["teacher_cosine"] == pytest.approx(expected_cosine)
    assert cosine_rows(student, teacher) == pytest.approx([1.0, 1 / np.sqrt(2), 1.0])
    # k capped at n - 1 = 2: every other text is a neighbour of each, for both models
    assert metrics["topk_agreement"] == pytest.approx(1.0)
    # k = 1: teacher's nearest of text 0 is text 2, of 1 is 2, of 2 is 0 (tie 0/1: the lower index);
    # the student's: 0 -> 1 (tie 1/2: the lower), 1 -> 2, 2 -> 1
    assert topk_agreement(teacher, student, k=1) == pytest.approx(1 / 3)
    same = compute_metrics(EMBEDDING, teacher, teacher)
    assert same == {"teacher_cosine": pytest.approx(1.0), "topk_agreement": 1.0}
    with pytest.raises(LunaConvertError, match="at least 2 texts"):
        topk_agreement(teacher[:1], student[:1])


def test_topk_agreement_matches_a_direct_computation():
    rng = np.random.default_rng(1)
    teacher = rng.normal(size=(30, 6))
    student = teacher + 0.5 * rng.normal(size=(30, 6))

    def neighbours(x, k):
        unit = x / np.linalg.norm(x, axis=1, keepdims=True)
        sims = unit @ unit.T
        np.fill_diagonal(sims, -np.inf)
        return [set(np.argsort(-row)[:k]) for row in sims]

    expected = np.mean([len(a & b) / 10 for a, b in zip(neighbours(teacher, 10), neighbours(student, 10))])
    assert topk_agreement(teacher, student) == pytest.approx(expected)
    assert 0 < expected < 1


def test_metric_names_follow_the_headline():
    assert metric_names(EMBEDDING) == ("teacher_cosine", "topk_agreement")
    assert metric_names(EMBEDDING.__class__(**{**EMBEDDING.__dict__, "headline": "spearmanr"})) == (
        "spearmanr", "pearson")
