"""Your own checkpoint on your own data (no recipe): task, columns, splits, labels and defaults
inferred by luna_convert.run.autoconfig; tiny models and data written here, nothing downloaded."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from luna_convert.run.autoconfig import (
    choose_hyperparameters, choose_max_length, detect_columns, infer_task, mark_auto, resolve_own_data, task_for,
)
from luna_convert.errors import LunaConvertError
from luna_convert.run.config import RunConfig
from luna_convert.run.models import load_model
from luna_convert.run.recipes import apply_overrides, load_recipe
from builders import cli_error_line, invoke_cli, write_timm_checkpoint

POS, NEG, FILL = ["good", "great", "fine"], ["awful", "bad", "poor"], "movie film plot actor the a is was very not".split()
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *POS, *NEG, *FILL]


# ------------------------------------------------------------------ builders
def tiny_bert(folder: Path, num_labels: int = 2, id2label: dict | None = None, problem_type: str | None = None,
              positions: int = 64) -> Path:
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    torch.manual_seed(0)
    extra = {"id2label": id2label, "label2id": {v: k for k, v in id2label.items()}} if id2label else {}
    config = BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                        vocab_size=len(VOCAB), max_position_embeddings=positions, num_labels=num_labels,
                        problem_type=problem_type, **extra)
    BertForSequenceClassification(config).save_pretrained(folder)
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    return folder


def sentence(rng: random.Random, positive: bool, n_fill: int = 6) -> str:
    return " ".join([rng.choice(POS if positive else NEG)] + rng.choices(FILL, k=rng.randint(1, n_fill)))


def rows(n: int, seed: int, kind: str = "single", label_names=None) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        y = i % 2
        if kind == "pair":
            out.append({"premise": sentence(rng, True), "hypothesis": sentence(rng, bool(y)),
                        "label": label_names[y] if label_names else y})
        elif kind == "regression":
            s = sentence(rng, bool(y))
            out.append({"text": s, "score": float(sum(w in POS for w in s.split()) + 0.1 * len(s.split()))})
        else:
            out.append({"review": sentence(rng, bool(y)), "stars": label_names[y] if label_names else y, "id": i})
    return out


def write_csv(path: Path, records: list[dict], header: list[str] | None = None) -> Path:
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    header = header or list(records[0])
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header)
        w.writeheader()
        w.writerows(records)
    return path


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet(path: Path, records: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def image_folder(folder: Path, classes=("cat", "dog", "fox"), per_class: int = 4) -> Path:
    from PIL import Image

    for split, n in (("train", per_class), ("val", 2)):
        for c, name in enumerate(classes):
            (folder / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.new("RGB", (16, 16), (70 * c, 20 * i, 90)).save(folder / split / name / f"{i}.png")
    return folder


def tiny_timm(folder: Path, num_classes: int = 3) -> Path:
    return write_timm_checkpoint(folder, num_classes, img_size=16, embed_dim=16, depth=1, num_heads=2)


def own_config(model: Path, data, **over) -> RunConfig:
    overrides = {"model": str(model), "data_dir": str(data), "seed": 0, **over}
    config = apply_overrides(load_recipe(None), overrides)
    return mark_auto(config, overrides)


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Path:
    return tiny_bert(tmp_path_factory.mktemp("bert") / "model")


@pytest.fixture(scope="module")
def csv_data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("csv")
    write_csv(d / "train.csv", rows(40, 1))
    write_csv(d / "dev.csv", rows(12, 2))
    return d


# ------------------------------------------------------------------ unit: inference rules
def test_infer_task_from_model_config():
    assert infer_task("image", 10) == "image-classification"
    assert infer_task("text", 3) == "text-classification"
    assert infer_task("text", 2, pair=True) == "text-pair-classification"
    assert infer_task("text", 1) == "text-regression"
    assert infer_task("text", 1, pair=True) == "text-pair-regression"
    assert infer_task("text", 1, "regression") == "text-regression"
    assert infer_task("text", 4, "single_label_classification") == "text-classification"
    with pytest.raises(LunaConvertError, match="multi-label"):
        infer_task("text", 5, "multi_label_classification")


def test_detect_columns():
    cols = {"id": ["1", "2"], "review": ["a b", "c"], "stars": ["1", "0"]}
    assert detect_columns(cols)[:3] == ("review", None, "stars")
    pair = {"premise": ["p"], "hypothesis": ["h"], "label": ["0"]}
    assert detect_columns(pair)[:3] == ("premise", "hypothesis", "label")
    assert detect_columns(pair, want_pair=False)[:3] == ("premise", None, "label")
    # Unknown names: the longest non-numeric column is the text.
    odd = {"n": ["1", "2"], "short": ["ab", "cd"], "long": ["a long text", "another long one"], "y": ["0", "1"]}
    assert detect_columns(odd)[:3] == ("long", None, "y")
    assert detect_columns(odd, text="short", pair="long", label="y")[:3] == ("short", "long", "y")
    with pytest.raises(LunaConvertError, match=r"column 'body' \(--text-column\) is not in f.csv; its columns are"):
        detect_columns(cols, text="body", where="f.csv")
    with pytest.raises(LunaConvertError, match="no label column in f.csv .*--label-column"):
        detect_columns({"review": ["x"]}, where="f.csv")
    with pytest.raises(LunaConvertError, match="--text-pair-column"):
        detect_columns({"review": ["x"], "label": ["1"]}, want_pair=True)


def test_hyperparameter_defaults():
    big = choose_hyperparameters(110_000_000, 67_349, "text")
    assert big["train.lr"][0] == 2e-5 and big["train.batch_size"][0] == 32 and big["train.epochs"][0] == 3.0
    small = choose_hyperparameters(22_700_000, 2_000, "text")
    assert small["train.lr"][0] == 5e-5 and small["train.epochs"][0] == 5.0  # 63 steps/epoch -> 315 steps
    tiny = choose_hyperparameters(22_700_000, 100, "image")
    assert tiny["train.batch_size"][0] == 64 and tiny["train.epochs"][0] == 10.0  # capped at 10 epochs
    huge = choose_hyperparameters(300_000_000, 1_000_000, "text")
    assert huge["train.epochs"][0] < 1.0  # 20k-step budget
    assert choose_max_length([5] * 99 + [300], limit=512)[0] == 16  # the 1% outlier is cut, 16 at least
    assert choose_max_length(list(range(1, 101)), limit=512)[0] == 104  # 99th percentile 99 -> 104
    assert choose_max_length([700] * 10, limit=512)[0] == 512
    assert choose_max_length([700] * 10, limit=128)[0] == 128
    assert choose_max_length([41] * 10, limit=None)[0] == 48


# ------------------------------------------------------------------ unit: resolution on real files
def test_resolve_text_csv_infers_everything(bert, csv_data):
    config = own_config(bert, csv_data)
    loaded = load_model(str(bert))
    lines = []
    resolved = resolve_own_data(config, loaded, say=lines.append)
    assert config.task == "text-classification" and resolved["task"] == "text-classification"
    assert resolved["columns"]["text"] == "review" and resolved["columns"]["label"] == "stars"
    assert resolved["data"]["train_split"] == "train" and resolved["data"]["eval_split"] == "dev"
    assert resolved["data"]["train_examples"] == 40 and resolved["data"]["eval_examples"] == 12
    assert resolved["metric"]["headline"] == "accuracy"
    assert set(resolved["metric"]["all"]) == {"accuracy", "macro_f1", "matthews_correlation"}
    assert config.train.lr == 5e-5 and config.train.batch_size == 32
    assert config.train.epochs == 10.0 and config.train.max_length == 16
    assert any("text=review" in line for line in lines)
    spec = task_for(config)
    assert spec.text_columns == ("review",) and spec.label_column == "stars" and spec.eval_split == "dev"


def test_resolve_regression_from_num_labels_and_problem_type(tmp_path):
    data = tmp_path / "data"
    write_parquet(data / "train.parquet", rows(20, 3, "regression"))
    write_parquet(data / "validation.parquet", rows(8, 4, "regression"))
    for kw in ({"num_labels": 1}, {"num_labels": 1, "problem_type": "regression"}):
        model = tiny_bert(tmp_path / f"m{len(kw)}", **kw)
        config = own_config(model, data, metric="spearman")
        resolved = resolve_own_data(config, load_model(str(model)))
        assert resolved["task"] == "text-regression" and resolved["columns"]["label"] == "score"
        assert task_for(config).headline == "spearmanr" and set(resolved["metric"]["all"]) == {"pearson", "spearmanr", "mse"}
    with pytest.raises(LunaConvertError, match="regression model"):
        resolve_own_data(own_config(model, data, task="text-classification"), load_model(str(model)))


def test_resolve_image_folder_is_image_classification(tmp_path):
    model = tiny_timm(tmp_path / "vit")
    data = image_folder(tmp_path / "images")
    config = own_config(model, data)
    resolved = resolve_own_data(config, load_model(str(model)))
    assert resolved["task"] == "image-classification" and config.train.batch_size == 12  # 64 capped at 12
    assert resolved["data"]["eval_split"] == "val" and resolved["labels"]["classes"] == ["cat", "dog", "fox"]
    assert resolved["max_length"] is None
    with pytest.raises(LunaConvertError, match="the data has 3 classes .* predicts 5"):
        resolve_own_data(own_config(tiny_timm(tmp_path / "vit5", 5), data), load_model(str(tmp_path / "vit5")))
    with pytest.raises(LunaConvertError, match="--task text-classification is for text models"):
        resolve_own_data(own_config(model, data, task="text-classification"), load_model(str(model)))


def test_saved_dataset_dict_with_classlabel_and_image_column(tmp_path):
    import datasets
    from PIL import Image

    # Text: a DatasetDict saved with save_to_disk, ClassLabel names mapped to the model's id2label order.
    model = tiny_bert(tmp_path / "bert", id2label={0: "POSITIVE", 1: "NEGATIVE"})
    feats = datasets.Features({"sentence": datasets.Value("string"), "label": datasets.ClassLabel(names=["neg", "pos"])})
    dd = datasets.DatasetDict({s: datasets.Dataset.from_list([{"sentence": r["review"], "label": r["stars"]}
                                                              for r in rows(n, seed)], features=feats)
                               for s, n, seed in (("train", 10, 5), ("validation", 6, 6))})
    dd.save_to_disk(str(tmp_path / "saved"))
    config = own_config(model, tmp_path / "saved")
    resolved = resolve_own_data(config, load_model(str(model)))
    assert resolved["data"]["source"] == "save_to_disk folder" and resolved["columns"]["text"] == "sentence"
    from luna_convert import task_kinds

    ds = task_kinds.load_split(task_for(config), "train", str(tmp_path / "saved"))
    aligned = task_kinds.align_labels(ds, task_for(config), {0: "POSITIVE", 1: "NEGATIVE"}, 2)
    assert aligned["label"] == [1 - y for y in dd["train"]["label"]]  # neg(0) -> NEGATIVE(1)

    # Images: a dataset with an image column and a ClassLabel.
    img_feats = datasets.Features({"img": datasets.Image(), "fine_label": datasets.ClassLabel(names=["a", "b", "c"])})
    recs = [{"img": Image.new("RGB", (8, 8), (40 * i, 0, 0)), "fine_label": i % 3} for i in range(6)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(recs, features=img_feats),
                          "test": datasets.Dataset.from_list(recs[:3], features=img_feats)}).save_to_disk(
        str(tmp_path / "imgs"))
    vit = tiny_timm(tmp_path / "vit")
    config = own_config(vit, tmp_path / "imgs")
    resolved = resolve_own_data(config, load_model(str(vit)))
    assert resolved["data"]["eval_split"] == "test" and resolved["columns"] == {"image": "img", "label": "fine_label"}
    img, y = task_kinds.load_split(task_for(config), "test", str(tmp_path / "imgs"))[2]
    assert img.mode == "RGB" and y == 2


def test_hub_dataset_id(tmp_path, monkeypatch, bert):
    import datasets

    from luna_convert.data import hub

    calls = []

    def fake_load_dataset(name, config=None, **kw):
        calls.append((name, config))
        return datasets.DatasetDict({s: datasets.Dataset.from_list([{"text": r["review"], "label": r["stars"]}
                                                                    for r in rows(n, 7)])
                                     for s, n in (("train", 8), ("test", 4))})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(hub, "_HUB_CACHE", {})  # empty, so the fake load_dataset answers
    config = own_config(bert, "hf:someone/reviews:plain")
    resolved = resolve_own_data(config, load_model(str(bert)))
    assert calls[0] == ("someone/reviews", "plain") and resolved["data"]["source"] == "hub dataset"
    assert resolved["data"]["eval_split"] == "test" and resolved["data"]["train_examples"] == 8


def test_max_length_beyond_model_positions_is_an_error(bert, csv_data):
    with pytest.raises(LunaConvertError, match=r"--max-length 100 needs 100 positions .* trained with 64 .*--max-length 64"):
        resolve_own_data(own_config(bert, csv_data, **{"train.max_length": 100}), load_model(str(bert)))


def test_cli_dry_run_prints_what_it_resolved(bert, csv_data, tmp_path):
    from typer.testing import CliRunner

    from luna_convert.cli import app

    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["run", "--model", str(bert), "--data-dir", str(csv_data), "--dry-run",
                                      "--lr", "1e-4", "--output-dir", str(out)])
    assert result.exit_code == 0, result.output
    printed = " ".join(result.output.split())  # rich wraps long lines
    for text in ("own data: task text-classification", "text=review label=stars", "train=train (40 examples)",
                 "eval=dev (12)", "lr 0.0001 (given)", "batch_size 32 (text default)", "max_length 16"):
        assert text in printed
    assert not out.exists()  # nothing trained or written


# ------------------------------------------------------------------ end to end
def test_regression_end_to_end(tmp_path):
    from luna_convert.run.pipeline import evaluate_model, run_conversion

    model = tiny_bert(tmp_path / "reg", num_labels=1)
    data = tmp_path / "data"
    write_jsonl(data / "train.jsonl", rows(24, 8, "regression"))
    write_jsonl(data / "dev.jsonl", rows(10, 9, "regression"))
    config = own_config(model, data, method="luna", output_dir=str(tmp_path / "out"),
                        **{"train.max_steps": 2, "train.max_length": 6})
    results = run_conversion(config)
    assert results["task"] == "text-regression" and results["headline_metric"] == "pearson"
    assert set(results["converted_metrics"]) == {"pearson", "spearmanr", "mse"}
    assert results["truncated_examples"] > 0  # max_length 6 cuts some of these texts
    saved = json.loads((Path(results["run_dir"]) / "results.json").read_text())
    assert saved["resolved"]["task"] == "text-regression" and saved["config"]["resolved"] == saved["resolved"]
    assert saved["resolved"]["hyperparameters"]["train.max_length"]["why"] == "given"
    assert saved["truncated_by_split"]["dev"] > 0
    # `luna-convert eval RUN` re-reads the resolved task (columns text/score, split dev) from the run folder.
    again = evaluate_model(results["run_dir"])
    assert again["task"] == "text-regression"
    assert again["metrics"]["pearson"] == pytest.approx(results["converted_score"], abs=1e-4)


def test_cli_pair_classification_end_to_end_and_errors(tmp_path, bert, csv_data):
    """One CLI run (pair classification, label names mapped) and every data error."""
    nli = tiny_bert(tmp_path / "nli", id2label={0: "entailment", 1: "contradiction"})
    pair = tmp_path / "pair"
    write_jsonl(pair / "train.jsonl", rows(24, 10, "pair", ["Entailment", "contradiction"]))
    write_jsonl(pair / "validation.jsonl", rows(10, 11, "pair", ["entailment", "Contradiction"]))
    bad = tmp_path / "bad"
    write_csv(bad / "train.csv", rows(12, 12, label_names=["good", "meh"]))
    write_csv(bad / "dev.csv", rows(4, 13, label_names=["good", "meh"]))
    empty = tmp_path / "empty"
    write_csv(empty / "train.csv", rows(12, 14))
    write_csv(empty / "dev.csv", [], header=["review", "stars"])
    out = tmp_path / "out"
    # in-process (tests/test_bad_input.py checks a real process's one line)
    expected = {
        "wrong column": (("--model", bert, "--data-dir", csv_data, "--text-column", "body"),
                         "column 'body' (--text-column) is not in train.csv; its columns are review, stars, id"),
        "missing column": (("--model", bert, "--data-dir", csv_data, "--task", "text-pair-classification"),
                           "needs two text columns but only 'review' was found"),
        "labels": (("--model", nli, "--data-dir", bad), "data label 'good' does not match the model's id2label"),
        "empty": (("--model", bert, "--data-dir", empty), "dev.csv is empty"),
    }
    for case, (args, message) in expected.items():
        folder = tmp_path / ("out-" + case.replace(" ", "-"))
        line = cli_error_line(invoke_cli("run", *args, "--output-dir", folder), alone=False)  # after loading bars
        assert message in line, (case, line)
        assert not folder.exists() or not any(folder.iterdir()), case
    result = invoke_cli("run", "--model", nli, "--data-dir", pair, "--method", "t2r", "--max-steps", "2",
                        "--output-dir", out)
    assert result.exit_code == 0, result.output[-2000:]
    stdout = result.stdout
    assert "own data: task text-pair-classification" in stdout and "text=premise" in stdout
    (results_file,) = out.glob("*/results.json")
    results = json.loads(results_file.read_text())
    assert results["task"] == "text-pair-classification" and results["eval_examples"] == 10
    assert results["resolved"]["columns"]["text_pair"] == "hypothesis"
    assert results["resolved"]["labels"]["mapping"] == "label names matched to the model's id2label"
    assert set(results["converted_metrics"]) == {"accuracy", "macro_f1", "matthews_correlation"}
    assert results["config"]["train"]["lr"] == 5e-5 and results["steps"]["finetune"] == 2
