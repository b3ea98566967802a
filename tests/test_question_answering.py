"""Extractive question answering (SQuAD-style): data, answer tokens, span decoding, SQuAD metrics, a whole run."""

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
from luna_convert.folder_layout import LOG_FILE
from luna_convert.metrics import normalize_answer
from luna_convert.task_kinds import best_span, compute_metrics, kind_of, metric_names, span_answers
from luna_convert.run.pipeline import run_conversion
from luna_convert.tasks import get_task
from builders import config_for, invoke_cli, write_bert_checkpoint, saved_tokenizer, train_tiny_teacher

QA = get_task("qa")
NAMES, CITIES, ORGS = ("john", "mary", "anna"), ("paris", "london", "rome"), ("acme", "globex")
QA_WORDS = [*NAMES, *CITIES, *ORGS, *"lives in and works at where does live work who the a , . ? ##s".split()]


def paragraph(rng: random.Random) -> dict:
    """One SQuAD paragraph: a made-up fact and three questions on it, answers found by character offset."""
    name, city, org = rng.choice(NAMES), rng.choice(CITIES), rng.choice(ORGS)
    context = f"{name} lives in {city} and works at {org} ."
    qas = [(f"where does {name} live ?", city), (f"who lives in {city} ?", name), (f"where does {name} work ?", org)]
    return {"context": context, "qas": [{"id": f"q{rng.randrange(10**9)}", "question": q,
                                         "answers": [{"text": a, "answer_start": context.index(a)}]} for q, a in qas]}


def squad_json(paragraphs: list[dict]) -> dict:
    return {"version": "1.1", "data": [{"title": "made up", "paragraphs": paragraphs}]}


