"""End to end: tiny models and tiny data written here, the real pipeline and CLI."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import luna_convert
from luna_convert.run.pipeline import evaluate_model, run_conversion
from luna_convert.run.recipes import apply_overrides, load_recipe

WORDS = "good great fine awful bad poor movie film plot actor the a is was very not".split()
RESULT_FIELDS = {"teacher_score", "converted_score", "recovered_pct", "teacher_metrics", "converted_metrics",
                 "config", "versions", "seed", "timings", "steps", "headline_metric", "eval_examples", "conversion"}


def write_sst2(folder: Path, n_train: int = 48, n_dev: int = 20) -> Path:
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.tsv", n_train), ("dev.tsv", n_dev)):
        rows = ["sentence\tlabel"]
        for _ in range(n):
            label = rng.randint(0, 1)
            words = [rng.choice(WORDS[:3] if label else WORDS[3:6])] + rng.choices(WORDS[6:], k=rng.randint(2, 9))
            rows.append(" ".join(rng.sample(words, len(words))) + f"\t{label}")
        (folder / name).write_text("\n".join(rows) + "\n")
    return folder


def write_bert_checkpoint(folder: Path, num_labels: int = 2, arch: str = "bert", head: str = "Sequence",
                          words=WORDS, id2label: dict | None = None) -> Path:
    """A tiny BERT (or, with arch="distilbert", DistilBERT) classifier with its tokenizer (vocabulary: the
    special tokens and ``words``), saved like a hub checkpoint; ``head`` "Token" makes a token classifier."""
    import transformers

    prefix = {"bert": "Bert", "distilbert": "DistilBert"}[arch]
    tokenizer_class = transformers.BertTokenizerFast  # DistilBERT checkpoints use the same WordPiece vocabulary
    folder.mkdir(parents=True, exist_ok=True)
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    # transformers 5 takes the vocabulary as `vocab` (and silently ignores `vocab_file`, leaving a
    # 5-token tokenizer that maps every word to [UNK]); v4 takes `vocab_file`.
    import inspect

    key = "vocab" if "vocab" in inspect.signature(tokenizer_class.__init__).parameters else "vocab_file"
    tokenizer = tokenizer_class(**{key: str(vocab)})
    assert len(tokenizer) == len(words) + 5, "the tiny tokenizer lost its vocabulary"
    torch.manual_seed(0)
    sizes = {"vocab_size": len(words) + 5, "max_position_embeddings": 64, "num_labels": num_labels}
    if id2label is not None:
        sizes.update(num_labels=len(id2label), id2label=id2label, label2id={v: k for k, v in id2label.items()})
    if arch == "bert":
        config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=64, **sizes)
    else:
        config = transformers.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=64, **sizes)
    getattr(transformers, f"{prefix}For{head}Classification")(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_image_folder(folder: Path, classes=("cat", "dog", "fox"), per_class: int = 6) -> Path:
    from PIL import Image

    rng = random.Random(0)
    for split, n in (("train", per_class), ("val", per_class // 2)):
        for c_idx, cls in enumerate(classes):
            (folder / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                colour = tuple(min(255, 60 * c_idx + rng.randint(0, 40)) for _ in range(3))
                Image.new("RGB", (24, 24), colour).save(folder / split / cls / f"{i}.png")
    return folder


def write_timm_checkpoint(folder: Path, num_classes: int = 3, img_size: int = 32, embed_dim: int = 32,
                          depth: int = 2, num_heads: int = 4) -> Path:
    """A tiny timm ViT saved in luna_convert.save format (an original, unconverted checkpoint)."""
    torch.manual_seed(0)
    model = luna_convert.create_timm_model("vit_tiny_patch16_224", img_size=img_size, patch_size=8,
                                           embed_dim=embed_dim, depth=depth, num_heads=num_heads,
                                           num_classes=num_classes)
    image_config = {"mean": [0.5] * 3, "std": [0.5] * 3, "size": img_size}
    luna_convert.save(model, folder, extra={"image_config": image_config})
    return folder


@pytest.fixture(scope="module")
def text_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    return write_bert_checkpoint(root / "bert"), write_sst2(root / "SST-2")


@pytest.fixture(scope="module")
def image_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("image")
    return write_timm_checkpoint(root / "vit"), write_image_folder(root / "images")


def config_for(model: Path, data: Path, task: str, method: str, out: Path, **train) -> dict:
    overrides = {"model": str(model), "data_dir": str(data), "task": task, "method": method,
                 "output_dir": str(out), "train.max_steps": 3, "train.batch_size": 8, "train.eval_batch_size": 8,
                 "train.lr": 1e-3, "distill.default_steps": 2, "seed": 0}
    overrides.update({f"train.{k}": v for k, v in train.items()})
    return apply_overrides(load_recipe(None), overrides)


def test_distilbert_run_and_eval(tmp_path):
    """DistilBERT (q_lin/k_lin/v_lin/out_lin attention, no token type ids) through the whole pipeline."""
    model_dir = write_bert_checkpoint(tmp_path / "distilbert", arch="distilbert")
    data_dir = write_sst2(tmp_path / "SST-2")
    results = run_conversion(config_for(model_dir, data_dir, "sst2", "luna", tmp_path / "out"))
    assert results["conversion"]["modules"] and len(results["conversion"]["modules"]) == 2
    assert results["eval_examples"] == 20 and 0.0 <= results["converted_score"] <= 1.0
    again = evaluate_model(Path(results["run_dir"]))
    assert again["metrics"]["accuracy"] == pytest.approx(results["converted_score"])


@pytest.mark.parametrize("method", sorted(luna_convert.METHODS))
def test_text_run_writes_complete_results(text_setup, tmp_path, method):
    model_dir, data_dir = text_setup
    results = run_conversion(config_for(model_dir, data_dir, "sst2", method, tmp_path))
    run_dir = Path(results["run_dir"])
    saved = json.loads((run_dir / "results.json").read_text())
    assert RESULT_FIELDS <= set(saved)
    assert saved["headline_metric"] == "accuracy"
    assert saved["eval_examples"] == 20
    assert saved["recovered_pct"] == pytest.approx(100 * saved["converted_score"] / saved["teacher_score"])
    assert saved["steps"]["finetune"] == 3
    assert saved["steps"]["distill"] == (2 if luna_convert.METHODS[method].distill else 0)
    assert saved["config"]["method"] == method
    assert (run_dir / "model" / "model.safetensors").is_file()
    log = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log if e["stage"] == "finetune"] == [1, 2, 3]
    # The saved model scores exactly what results.json says.
    again = evaluate_model(run_dir)
    assert again["converted"] and again["metrics"]["accuracy"] == saved["converted_score"]


def test_image_run_and_eval(image_setup, tmp_path):
    model_dir, data_dir = image_setup
    results = run_conversion(config_for(model_dir, data_dir, "image-classification", "luna", tmp_path))
    assert results["eval_examples"] == 9
    assert results["conversion"]["modules"][0]["adapter"] == "timm"
    again = evaluate_model(results["run_dir"])
    assert again["metrics"]["accuracy"] == results["converted_score"]
    # The original checkpoint evaluates to the recorded teacher score.
    teacher = evaluate_model(model_dir, task="image-classification", data_dir=str(data_dir))
    assert not teacher["converted"] and teacher["metrics"]["accuracy"] == results["teacher_score"]


def run_cli(*args, env_extra=None, timeout=300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "luna_convert", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


@pytest.mark.parametrize(
    "args, message",
    [
        (["no-such-recipe"], "unknown recipe 'no-such-recipe'"),
        (["run", "--model", "x", "--task", "sst2", "--method", "lunar"], "Did you mean luna"),
        (["run", "--model", "x", "--task", "sst3"], "unknown task"),
        (["run", "--model", "x", "--task", "sst2", "--set", "train.lrr=1"], "unknown setting 'train.lrr'"),
        (["run", "--model", "x", "--task", "sst2", "--set", "train.lr=fast"], "train.lr must be a number"),
        (["eval", "/nonexistent/folder"], "/nonexistent/folder"),
    ],
)
def test_cli_bad_input_one_line_and_nonzero_exit(args, message, tmp_path):
    proc = run_cli(*args, "--output-dir", str(tmp_path)) if args[0] == "run" else run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_cli_run_and_report(text_setup, tmp_path):
    model_dir, data_dir = text_setup
    for method in ("luna", "t2r"):
        proc = run_cli("run", "--model", str(model_dir), "--task", "sst2", "--data-dir", str(data_dir),
                       "--method", method, "--max-steps", "2", "--batch-size", "8", "--output-dir", str(tmp_path))
        assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run_cli("report", str(tmp_path), "--output", str(tmp_path / "report"))
    assert proc.returncode == 0, proc.stderr
    rows = (tmp_path / "report" / "report.csv").read_text().splitlines()
    assert rows[0] == "method,task,original,converted,recovered_pct"
    assert sum(r.startswith(("luna,sst2", "t2r,sst2")) for r in rows) == 2
    assert "ratio of means" in (tmp_path / "report" / "report.md").read_text()


def test_two_process_cpu_run_counts_every_example_once(text_setup, tmp_path):
    pytest.importorskip("accelerate")
    model_dir, data_dir = text_setup
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29517",
           "-m", "luna_convert", "run", "--model", str(model_dir), "--task", "sst2", "--data-dir", str(data_dir),
           "--method", "hedgehog", "--max-steps", "2", "--distill-steps", "2", "--batch-size", "8",
           "--output-dir", str(tmp_path)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results_file,) = list(tmp_path.glob("*/results.json"))
    results = json.loads(results_file.read_text())
    assert results["num_processes"] == 2
    assert results["eval_examples"] == 20  # 20 dev rows over 2 ranks, none dropped or doubled


def test_every_shipped_recipe_loads_and_names_a_known_method_and_task():
    """Hub recipes cannot run offline; at least their contents are checked here."""
    from luna_convert.linear_methods import METHODS
    from luna_convert.run.recipes import available_recipes
    from luna_convert.tasks import get_task

    recipes = available_recipes()
    assert {"bert-base-sst2", "distilbert-sst2", "vit-b16-imagenet", "digits-vit", "minilm-sst2"} <= set(recipes)
    for name in recipes:
        config = load_recipe(name)
        assert config["name"] == name and config["model"], name
        assert config["method"] in METHODS, name
        get_task(config["task"])  # raises for an unknown task
        assert config["train"]["lr"] > 0 and config["train"]["batch_size"] >= 1, name
