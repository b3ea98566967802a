"""End to end: tiny models and tiny data written here, the real pipeline and CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import luna_convert
from luna_convert.run.pipeline import evaluate_model, run_conversion
from luna_convert.run.recipes import load_recipe
from builders import (cli_error_line, config_for, invoke_cli, write_bert_checkpoint, write_image_folder, write_sst2,
                      write_timm_checkpoint)

RESULT_FIELDS = {"teacher_score", "converted_score", "recovered_pct", "teacher_metrics", "converted_metrics",
                 "config", "versions", "seed", "timings", "steps", "headline_metric", "eval_examples", "conversion"}


@pytest.fixture(scope="module")
def text_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    return write_bert_checkpoint(root / "bert"), write_sst2(root / "SST-2")


@pytest.fixture(scope="module")
def image_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("image")
    return write_timm_checkpoint(root / "vit"), write_image_folder(root / "images")


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
    # in-process; tests/test_bad_input.py checks that a real process prints the same one line
    line = cli_error_line(invoke_cli(*args, "--output-dir", tmp_path) if args[0] == "run" else invoke_cli(*args))
    assert message in line
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_cli_run_and_report(text_setup, tmp_path):
    model_dir, data_dir = text_setup
    for method in ("luna", "t2r"):
        result = invoke_cli("run", "--model", model_dir, "--task", "sst2", "--data-dir", data_dir, "--method", method,
                            "--max-steps", "2", "--batch-size", "8", "--output-dir", tmp_path)
        assert result.exit_code == 0, result.output[-2000:]
    result = invoke_cli("report", tmp_path, "--output", tmp_path / "report")
    assert result.exit_code == 0, result.output[-2000:]
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
        assert config.name == name and config.model, name
        assert config.method in METHODS, name
        get_task(config.task)  # raises for an unknown task
        assert config.train.lr > 0 and config.train.batch_size >= 1, name