def write_squad(folder: Path, n_train: int = 16, n_dev: int = 4) -> Path:
    """train.json and dev.json in SQuAD v1.1's layout (n paragraphs of three questions each)."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", n_train), ("dev", n_dev)):
        (folder / f"{name}.json").write_text(json.dumps(squad_json([paragraph(rng) for _ in range(n)])))
    return folder


def write_qa_checkpoint(folder: Path) -> Path:
    return write_bert_checkpoint(folder, head="QuestionAnswering", words=QA_WORDS)


def finetune_teacher(model_dir: Path, data_dir: Path, epochs: int = 10) -> None:
    """Train the tiny model on train.json so that it answers with a name, a city or an organisation (F1 1/3
    measured: the loss plateaus near log 3 by then, the question type not yet read)."""
    from luna_convert.run.models import load_model

    loaded = load_model(str(model_dir), kind="span")
    loader = data.make_qa_dataloader(task_kinds.load_split(QA, "train", data_dir), loaded.tokenizer, batch_size=8,
                                     shuffle=True)
    train_tiny_teacher(loaded, loader, model_dir, epochs)


@pytest.fixture(scope="module")
def qa_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("qa")
    model = write_qa_checkpoint(root / "bert-qa")
    squad = write_squad(root / "squad")
    finetune_teacher(model, squad)
    return model, squad



# ------------------------------------------------------------------ reading


def test_squad_json_jsonl_and_hub_layouts_read_the_same_questions(tmp_path):
    context = "mary lives in rome and works at acme ."
    rows = [("q1", "where does mary live ?", [("rome", 14)]), ("q2", "who lives in rome ?", [("mary", 0), ("mary", 0)])]
    squad = tmp_path / "squad"
    squad.mkdir()
    qas = [{"id": i, "question": q, "answers": [{"text": t, "answer_start": s} for t, s in a]} for i, q, a in rows]
    (squad / "train.json").write_text(json.dumps(squad_json([{"context": context, "qas": qas}])))
    jsonl = tmp_path / "jsonl"
    jsonl.mkdir()  # the hub's layout: answers as parallel lists
    (jsonl / "train.jsonl").write_text("".join(json.dumps(
        {"id": i, "question": q, "context": context, "answers": {"text": [t for t, _ in a],
                                                                 "answer_start": [s for _, s in a]}}) + "\n"
        for i, q, a in rows))
    import datasets

    hub = datasets.Dataset.from_dict({"id": [r[0] for r in rows], "title": ["t", "t"], "context": [context] * 2,
                                      "question": [r[1] for r in rows],
                                      "answers": [{"text": [t for t, _ in a], "answer_start": [s for _, s in a]}
                                                  for _, _, a in rows]})
    datasets.DatasetDict({"train": hub}).save_to_disk(str(tmp_path / "saved"))
    read = [task_kinds.load_split(QA, "train", d) for d in (squad, jsonl, tmp_path / "saved")]
    for ds in read:
        assert ds["id"] == ["q1", "q2"] and ds["question"] == [r[1] for r in rows] and ds["context"] == [context] * 2
        assert ds["answers"] == [["rome"], ["mary", "mary"]] and ds["answer_starts"] == [[14], [0, 0]]
    assert read[0]["source"] == ["train.json question 'q1'", "train.json question 'q2'"]  # for messages


@pytest.mark.parametrize("qa, message", [
    ({"id": "x", "answers": [{"text": "rome", "answer_start": 14}]}, "train.json question 'x': missing 'question'"),
    ({"id": "x", "question": "where ?", "answers": [{"text": "rome", "answer_start": 13}]},
     "train.json question 'x': answer 'rome' is not at answer_start 13 of the context (which reads ' rom' there)"),
    ({"id": "x", "question": "where ?", "answers": []}, "train.json question 'x': no answers"),
    ({"id": "x", "question": "where ?"}, "train.json question 'x': missing 'answers'"),
])
def test_malformed_questions_fail_with_one_line(tmp_path, qa, message):
    (tmp_path / "train.json").write_text(json.dumps(squad_json([{"context": "mary lives in rome .", "qas": [qa]}])))
    with pytest.raises(LunaConvertError) as e:
        task_kinds.load_split(QA, "train", tmp_path)
    assert message in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------ answers as tokens


def test_answer_tokens_truncation_and_the_cls_label(qa_setup):
    model_dir, _ = qa_setup
    tokenizer = saved_tokenizer(model_dir)
    context = "john lives in paris and works at acme ."
    question = "where does john work ?"
    import datasets

    ds = datasets.Dataset.from_dict({"question": [question, "who lives in paris ?"], "context": [context] * 2,
                                     "answers": [["acme"], ["john"]], "answer_starts": [[33], [0]],
                                     "source": ["a", "b"]})
    loader = data.make_qa_dataloader(ds, tokenizer, batch_size=2)
    batch = next(iter(loader))
    tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][0])
    assert tokens == ["[CLS]", "where", "does", "john", "work", "?", "[SEP]", "john", "lives", "in", "paris", "and",
                      "works", "at", "acme", ".", "[SEP]"]
    assert batch["labels"].tolist() == [[14, 14], [7, 7]]  # "acme"; "john" (both questions are 5 tokens)
    assert loader.num_truncated == 0
    first = loader.qa_examples[0]
    assert first.offsets[:7] == (None,) * 7 and first.offsets[14] == (33, 37) and first.offsets[16] is None
    assert first.answers == ("acme",)
    # Cut to 12 tokens, both contexts keep "john lives in paris": the first answer ("acme") is gone -> [CLS]
    # (0, 0); the second ("john") is still there.
    cut = data.make_qa_dataloader(ds, tokenizer, batch_size=2, max_length=12)
    assert next(iter(cut))["labels"].tolist() == [[0, 0], [7, 7]] and cut.num_truncated == 2
    assert data.answer_token_span([None, (0, 4), (5, 10), (11, 13), None], 5, 13) == (2, 3)
    assert data.answer_token_span([None, (0, 4), (5, 10), None], 5, 13) == (0, 0)  # ends past the last token


def test_a_question_too_long_for_max_length_is_one_line(qa_setup):
    import datasets

    model_dir, _ = qa_setup
    ds = datasets.Dataset.from_dict({"question": ["where does john live and where does mary work ?"],
                                     "context": ["john lives in paris ."], "answers": [["paris"]],
                                     "answer_starts": [[14]], "source": ["dev.json question 'long'"]})
    with pytest.raises(LunaConvertError, match=r"dev.json question 'long': the question alone is 10 tokens, too long "
                                               r"to leave room for the context in train.max_length 8"):
        data.make_qa_dataloader(ds, saved_tokenizer(model_dir), batch_size=1, max_length=8)


def test_task_loss_is_the_models_own_span_loss(qa_setup):
    from luna_convert.engine.training import forward_logits, task_loss
    from luna_convert.run.models import load_model

    model_dir, data_dir = qa_setup
    loaded = load_model(str(model_dir), kind="span")
    loaded.model.eval()
    batch = next(iter(data.make_qa_dataloader(task_kinds.load_split(QA, "train", data_dir), loaded.tokenizer, batch_size=4)))
    logits = forward_logits(loaded.model, batch)
    assert logits.shape == (4, 2, batch["input_ids"].shape[1])
    own = loaded.model(**{k: v for k, v in batch.items() if k != "labels"}, start_positions=batch["labels"][:, 0],
                       end_positions=batch["labels"][:, 1]).loss
    assert task_loss(logits, batch["labels"]).item() == pytest.approx(own.item(), rel=1e-6)


def test_predict_pads_start_and_end_rows_of_batches_of_different_lengths(qa_setup):
    import datasets
    from accelerate import Accelerator

    from luna_convert.engine.training import predict
    from luna_convert.run.models import load_model

    model_dir, _ = qa_setup
    loaded = load_model(str(model_dir), kind="span")
    contexts = ["john lives in paris and works at acme .", "mary lives in rome ."]
    ds = datasets.Dataset.from_dict({"question": ["who works at acme ?", "where does mary live ?"],
                                     "context": contexts, "answers": [["john"], ["rome"]],
                                     "answer_starts": [[0], [14]], "source": ["a", "b"]})
    loader = data.make_qa_dataloader(ds, loaded.tokenizer, batch_size=1)
    logits, labels = predict(Accelerator(), loaded.model, loader)
    assert logits.shape == (2, 2, 17) and labels.tolist() == [[7, 7], [10, 10]]  # 17 and 13 tokens
    assert not logits[1, :, 13:].any()  # the shorter example's padding
    answers = span_answers(logits, loader.qa_examples)
    assert all(answer and answer in context for answer, context in zip(answers, contexts)), answers


# ------------------------------------------------------------------ decoding and metrics


def test_best_span_on_hand_made_logits():
    start = np.array([9.0, 1.0, 5.0, 0.0, 2.0, 0.0])
    end = np.array([9.0, 0.0, 0.0, 4.0, 0.0, 8.0])
    context = np.array([False, True, True, True, True, True])  # position 0 ([CLS]) is not in the context
    assert best_span(start, end, context) == (2, 5)  # 5 + 8, though [CLS]'s 9 + 9 is higher
    assert best_span(start, end, context, max_answer_tokens=3) == (4, 5)  # 2..5 is 4 tokens; 2 + 8 beats 5 + 4
    # the best start comes after the best end: (start 2, end 1) would score 17, the best valid pair is 9 + 1
    assert best_span(np.array([0.0, 0.0, 9.0]), np.array([0.0, 8.0, 1.0]), np.array([True] * 3)) == (2, 2)
    assert best_span(start, end, np.zeros(6, dtype=bool)) is None


def test_span_answers_map_tokens_back_to_the_context_text():
    example = data.QAExample("Mary lives in New York.", (None, None, (0, 4), (5, 10), (11, 13), (14, 17), (18, 22),
                                                        (22, 23), None), ("New York",))
    logits = np.full((2, 2, 11), -5.0)  # padded longer than the example (a longer batch): positions 9, 10 are not its
    logits[0, 0, 5], logits[0, 1, 6] = 3.0, 3.0
    logits[1, 0, 10], logits[1, 1, 10] = 50.0, 50.0  # padding scores highest, but is outside the context
    logits[1, 0, 2], logits[1, 1, 2] = 1.0, 1.0
    assert span_answers(logits, [example, example]) == ["New York", "Mary"]
    cut = data.QAExample("Mary lives here.", (None, None, None), ("Mary",))  # no context token left
    assert span_answers(np.zeros((1, 2, 3)), [cut]) == [""]


@pytest.mark.parametrize("predictions, golds, expected", [
    (["Paris"], [["Paris"]], {"exact_match": 1.0, "f1": 1.0}),
    # case, articles and punctuation are normalised away: "the Eiffel-Tower!" -> "eiffeltower", the second answer
    (["the Eiffel-Tower!"], [["Eiffel Tower", "The EiffelTower"]], {"exact_match": 1.0, "f1": 1.0}),
    # partial overlap: "new york city" vs "new york": P 2/3, R 1 -> F1 0.8
    (["New York City"], [["New York"]], {"exact_match": 0.0, "f1": 0.8}),
    # the best of several gold answers counts: "louis xiv" shares 1 of 2 words with "king louis" (F1 0.5) and
    # is the second answer exactly (F1 1.0)
    (["Louis XIV."], [["king louis", "Louis XIV"]], {"exact_match": 1.0, "f1": 1.0}),
    # words counted with repeats: "b b c" and "b c c" share one b and one c: P = R = 2/3
    (["b b c"], [["b c c"]], {"exact_match": 0.0, "f1": 2 / 3}),
    # v1.1's script: both normalise to "" (an exact match) but share no word (F1 0)
    (["The"], [["a"]], {"exact_match": 1.0, "f1": 0.0}),
    # an empty prediction (context truncated away) scores 0; the mean over questions: (1 + 0) / 2, (1 + 0) / 2
    (["rome", ""], [["Rome"], ["paris"]], {"exact_match": 0.5, "f1": 0.5}),
    # the average over questions of the per-question best: F1 (0.8 + 0 + 1) / 3, EM 1 / 3
    (["New York City", "london", "an apple"], [["New York"], ["paris"], ["apple"]],
     {"exact_match": 1 / 3, "f1": 1.8 / 3}),
])
def test_squad_metrics_on_known_answers(predictions, golds, expected):
    assert compute_metrics(QA, predictions, golds) == pytest.approx(expected, abs=1e-12)


def test_squad_normalisation_and_metric_names():
    assert normalize_answer("  The  Cat's (a) pyjamas, AN owl ") == "cats pyjamas owl"
    assert normalize_answer("theatre") == "theatre"  # an article inside a word stays
    assert metric_names(QA) == ("f1", "exact_match") and QA.headline == "f1" and kind_of(QA).name == "span"
    assert get_task("squad") is QA and get_task("question-answering") is QA
    with pytest.raises(LunaConvertError, match="2 predicted answers but 1 questions"):
        compute_metrics(QA, ["a", "b"], [["a"]])


def test_span_logits_distillation_leaves_padding_out():
    from luna_convert.ops.reference import logits_distillation_loss

    g = torch.Generator().manual_seed(0)
    teacher, student = torch.randn(2, 2, 5, generator=g), torch.randn(2, 2, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    loss = logits_distillation_loss(teacher, student, mask, over_positions=True)
    rows = [(b, r, int(mask[b].sum())) for b in range(2) for r in range(2)]
    want = torch.stack([torch.nn.functional.kl_div(student[b, r, :n].log_softmax(-1), teacher[b, r, :n].log_softmax(-1),
                                                   log_target=True, reduction="sum") for b, r, n in rows]).mean()
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)  # float32: measured 1e-8 relative
    changed = student.clone()
    changed[1, :, 3:] = 100.0  # padding: whatever the student puts there does not count
    assert logits_distillation_loss(teacher, changed, mask, over_positions=True).item() == pytest.approx(loss.item())


# ------------------------------------------------------------------ conversion and whole runs


def test_conversion_keeps_the_qa_head():
    import transformers

    config = transformers.BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BertForQuestionAnswering(config).eval()
    head = {k: v.clone() for k, v in model.qa_outputs.state_dict().items()}
    report = luna_convert.convert(model, "luna")
    assert len(report.modules) == 2 and luna_convert.is_converted(model)
    assert all(torch.equal(model.qa_outputs.state_dict()[k], v) for k, v in head.items())
    out = model(input_ids=torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(0)))
    assert out.start_logits.shape == out.end_logits.shape == (2, 9)


def test_qa_run_through_the_cli_and_eval_of_its_folder(qa_setup, tmp_path):
    """A whole run (luna: attention distillation, then finetuning on the span loss) from the command line."""
    from luna_convert.run.pipeline import evaluate_model

    model_dir, data_dir = qa_setup
    result = invoke_cli("run", "--model", model_dir, "--data-dir", data_dir, "--task", "qa", "--method", "luna",
                        "--output-dir", tmp_path, "--set", "train.max_steps=3", "--set", "train.batch_size=8",
                        "--set", "distill.default_steps=2", "--lr", "0.001", "--seed", "0")
    assert result.exit_code == 0, result.output[-3000:]
    (results_file,) = tmp_path.glob("*/results.json")
    results = json.loads(results_file.read_text())
    assert results["task"] == "qa" and results["headline_metric"] == "f1" and results["eval_examples"] == 12
    assert set(results["converted_metrics"]) == set(results["teacher_metrics"]) == {"f1", "exact_match"}
    assert results["steps"] == {"distill": 2, "finetune": 3}
    assert results["converted_score"] == results["converted_metrics"]["f1"]
    # the teacher answers some questions (F1 1/3 measured after finetune_teacher), so % recovered is defined
    assert results["teacher_score"] > 0.3
    assert results["recovered_pct"] == pytest.approx(100 * results["converted_score"] / results["teacher_score"])
    run_dir = results_file.parent
    model = luna_convert.load(run_dir / "model")
    assert type(model).__name__ == "BertForQuestionAnswering" and luna_convert.is_converted(model)
    assert evaluate_model(run_dir)["metrics"] == results["converted_metrics"]
    assert evaluate_model(model_dir, task="qa", data_dir=str(data_dir))["metrics"] == results["teacher_metrics"]
    assert "pipeline_tag: question-answering" in (run_dir / "README.md").read_text()


def test_logits_distillation_runs_on_start_and_end_rows(qa_setup, tmp_path):
    model_dir, data_dir = qa_setup
    config = config_for(model_dir, data_dir, "qa", "luna", tmp_path, max_steps=1)
    config.distill.target = "logits"
    results = run_conversion(config)
    assert results["steps"]["distill"] == 2 and np.isfinite(results["final_loss"])
    log = [json.loads(line) for line in (Path(results["run_dir"]) / LOG_FILE).read_text().splitlines()]
    losses = [entry["loss"] for entry in log if entry.get("stage") == "distill"]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses), losses  # a KL over positions, not NaN


@pytest.mark.parametrize("head, task, message", [
    ("QuestionAnswering", "sst2", "is a question-answering model (BertForQuestionAnswering); run it with --task qa"),
    ("Sequence", "qa", "is not a question-answering model (its architectures: BertForSequenceClassification); "
                       "--task qa needs one, e.g. BertForQuestionAnswering"),
])
def test_a_head_of_another_kind_is_refused(tmp_path, head, task, message):
    model_dir = write_bert_checkpoint(tmp_path / "model", head=head, words=QA_WORDS)
    data_dir = write_squad(tmp_path / "squad", 2, 1)
    with pytest.raises(LunaConvertError) as e:
        run_conversion(config_for(model_dir, data_dir, task, "luna", tmp_path / "out"))
    assert message in str(e.value)
    assert not (tmp_path / "out").exists()


def test_bad_data_fails_before_the_run_folder(qa_setup, tmp_path):
    model_dir, _ = qa_setup
    data_dir = write_squad(tmp_path / "squad", 2, 1)
    dev = json.loads((data_dir / "dev.json").read_text())
    dev["data"][0]["paragraphs"][0]["qas"][1]["answers"][0]["answer_start"] += 1
    (data_dir / "dev.json").write_text(json.dumps(dev))
    with pytest.raises(LunaConvertError, match=r"dev.json question '.*': answer '.*' is not at answer_start"):
        run_conversion(config_for(model_dir, data_dir, "qa", "luna", tmp_path / "out"))
    assert not (tmp_path / "out").exists()
