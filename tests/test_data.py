"""Data loading: GLUE TSV layouts, CSV/JSONL/parquet, errors, label alignment, DataLoaders,
ImageFolder, scikit-learn digits, and the real SST-2 dev set when it is present."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from luna_convert.data import (
    image_transform,
    make_image_dataloader,
    make_text_dataloader,
)
from luna_convert.errors import LunaConvertError
from luna_convert.task_kinds import align_labels, load_split
from luna_convert.tasks import get_task
from conftest import shared_data


def write_tsv(path: Path, rows: list[list[str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ------------------------------------------------------------------ GLUE TSV layouts


def test_sst2_tsv_with_quotes(tmp_path):
    write_tsv(tmp_path / "train.tsv", [
        ["sentence", "label"],
        ['a "quoted phrase that never closes', "1"],
        ["plain bad movie", "0"],
        ["it 's \" great \"", "1"],
    ])
    ds = load_split(get_task("sst2"), "train", tmp_path)
    assert ds.column_names == ["sentence", "label"]
    assert ds["label"] == [1, 0, 1]
    assert ds[0]["sentence"] == 'a "quoted phrase that never closes'
    assert ds[2]["sentence"] == 'it \'s " great "'


def test_sst2_test_split_without_labels(tmp_path):
    write_tsv(tmp_path / "test.tsv", [["index", "sentence"], ["0", "fine"], ["1", "awful"]])
    ds = load_split("sst2", "test", tmp_path)
    assert ds["sentence"] == ["fine", "awful"] and ds["label"] == [-1, -1]


def test_cola_no_header(tmp_path):
    write_tsv(tmp_path / "dev.tsv", [
        ["gj04", "1", "", "The sailors rode the breeze clear of the rocks."],
        ["gj04", "0", "*", "The more we study verbs, the crazier they get get."],
        ["clc95", "1", "", 'He said "hello".'],
    ])
    ds = load_split(get_task("cola"), "validation", tmp_path)
    assert ds.column_names == ["sentence", "label"]
    assert len(ds) == 3  # the first row is data, not a header
    assert ds["label"] == [1, 0, 1]
    assert ds[2]["sentence"] == 'He said "hello".'


def test_cola_test_with_header(tmp_path):
    write_tsv(tmp_path / "test.tsv", [["index", "sentence"], ["0", "Bill whistled past the house."]])
    ds = load_split("cola", "test", tmp_path)
    assert ds["label"] == [-1] and ds["sentence"] == ["Bill whistled past the house."]


def test_mrpc_header_with_bom(tmp_path):
    path = tmp_path / "train.tsv"
    rows = [["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
            ["1", "702876", "702977", "Amrozi accused his brother .", "Referring to him as \"the witness\" ."],
            ["0", "2108705", "2108831", "Yucaipa owned Dominick 's .", "Yucaipa bought Dominick 's in 1995 ."]]
    path.write_text("\ufeff" + "".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")
    ds = load_split("mrpc", "train", tmp_path)
    assert ds.column_names == ["sentence1", "sentence2", "label"]
    assert ds["label"] == [1, 0]
    assert ds[0]["sentence2"] == 'Referring to him as "the witness" .'


def test_stsb_float_scores(tmp_path):
    header = ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2", "score"]
    write_tsv(tmp_path / "dev.tsv", [
        header,
        ["0", "main-captions", "MSRvid", "2012test", "0000", "none", "none", "A man plays.", "A man is playing.", "5.000"],
        ["1", "main-captions", "MSRvid", "2012test", "0002", "none", "none", "A cat.", "A dog runs.", "0.500"],
    ])
    ds = load_split(get_task("stsb"), "validation", tmp_path)
    assert ds.column_names == ["sentence1", "sentence2", "label"]
    assert ds["label"] == pytest.approx([5.0, 0.5])
    assert isinstance(ds[0]["label"], float)


def test_qqp_skips_malformed_rows(tmp_path):
    write_tsv(tmp_path / "train.tsv", [
        ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
        ["1", "1", "2", "How do I learn Python?", "What is the best way to learn Python?", "1"],
        ["2", "3", "4", "broken row"],
        ["3", "5", "6", "Why is the sky blue?", "How tall is Everest?", "0"],
    ])
    ds = load_split("qqp", "train", tmp_path)
    assert ds.column_names == ["question1", "question2", "label"]
    assert ds["label"] == [1, 0] and ds["question2"][1] == "How tall is Everest?"


def test_mnli_label_names_and_matched_file(tmp_path):
    header = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
              "sentence1_parse", "sentence2_parse", "sentence1", "sentence2",
              "label1", "label2", "label3", "label4", "label5", "gold_label"]
    pad = ["x"] * 4

    def row(i, p, h, gold):
        return [str(i), "1", "1e", "fiction"] + pad + [p, h] + [gold] * 5 + [gold]

    write_tsv(tmp_path / "dev_matched.tsv", [
        header,
        row(0, "The new rights are nice.", "Everyone loves them.", "neutral"),
        row(1, "This site includes a list.", "The site has a list.", "entailment"),
        row(2, "He went out.", "He stayed in.", "contradiction"),
        row(3, "Ambiguous.", "Unclear.", "-"),  # no gold label: skipped
    ])
    write_tsv(tmp_path / "dev_mismatched.tsv", [header, row(0, "A.", "B.", "Contradiction")])
    task = get_task("mnli")
    ds = load_split(task, task.eval_split, tmp_path)
    assert ds.column_names == ["premise", "hypothesis", "label"]
    assert ds["label"] == [1, 0, 2]  # entailment, neutral, contradiction = 0, 1, 2
    assert ds["premise"][0] == "The new rights are nice."
    assert load_split(task, "validation", tmp_path)["label"] == [1, 0, 2]  # "validation" -> matched
    mm = load_split(task, "validation_mismatched", tmp_path)
    assert mm["label"] == [2]
    assert load_split("mnli_mismatched", "validation", tmp_path)["label"] == [2]


def test_qnli_and_rte_label_names(tmp_path):
    write_tsv(tmp_path / "QNLI" / "dev.tsv", [
        ["index", "question", "sentence", "label"],
        ["0", "What came into force?", "The law came into force.", "entailment"],
        ["1", "Who won?", "It rained.", "not_entailment"],
    ])
    write_tsv(tmp_path / "RTE" / "train.tsv", [
        ["index", "sentence1", "sentence2", "label"],
        ["0", "Dana Reeve died.", "Christopher Reeve had an accident.", "not_entailment"],
        ["1", "Yet, we now are.", "We are.", "entailment"],
    ])
    q = load_split("qnli", "validation", tmp_path / "QNLI")
    assert q.column_names == ["question", "sentence", "label"] and q["label"] == [0, 1]
    # a GLUE root folder holding RTE/ is accepted too
    r = load_split("rte", "train", tmp_path)
    assert r.column_names == ["sentence1", "sentence2", "label"] and r["label"] == [1, 0]


def test_tsv_with_hub_column_names(tmp_path):
    write_tsv(tmp_path / "train.tsv", [["premise", "hypothesis", "label"], ["p", "h", "neutral"], ["q", "i", "2"]])
    assert load_split("mnli", "train", tmp_path)["label"] == [1, 2]
    write_tsv(tmp_path / "c" / "train.tsv", [["sentence", "label"], ["They drank the pub.", "0"]])
    ds = load_split("cola", "train", tmp_path / "c")
    assert ds["sentence"] == ["They drank the pub."] and ds["label"] == [0]


def test_unknown_label_name_errors(tmp_path):
    write_tsv(tmp_path / "train.tsv", [["index", "sentence1", "sentence2", "label"], ["0", "a", "b", "maybe"]])
    with pytest.raises(LunaConvertError, match="maybe") as e:
        load_split("rte", "train", tmp_path)
    assert "entailment" in str(e.value) and str(tmp_path / "train.tsv") in str(e.value)


def test_glue_tsv_wrong_header_errors(tmp_path):
    write_tsv(tmp_path / "train.tsv", [["text", "label"], ["hello", "1"]])
    with pytest.raises(LunaConvertError, match="sentence") as e:
        load_split("sst2", "train", tmp_path)
    assert "train.tsv" in str(e.value)


# ------------------------------------------------------------------ csv / jsonl / parquet


def test_csv_jsonl_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "train.csv").write_text('sentence,label\n"good, really",1\nbad,0\n', encoding="utf-8")
    (tmp_path / "dev.jsonl").write_text(
        json.dumps({"sentence": "ok", "label": 1}) + "\n\n" + json.dumps({"sentence": "meh", "label": 0}) + "\n")
    pq.write_table(pa.table({"sentence": ["x", "y", "z"], "label": [0, 1, 1]}), tmp_path / "test.parquet")
    task = get_task("sst2")
    tr = load_split(task, "train", tmp_path)
    assert tr["sentence"] == ["good, really", "bad"] and tr["label"] == [1, 0]
    va = load_split(task, "validation", tmp_path)
    assert va["sentence"] == ["ok", "meh"] and va["label"] == [1, 0]
    te = load_split(task, "test", tmp_path)
    assert te["label"] == [0, 1, 1] and te.column_names == ["sentence", "label"]


def test_json_array_and_label_names_in_csv(tmp_path):
    (tmp_path / "validation.json").write_text(json.dumps([
        {"premise": "p1", "hypothesis": "h1", "label": "contradiction"},
        {"premise": "p2", "hypothesis": "h2", "label": "Entailment"},
    ]))
    ds = load_split("mnli", "validation_matched", tmp_path)
    assert ds.column_names == ["premise", "hypothesis", "label"] and ds["label"] == [2, 0]


def test_generic_tasks_columns_and_aliases(tmp_path):
    (tmp_path / "train.csv").write_text("text,label\nhello,pos\nbye,neg\n", encoding="utf-8")
    (tmp_path / "dev.jsonl").write_text(
        "".join(json.dumps({"sentence1": a, "sentence2": b, "score": s}) + "\n" for a, b, s in
                [("a", "b", 0.5), ("c", "d", 4.0)]))
    ds = load_split("text-classification", "train", tmp_path)
    assert ds.column_names == ["sentence", "label"]
    assert ds["label"] == ["pos", "neg"]  # names kept for align_labels
    reg = load_split("text-pair-regression", "validation", tmp_path)
    assert reg["label"] == pytest.approx([0.5, 4.0]) and reg.column_names == ["sentence1", "sentence2", "label"]


# ------------------------------------------------------------------ errors


def test_missing_data_dir(tmp_path):
    with pytest.raises(LunaConvertError, match="does not exist") as e:
        load_split("sst2", "train", tmp_path / "nope")
    assert str(tmp_path / "nope") in str(e.value) and "\n" not in str(e.value)


def test_missing_split_file(tmp_path):
    write_tsv(tmp_path / "train.tsv", [["sentence", "label"], ["x", "1"]])
    with pytest.raises(LunaConvertError) as e:
        load_split("sst2", "validation", tmp_path)
    msg = str(e.value)
    assert "dev.tsv" in msg and str(tmp_path) in msg and "train.tsv" in msg


def test_wrong_columns(tmp_path):
    (tmp_path / "train.csv").write_text("foo,bar\n1,2\n", encoding="utf-8")
    with pytest.raises(LunaConvertError) as e:
        load_split("text-pair-classification", "train", tmp_path)
    msg = str(e.value)
    assert "train.csv" in msg and "sentence1" in msg and "foo" in msg
    (tmp_path / "dev.csv").write_text("sentence1,sentence2\na,b\n", encoding="utf-8")
    with pytest.raises(LunaConvertError, match="no label column"):
        load_split("text-pair-classification", "validation", tmp_path)


@pytest.mark.parametrize("name,content", [
    ("train.tsv", ""), ("train.csv", "sentence,label\n"), ("train.jsonl", "\n"),
])
def test_empty_files(tmp_path, name, content):
    (tmp_path / name).write_text(content, encoding="utf-8")
    with pytest.raises(LunaConvertError, match="empty|no examples") as e:
        load_split("sst2", "train", tmp_path)
    assert name in str(e.value)


def test_empty_glue_tsv_with_header_only(tmp_path):
    write_tsv(tmp_path / "train.tsv", [["sentence", "label"]])
    with pytest.raises(LunaConvertError, match="no examples"):
        load_split("sst2", "train", tmp_path)


def test_hub_offline_error_is_helpful(tmp_path, monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    # offline, with empty caches: must fail fast with a one-line hint, even where GLUE is cached
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(LunaConvertError) as e:
        load_split("rte", "train")
    msg = str(e.value)
    assert "--data-dir" in msg and "--model" in msg and "\n" not in msg


def test_generic_task_without_data_dir_errors():
    with pytest.raises(LunaConvertError, match="--data-dir"):
        load_split("text-classification", "train")
    with pytest.raises(LunaConvertError, match="--data-dir"):
        load_split("cifar10", "train")


# ------------------------------------------------------------------ max_examples


def test_max_examples_deterministic(tmp_path):
    rows = [["sentence", "label"]] + [[f"s{i}", str(i % 2)] for i in range(50)]
    write_tsv(tmp_path / "train.tsv", rows)
    write_tsv(tmp_path / "dev.tsv", rows)
    a = load_split("sst2", "train", tmp_path, max_examples=10, seed=3)
    b = load_split("sst2", "train", tmp_path, max_examples=10, seed=3)
    c = load_split("sst2", "train", tmp_path, max_examples=10, seed=4)
    assert a["sentence"] == b["sentence"] and len(a) == 10
    assert a["sentence"] != c["sentence"]
    assert a["sentence"] != [f"s{i}" for i in range(10)]  # shuffled before taking N
    dev = load_split("sst2", "validation", tmp_path, max_examples=5, seed=3)
    assert dev["sentence"] == [f"s{i}" for i in range(5)]  # eval: the first N
    assert len(load_split("sst2", "validation", tmp_path, max_examples=500)) == 50


# ------------------------------------------------------------------ align_labels


def _nli_dataset(labels):
    import datasets

    return datasets.Dataset.from_dict({"premise": ["p"] * len(labels), "hypothesis": ["h"] * len(labels),
                                       "label": labels})


def test_align_labels_permutes_by_model_names():
    task = get_task("mnli")
    ds = _nli_dataset([0, 1, 2, 0])  # entailment, neutral, contradiction, entailment
    id2label = {0: "CONTRADICTION", 1: "NEUTRAL", 2: "ENTAILMENT"}  # e.g. roberta-large-mnli
    out = align_labels(ds, task, id2label, 3)
    assert out["label"] == [2, 1, 0, 2]
    # string keys as in config.json, same order as GLUE: unchanged
    same = align_labels(ds, task, {"0": "entailment", "1": "neutral", "2": "contradiction"}, 3)
    assert same["label"] == [0, 1, 2, 0]


def test_align_labels_classlabel_feature():
    import datasets

    features = datasets.Features({"sentence": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["negative", "positive"])})
    ds = datasets.Dataset.from_dict({"sentence": ["a", "b"], "label": [0, 1]}, features=features)
    out = align_labels(ds, get_task("sst2"), {0: "POSITIVE", 1: "NEGATIVE"}, 2)
    assert out["label"] == [1, 0] and out.column_names == ["sentence", "label"]
    assert align_labels(ds, get_task("sst2"), {0: "neg", 1: "pos"}, 2)["label"] == [0, 1]


def test_align_labels_generic_names_keep_indices():
    ds = _nli_dataset([0, 1, 2])
    out = align_labels(ds, get_task("mnli"), {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}, 3)
    assert out["label"] == [0, 1, 2]
    assert align_labels(ds, get_task("mnli"), None, 3)["label"] == [0, 1, 2]


def test_align_labels_string_labels():
    import datasets

    ds = datasets.Dataset.from_dict({"sentence": ["a", "b", "c"], "label": ["pos", "Negative", "positive"]})
    task = get_task("text-classification")
    out = align_labels(ds, task, {0: "NEGATIVE", 1: "POSITIVE"}, 2)
    assert out["label"] == [1, 0, 1]
    assert out.features["label"].dtype == "int64"
    with pytest.raises(LunaConvertError, match="generic"):
        align_labels(ds, task, {0: "LABEL_0", 1: "LABEL_1"}, 2)
    with pytest.raises(LunaConvertError, match="'pos'"):
        align_labels(ds, task, {0: "cat", 1: "dog"}, 2)


def test_align_labels_errors_on_mismatch():
    ds = _nli_dataset([0, 1, 2])
    with pytest.raises(LunaConvertError, match="do not include"):
        align_labels(ds, get_task("mnli"), {0: "positive", 1: "negative", 2: "other"}, 3)
    with pytest.raises(LunaConvertError, match="3 distinct label"):
        align_labels(ds, get_task("mnli"), None, 2)


def test_align_labels_regression_untouched():
    import datasets

    ds = datasets.Dataset.from_dict({"sentence1": ["a"], "sentence2": ["b"], "label": [3.5]})
    assert align_labels(ds, get_task("stsb"), None, 1) is ds


# ------------------------------------------------------------------ text dataloader


@pytest.fixture()
def tokenizer(tmp_path):
    from transformers import BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "a", "cat", "dog", "sat", "on", "mat", "##s", "."]
    d = tmp_path / "tok"
    d.mkdir()
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return BertTokenizerFast.from_pretrained(str(d))


def test_text_dataloader_pairs_padding_and_truncation(tokenizer):
    import datasets

    ds = datasets.Dataset.from_dict({
        "premise": ["the cat sat", "the cat sat on the mat on the mat on the mat", "a dog"],
        "hypothesis": ["a cat", "the dogs", "a cat sat"],
        "label": [0, 2, 1],
    })
    loader = make_text_dataloader(ds, get_task("mnli"), tokenizer, batch_size=2, max_length=10)
    assert loader.num_truncated == 1
    batches = list(loader)
    assert len(batches) == 2
    b = batches[0]
    assert set(b) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
    assert b["input_ids"].shape == (2, 10) and b["input_ids"].dtype == torch.long
    assert b["labels"].tolist() == [0, 2] and b["labels"].dtype == torch.long
    # first example: [CLS] the cat sat [SEP] a cat [SEP] = 8 tokens, padded with 0 to 10
    assert b["attention_mask"][0].tolist() == [1] * 8 + [0] * 2
    assert b["input_ids"][0, :8].tolist() == [2, 5, 7, 9, 3, 6, 7, 3]
    assert b["input_ids"][0, 8:].tolist() == [0, 0]
    assert b["token_type_ids"][0].tolist() == [0] * 5 + [1] * 3 + [0] * 2
    # dynamic padding: the last batch is as long as its own longest example
    # ([CLS] a dog [SEP] a cat sat [SEP]), not to max_length
    assert batches[1]["input_ids"].shape == (1, 8)
    assert batches[1]["attention_mask"].sum().item() == 8
    single = make_text_dataloader(ds, get_task("mnli"), tokenizer, batch_size=1, max_length=10)
    assert [b["input_ids"].shape[1] for b in single] == [8, 10, 8]


def test_text_dataloader_regression_and_shuffle_determinism(tokenizer):
    import datasets

    ds = datasets.Dataset.from_dict({"sentence": ["the cat"] * 20, "label": [float(i) for i in range(20)]})
    task = get_task("text-regression")

    def order(seed):
        loader = make_text_dataloader(ds, task, tokenizer, batch_size=5, shuffle=True, seed=seed)
        return [x for b in loader for x in b["labels"].tolist()]

    assert order(7) == order(7)
    assert order(7) != order(8)
    assert sorted(order(7)) == [float(i) for i in range(20)]
    loader = make_text_dataloader(ds, task, tokenizer, batch_size=4)
    b = next(iter(loader))
    assert b["labels"].dtype == torch.float32 and b["labels"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert loader.num_truncated == 0


def test_text_dataloader_rejects_string_labels(tokenizer):
    import datasets

    ds = datasets.Dataset.from_dict({"sentence": ["a"], "label": ["pos"]})
    with pytest.raises(LunaConvertError, match="align_labels"):
        make_text_dataloader(ds, get_task("text-classification"), tokenizer, batch_size=1)


# ------------------------------------------------------------------ images


def _write_image_folder(root: Path, split: str, classes: dict[str, int], size=(12, 10)):
    from PIL import Image

    for k, (cls, n) in enumerate(classes.items()):
        d = root / split / cls
        d.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            arr = np.full((size[1], size[0], 3), 40 * k + i, dtype=np.uint8)
            ext = "png" if i % 2 == 0 else "jpg"
            Image.fromarray(arr).save(d / f"img{i}.{ext}")


def test_image_folder_classes_and_items(tmp_path):
    _write_image_folder(tmp_path, "train", {"zebra": 2, "ant": 3})
    _write_image_folder(tmp_path, "val", {"zebra": 2, "ant": 1, "bee": 1})
    (tmp_path / "train" / "ant" / "notes.txt").write_text("not an image")
    task = get_task("image-classification")
    tr = load_split(task, "train", tmp_path)
    assert tr.classes == ["ant", "bee", "zebra"]  # union of split folders, sorted
    assert len(tr) == 5
    assert sorted(tr.targets) == [0, 0, 0, 2, 2]
    img, y = tr[0]
    assert img.mode == "RGB" and img.size == (12, 10) and y == 0
    va = load_split(task, "validation", tmp_path)  # "val" folder accepted
    assert va.classes == tr.classes and len(va) == 4
    sub = load_split(task, "validation", tmp_path, max_examples=3)
    assert sorted(sub.targets) == [0, 1, 2]  # eval subset is class-balanced


def test_image_folder_errors(tmp_path):
    with pytest.raises(LunaConvertError, match="no folder for split"):
        load_split("image-classification", "train", tmp_path)
    (tmp_path / "train").mkdir()
    with pytest.raises(LunaConvertError, match="no class folders"):
        load_split("image-classification", "train", tmp_path)
    (tmp_path / "train" / "cls").mkdir()
    with pytest.raises(LunaConvertError, match="no images"):
        load_split("image-classification", "train", tmp_path)


def test_image_dataloader_and_transforms(tmp_path):
    _write_image_folder(tmp_path, "train", {"a": 3, "b": 3}, size=(40, 30))
    ds = load_split("image-classification", "train", tmp_path)
    mean, std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    for train in (True, False):
        tf = image_transform(mean, std, 16, train=train)
        loader = make_image_dataloader(ds, tf, batch_size=4, shuffle=train, seed=1)
        batches = list(loader)
        assert [b["pixel_values"].shape for b in batches] == [(4, 3, 16, 16), (2, 3, 16, 16)]
        assert batches[0]["pixel_values"].dtype == torch.float32
        assert batches[0]["labels"].dtype == torch.long
    eval_tf = image_transform(mean, std, 16, train=False)
    x = eval_tf(ds[0][0])
    assert x.shape == (3, 16, 16) and torch.allclose(x, x.flatten()[0].expand_as(x))  # a flat image stays flat

    def order(seed):
        return [y for b in make_image_dataloader(ds, eval_tf, batch_size=2, shuffle=True, seed=seed)
                for y in b["labels"].tolist()]

    assert order(5) == order(5)
    workers = make_image_dataloader(ds, eval_tf, batch_size=3, num_workers=1)
    assert [b["labels"].tolist() for b in workers] == [[0, 0, 0], [1, 1, 1]]


def test_align_labels_images_by_class_names(tmp_path):
    _write_image_folder(tmp_path, "train", {"cat": 1, "dog": 1})
    ds = load_split("image-classification", "train", tmp_path)
    out = align_labels(ds, get_task("image-classification"), {0: "dog", 1: "cat"}, 2)
    assert out.targets == [1, 0]
    assert out[0][1] == 1
    # names that do not match (e.g. ImageNet descriptions vs folder ids) keep indices
    kept = load_split("image-classification", "train", tmp_path)
    assert align_labels(kept, get_task("image-classification"), {0: "tench", 1: "goldfish"}, 2).targets == [0, 1]
    with pytest.raises(LunaConvertError, match="2 classes"):
        align_labels(kept, get_task("image-classification"), None, 1)


# ------------------------------------------------------------------ digits


def test_digits_split_sizes_and_determinism():
    tr = load_split("digits", "train")
    va = load_split("digits", "validation")
    assert len(tr) == 1437 and len(va) == 360
    assert tr.classes == [str(i) for i in range(10)]
    # stratified: every class in both splits, in proportion
    counts = np.bincount(va.targets, minlength=10)
    assert counts.min() >= 34 and counts.max() <= 38
    img, y = tr[0]
    assert img.mode == "RGB" and img.size == (32, 32) and 0 <= y < 10
    again = load_split("digits", "train", data_dir="/ignored/for/digits")
    assert again.targets == tr.targets
    assert np.array_equal(np.asarray(again[5][0]), np.asarray(tr[5][0]))
    small = load_split("digits", "train", max_examples=50, seed=2)
    assert len(small) == 50 and small.targets == load_split("digits", "train", max_examples=50, seed=2).targets
    with pytest.raises(LunaConvertError, match="split"):
        load_split("digits", "test")


# ------------------------------------------------------------------ real data


def test_real_sst2_dev():
    folder = shared_data("glue", "SST-2")  # LUNA_SHARED_DATA, else ../shared/data beside the checkout
    task = get_task("sst2")
    ds = load_split(task, "validation", folder)
    assert len(ds) == 872
    assert ds.column_names == ["sentence", "label"]
    assert set(ds["label"]) == {0, 1}
    assert ds[0]["sentence"] == "one long string of cliches ."
    # the GLUE root folder works as well
    assert len(load_split(task, "validation", folder.parent)) == 872
