"""Token classification (NER): CoNLL data, word tags on sub-word tokens, entity-level F1, a whole run."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import luna_convert
from luna_convert import data, task_kinds
from luna_convert.errors import LunaConvertError
from luna_convert.metrics import entity_spans
from luna_convert.task_kinds import compute_metrics, kind_of, metric_names
from luna_convert.run.compare import summarise
from luna_convert.run.pipeline import evaluate_model, run_conversion
from luna_convert.tasks import IGNORE_INDEX, get_task
from luna_convert.tools.report import build_report
from builders import cli_error_line, config_for, invoke_cli, write_bert_checkpoint, saved_tokenizer, train_tiny_teacher

try:
    import seqeval.metrics as seqeval_metrics
except ImportError:
    seqeval_metrics = None

TAGS = ("O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG")
ID2LABEL = dict(enumerate(TAGS))
# "##s" makes "johns" two sub-tokens (john, ##s): a word whose second piece must not be labelled.
NER_WORDS = "john mary smith paris london acme corp went to works at in the and ##s".split()
NER = get_task("ner")


def sentence(rng: random.Random) -> list[tuple[str, str]]:
    person = rng.choice([[("john", "B-PER"), ("smith", "I-PER")], [("mary", "B-PER")], [("johns", "B-PER")]])
    if rng.random() < 0.5:
        return person + [("went", "O"), ("to", "O"), (rng.choice(["paris", "london"]), "B-LOC")]
    return person + [("works", "O"), ("at", "O"), ("acme", "B-ORG"), ("corp", "I-ORG")]


def write_conll(folder: Path, n_train: int = 24, n_dev: int = 12) -> Path:
    """train.txt (CoNLL-2003's four columns, a -DOCSTART- line) and dev.txt (tab separated, two columns)."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["-DOCSTART- -X- -X- O", ""]
    for _ in range(n_train):
        lines += [f"{word} NN I-NP {tag}" for word, tag in sentence(rng)] + [""]
    (folder / "train.txt").write_text("\n".join(lines))
    lines = []
    for _ in range(n_dev):
        lines += [f"{word}\t{tag}" for word, tag in sentence(rng)] + [""]
    (folder / "dev.txt").write_text("\n".join(lines))
    return folder


def finetune_teacher(model_dir: Path, data_dir: Path, epochs: int = 20) -> None:
    """Train the tiny model on train.txt so that it is a real (if easy) NER teacher."""
    from luna_convert.run.models import load_model

    loaded = load_model(str(model_dir), kind="token")
    ds = task_kinds.align_labels(task_kinds.load_split(NER, "train", data_dir), NER, loaded.id2label,
                                 loaded.num_labels)
    loader = data.make_text_dataloader(ds, NER, loaded.tokenizer, batch_size=8, shuffle=True, words=True)
    train_tiny_teacher(loaded, loader, model_dir, epochs)


@pytest.fixture(scope="module")
def ner_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ner")
    model = write_bert_checkpoint(root / "bert-ner", head="Token", words=NER_WORDS, id2label=ID2LABEL)
    conll = write_conll(root / "conll")
    finetune_teacher(model, conll)
    return model, conll



# ------------------------------------------------------------------ reading and aligning


def test_conll_and_jsonl_read_the_same_sentences(tmp_path):
    conll = tmp_path / "conll"
    conll.mkdir()
    (conll / "train.conll").write_text("-DOCSTART- O\n\nJohn B-PER\nSmith\tI-PER\n\n\nwent O\nto O\nParis B-LOC\n")
    jsonl = tmp_path / "jsonl"
    jsonl.mkdir()
    rows = [{"tokens": ["John", "Smith"], "ner_tags": ["B-PER", "I-PER"]},
            {"tokens": ["went", "to", "Paris"], "ner_tags": ["O", "O", "B-LOC"]}]
    (jsonl / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    from_conll, from_jsonl = task_kinds.load_split(NER, "train", conll), task_kinds.load_split(NER, "train", jsonl)
    assert from_conll["tokens"] == from_jsonl["tokens"] == [["John", "Smith"], ["went", "to", "Paris"]]
    assert from_conll["label"] == from_jsonl["label"] == [["B-PER", "I-PER"], ["O", "O", "B-LOC"]]
    assert from_conll["source"] == ["train.conll line 3", "train.conll line 7"]  # for messages


def test_hub_style_int_tags_map_through_the_model_order(tmp_path):
    """conll2003 on the hub stores ids of its own tag order; ids are the model's when given as plain ints,
    names (a ClassLabel's) are matched to the model's id2label."""
    import datasets

    names = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC"]  # not TAGS' order
    features = datasets.Features({"tokens": datasets.Sequence(datasets.Value("string")),
                                  "ner_tags": datasets.Sequence(datasets.ClassLabel(names=names))})
    saved = datasets.Dataset.from_dict({"tokens": [["acme", "in", "paris"]], "ner_tags": [[3, 0, 5]]},
                                       features=features)
    datasets.DatasetDict({"train": saved}).save_to_disk(str(tmp_path / "saved"))
    ds = task_kinds.load_split(NER, "train", tmp_path / "saved")
    assert ds["label"] == [["B-ORG", "O", "B-LOC"]]
    assert task_kinds.align_labels(ds, NER, ID2LABEL, len(TAGS))["label"] == [[5, 0, 3]]
    (tmp_path / "ids").mkdir()
    (tmp_path / "ids" / "train.jsonl").write_text(json.dumps({"tokens": ["acme", "in"], "ner_tags": [5, 0]}) + "\n")
    ids = task_kinds.load_split(NER, "train", tmp_path / "ids")
    assert task_kinds.align_labels(ids, NER, ID2LABEL, 7)["label"] == [[5, 0]]


def test_first_sub_token_gets_the_word_label(ner_setup):
    model_dir, _ = ner_setup
    tokenizer = saved_tokenizer(model_dir)
    words, tags = ["johns", "went", "to", "london"], [1, 0, 0, 3]
    enc = tokenizer([words], is_split_into_words=True)
    assert tokenizer.convert_ids_to_tokens(enc["input_ids"][0]) == ["[CLS]", "john", "##s", "went", "to", "london",
                                                                    "[SEP]"]
    assert data.align_word_labels(enc.word_ids(0), tags) == [IGNORE_INDEX, 1, IGNORE_INDEX, 0, 0, 3, IGNORE_INDEX]
    # The same through the loader, padded with IGNORE_INDEX to the batch's longest sentence.
    import datasets

    ds = datasets.Dataset.from_dict({"tokens": [words, ["mary"]], "label": [tags, [1]]})
    batch = next(iter(data.make_text_dataloader(ds, NER, tokenizer, batch_size=2, words=True)))
    assert batch["labels"].tolist() == [[-100, 1, -100, 0, 0, 3, -100], [-100, 1, -100, -100, -100, -100, -100]]
    assert batch["attention_mask"].tolist()[1] == [1, 1, 1, 0, 0, 0, 0]


def test_truncation_is_counted_and_keeps_the_first_words(ner_setup):
    model_dir, _ = ner_setup
    import datasets

    ds = datasets.Dataset.from_dict({"tokens": [["johns", "went", "to", "london"], ["mary"]], "label": [[1, 0, 0, 3], [1]]})
    loader = data.make_text_dataloader(ds, NER, saved_tokenizer(model_dir), batch_size=2, max_length=5,
                                      words=True)
    assert loader.num_truncated == 1
    assert next(iter(loader))["labels"].tolist()[0] == [-100, 1, -100, 0, -100]  # [CLS] john ##s went [SEP]


def test_every_word_is_scored_once_across_batches_of_different_lengths(ner_setup):
    """predict pads each batch's tokens to the longest; no word is lost or counted twice."""
    from accelerate import Accelerator

    from luna_convert.engine.training import predict
    from luna_convert.run.models import load_model

    model_dir, data_dir = ner_setup
    loaded = load_model(str(model_dir), kind="token")
    ds = task_kinds.align_labels(task_kinds.load_split(NER, "validation", data_dir), NER, loaded.id2label,
                                 loaded.num_labels)
    loader = data.make_text_dataloader(ds, NER, loaded.tokenizer, batch_size=5, words=True)
    lengths = {len(b["labels"][0]) for b in loader}
    assert len(lengths) > 1, "the dev batches should differ in length for this test to mean something"
    logits, labels = predict(Accelerator(), loaded.model, loader)
    assert logits.shape[:2] == labels.shape and logits.shape[2] == len(TAGS)
    assert sorted(labels[labels != IGNORE_INDEX].tolist()) == sorted(t for tags in ds["label"] for t in tags)


def test_task_loss_leaves_out_ignored_tokens():
    from luna_convert.engine.training import task_loss

    logits = torch.randn(1, 3, 4, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[IGNORE_INDEX, 2, IGNORE_INDEX]])
    expected = torch.nn.functional.cross_entropy(logits[0, 1:2], labels[0, 1:2])
    assert task_loss(logits, labels).item() == pytest.approx(expected.item(), rel=1e-6)


# ------------------------------------------------------------------ entity F1


def score(gold: list[list[str]], pred: list[list[str]], ignored: set[tuple[int, int]] = frozenset()) -> dict:
    """compute_metrics on tag sequences; ``ignored`` (sentence, position) pairs are labelled IGNORE_INDEX."""
    task = dataclasses.replace(NER, label_names=TAGS)
    width = max(len(s) for s in gold)
    labels = np.full((len(gold), width), IGNORE_INDEX)
    preds = np.zeros((len(gold), width), dtype=np.int64)
    for i, (g, p) in enumerate(zip(gold, pred)):
        labels[i, :len(g)] = [TAGS.index(t) for t in g]
        preds[i, :len(p)] = [TAGS.index(t) for t in p]
    for i, j in ignored:
        labels[i, j] = IGNORE_INDEX
    return compute_metrics(task, preds, labels)


def test_entity_spans_follow_conlleval():
    assert entity_spans(["B-PER", "I-PER", "O", "B-LOC"]) == {("PER", 0, 1), ("LOC", 3, 3)}
    assert entity_spans(["O", "I-PER", "I-PER"]) == {("PER", 1, 2)}  # I- after O starts an entity
    assert entity_spans(["B-PER", "I-LOC"]) == {("PER", 0, 0), ("LOC", 1, 1)}  # another type: a new entity
    assert entity_spans(["B-PER", "B-PER"]) == {("PER", 0, 0), ("PER", 1, 1)}
    assert entity_spans(["I-PER", "B-PER", "I-PER"]) == {("PER", 0, 0), ("PER", 1, 2)}
    assert entity_spans(["S-PER", "B-LOC", "E-LOC"]) == {("PER", 0, 0), ("LOC", 1, 2)}  # IOBES
    assert entity_spans(["O", "O"]) == set()


@pytest.mark.parametrize("gold, pred, expected", [
    # perfect
    ([["B-PER", "I-PER", "O", "B-LOC"]], [["B-PER", "I-PER", "O", "B-LOC"]],
     {"entity_f1": 1.0, "entity_precision": 1.0, "entity_recall": 1.0, "token_accuracy": 1.0}),
    # partial: PER cut short (wrong span), LOC right -> 1 of 2 predicted, 1 of 2 gold; 3 of 4 tags right
    ([["B-PER", "I-PER", "O", "B-LOC"]], [["B-PER", "O", "O", "B-LOC"]],
     {"entity_f1": 0.5, "entity_precision": 0.5, "entity_recall": 0.5, "token_accuracy": 0.75}),
    # right span, wrong type: no entity found
    ([["B-PER", "I-PER"]], [["B-LOC", "I-LOC"]],
     {"entity_f1": 0.0, "entity_precision": 0.0, "entity_recall": 0.0, "token_accuracy": 0.0}),
    # I- without B- is an entity (conlleval): the same span as B-PER I-PER, though one tag differs
    ([["O", "B-PER", "I-PER", "O"]], [["O", "I-PER", "I-PER", "O"]],
     {"entity_f1": 1.0, "entity_precision": 1.0, "entity_recall": 1.0, "token_accuracy": 0.75}),
    # micro average over sentences: 2 correct of 3 predicted, of 4 gold -> P 2/3, R 1/2, F1 4/7
    ([["B-PER", "O", "B-LOC"], ["B-ORG", "I-ORG", "O", "B-PER"]], [["B-PER", "O", "B-LOC"], ["B-ORG", "O", "O", "O"]],
     {"entity_f1": 4 / 7, "entity_precision": 2 / 3, "entity_recall": 0.5, "token_accuracy": 5 / 7}),
])
def test_entity_f1_on_known_sequences(gold, pred, expected):
    assert score(gold, pred) == pytest.approx(expected, abs=1e-12)


def test_ignored_positions_are_not_part_of_the_sentence():
    """A word's second sub-token (IGNORE_INDEX) sits between B-PER and I-PER: the entity is still whole."""
    out = score([["B-PER", "O", "I-PER"]], [["B-PER", "B-LOC", "I-PER"]], ignored={(0, 1)})
    assert out == {"entity_f1": 1.0, "entity_precision": 1.0, "entity_recall": 1.0, "token_accuracy": 1.0}


@pytest.mark.skipif(seqeval_metrics is None, reason="seqeval is not installed")
def test_entity_f1_matches_seqeval_on_random_sequences():
    rng = random.Random(0)
    gold = [[rng.choice(TAGS) for _ in range(rng.randint(1, 9))] for _ in range(300)]
    pred = [[t if rng.random() < 0.6 else rng.choice(TAGS) for t in g] for g in gold]
    ours = score(gold, pred)
    assert ours["entity_f1"] == pytest.approx(seqeval_metrics.f1_score(gold, pred), abs=1e-12)
    assert ours["entity_precision"] == pytest.approx(seqeval_metrics.precision_score(gold, pred), abs=1e-12)
    assert ours["entity_recall"] == pytest.approx(seqeval_metrics.recall_score(gold, pred), abs=1e-12)


def test_token_metric_names_and_bad_tags():
    assert NER.headline == "entity_f1" and kind_of(NER).name == "token" and metric_names(NER)[0] == "entity_f1"
    assert get_task("token-classification") is NER
    with pytest.raises(LunaConvertError, match="BIO"):
        data.token_label_names({0: "O", 1: "PERSON"}, 2)
    with pytest.raises(LunaConvertError, match="generic names"):
        data.token_label_names({0: "LABEL_0", 1: "LABEL_1"}, 2)


# ------------------------------------------------------------------ a whole run


def test_ner_run_saves_a_model_that_scores_the_same(ner_setup, tmp_path):
    model_dir, data_dir = ner_setup
    results = run_conversion(config_for(model_dir, data_dir, "ner", "luna", tmp_path))
    assert results["headline_metric"] == "entity_f1" and results["eval_examples"] == 12
    assert len(results["conversion"]["modules"]) == 2  # both BERT layers, converted as in a sequence classifier
    assert set(results["converted_metrics"]) == set(metric_names(NER))
    assert 0.0 <= results["converted_score"] <= 1.0
    assert results["converted_score"] == results["converted_metrics"]["entity_f1"]
    run_dir = Path(results["run_dir"])
    model = luna_convert.load(run_dir / "model")
    assert type(model).__name__ == "BertForTokenClassification" and luna_convert.is_converted(model)
    assert evaluate_model(run_dir)["metrics"] == results["converted_metrics"]
    # The original checkpoint scores the recorded teacher score.
    teacher = evaluate_model(model_dir, task="ner", data_dir=str(data_dir))
    assert teacher["metrics"] == results["teacher_metrics"]
    card = (run_dir / "README.md").read_text()
    assert "pipeline_tag: token-classification" in card
    # The teacher really tags (entity F1 1.0 measured after finetune_teacher), so % recovered is defined,
    # and report / compare read the headline like any other.
    assert results["teacher_score"] > 0.9
    assert results["recovered_pct"] == pytest.approx(100 * results["converted_score"] / results["teacher_score"])
    (row,) = build_report([tmp_path])["rows"]
    assert row["tasks"]["ner"]["recovered_pct"] == results["recovered_pct"]
    assert summarise("luna", [results])["headline_metric"] == "entity_f1"


def write_bad(folder: Path, dev: str) -> Path:
    write_conll(folder)
    (folder / "dev.txt").write_text(dev)
    return folder


@pytest.mark.parametrize("dev, message", [
    ("john B-PER\nwent O\nparis\n", "dev.txt: line 3 ('paris') is not a word and its tag"),
    ("john B-PER\n\nmary B-MISC\n", "dev.txt line 3: tag 'B-MISC' is not among the model's tags (O, B-PER,"),
])
def test_bad_data_fails_before_the_run_folder(ner_setup, tmp_path, dev, message):
    model_dir, _ = ner_setup
    data_dir = write_bad(tmp_path / "data", dev)
    with pytest.raises(LunaConvertError) as e:
        run_conversion(config_for(model_dir, data_dir, "ner", "luna", tmp_path / "out"))
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_mismatched_head_or_slow_tokenizer_is_refused(ner_setup, tmp_path):
    model_dir, data_dir = ner_setup
    sequence_model = write_bert_checkpoint(tmp_path / "seq", words=NER_WORDS)
    with pytest.raises(LunaConvertError, match="is not a token-classification model"):
        run_conversion(config_for(sequence_model, data_dir, "ner", "luna", tmp_path / "out"))
    with pytest.raises(LunaConvertError, match="is a token-classification .NER. model .BertForTokenClassification.; "
                                               "run it with --task ner"):
        run_conversion(config_for(model_dir, data_dir, None, "luna", tmp_path / "out"))  # own data: no task
    assert not (tmp_path / "out").exists()
    import datasets

    class SlowTokenizer:  # a Python tokenizer (transformers 4's BertTokenizer, 5's PythonBackend): no word_ids()
        is_fast = False

    ds = datasets.Dataset.from_dict({"tokens": [["mary"]], "label": [[1]]})
    with pytest.raises(LunaConvertError, match="needs a fast tokenizer"):
        data.make_text_dataloader(ds, NER, SlowTokenizer(), batch_size=1, words=True)


def test_cli_malformed_file_one_line_and_exit_2(ner_setup, tmp_path):
    model_dir, _ = ner_setup
    data_dir = write_bad(tmp_path / "data", "john B-PER\nwent\n")
    result = invoke_cli("run", "--model", model_dir, "--task", "ner", "--data-dir", data_dir, "--method", "luna",
                        "--output-dir", tmp_path / "out")
    assert "line 2 ('went') is not a word and its tag" in cli_error_line(result, alone=False)
    assert not (tmp_path / "out").exists()
