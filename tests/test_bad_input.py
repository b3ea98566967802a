"""Bad inputs: each gets one line that says what is wrong and what to do, exit code 2, no
traceback (unless --debug), and leaves nothing half-written. README.md ("Bad input") lists them all
(with the cases tested elsewhere: test_pipeline.py, test_convert.py, test_serialization.py,
test_resume.py, test_attention_map.py).

The CLI runs in-process (typer's CliRunner) to keep this file fast; two subprocess tests check
that a real invocation prints exactly one line, and that --debug shows the traceback instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from luna_convert.errors import LunaConvertError

from builders import (cli_error_line, invoke_cli, write_bert_checkpoint, write_image_folder, write_sst2,
                      write_timm_checkpoint)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Tiny models and data, good and bad, built once (all offline)."""
    import transformers
    from transformers.utils import logging as hf_logging

    from luna_convert.conversion import convert
    from luna_convert.serialization import save

    hf_logging.disable_progress_bar()  # in-process, transformers may be imported before the CLI turns its bars off
    root = tmp_path_factory.mktemp("bad-input")
    w = {"root": root, "bert": write_bert_checkpoint(root / "bert"), "sst2": write_sst2(root / "SST-2"),
         "vit": write_timm_checkpoint(root / "vit"),
         "images4": write_image_folder(root / "images4", classes=("ant", "bee", "cat", "dog"))}
    (root / "empty").mkdir()
    (root / "a-file.txt").write_text("not a folder\n")
    wrong = root / "wrong-columns"
    wrong.mkdir()
    for name in ("train.tsv", "dev.tsv"):
        (wrong / name).write_text("review\tstars\ngood movie\t1\n")
    bad_train = root / "bad-train"
    shutil.copytree(w["sst2"], bad_train)
    (bad_train / "train.tsv").write_text("review\tstars\ngood movie\t1\n")
    three = root / "three-labels"
    three.mkdir()
    for name in ("train.tsv", "dev.tsv"):
        (three / name).write_text("sentence\tlabel\ngood movie\t0\nbad film\t1\nthe plot\t2\n")
    for name, damage in (("truncated", lambda b: b[: len(b) // 2]), ("garbage", lambda b: b"\0" * 64)):
        folder = shutil.copytree(w["bert"], root / name)
        weights = folder / "model.safetensors"
        weights.write_bytes(damage(weights.read_bytes()))
        w[name] = folder
    no_tokenizer = shutil.copytree(w["bert"], root / "no-tokenizer")
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json"):
        (no_tokenizer / name).unlink(missing_ok=True)
    decoder = transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
        n_embd=32, n_layer=1, n_head=4, vocab_size=30, n_positions=64, pad_token_id=0))
    decoder.save_pretrained(root / "gpt2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(w["bert"])
    tokenizer.save_pretrained(root / "gpt2")
    model = transformers.BertForSequenceClassification.from_pretrained(w["bert"])
    convert(model, "t2r")
    save(model, root / "converted", tokenizer=tokenizer, extra={"task": "sst2"})
    unfinished = root / "unfinished-run"
    unfinished.mkdir()
    (unfinished / "config.json").write_text(json.dumps({"model": str(w["bert"]), "method": "luna", "train": {},
                                                        "task": "sst2"}))
    finished = root / "finished-run"
    finished.mkdir()
    shutil.copytree(root / "converted", finished / "model")
    (finished / "config.json").write_text(json.dumps({"model": str(w["bert"]), "method": "t2r", "train": {},
                                                      "task": "sst2"}))
    (root / "foreign").mkdir()
    (root / "foreign" / "notes.txt").write_text("my notes\n")
    return {**w, "empty": root / "empty", "file": root / "a-file.txt", "wrong": wrong, "bad_train": bad_train,
            "three": three, "no_tokenizer": no_tokenizer, "decoder": root / "gpt2",
            "converted": root / "converted", "unfinished": unfinished, "finished": finished,
            "foreign": root / "foreign"}


def run_args(model, data, out: Path, *extra, task: str = "sst2") -> list[str]:
    return ["run", "--model", str(model), "--task", task, "--data-dir", str(data), "--max-steps", "1",
            "--batch-size", "8", "--output-dir", str(out), *extra]


def assert_one_line_error(args: list[str], message: str, out: Path | None = None) -> str:
    line = cli_error_line(invoke_cli(*args))
    assert message in line, line
    if out is not None:  # nothing half-written: no run folder appeared
        assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())
    return line


# (case id, run arguments as a function of the world and the output folder, expected words)
RUN_CASES = [
    ("unknown eval split", lambda w, o: run_args(w["bert"], w["sst2"], o, "--eval-split", "nosuch"),
     "no file for split 'nosuch'"),
    ("data dir missing", lambda w, o: run_args(w["bert"], "/no/such/data", o),
     "data folder /no/such/data does not exist; check --data-dir"),
    ("data dir is a file", lambda w, o: run_args(w["bert"], w["file"], o), "is a file; pass the folder"),
    ("data dir empty", lambda w, o: run_args(w["bert"], w["empty"], o), "found: nothing"),
    ("wrong columns", lambda w, o: run_args(w["bert"], w["wrong"], o),
     "header has columns ['review', 'stars'] but GLUE SST-2 needs ['sentence']"),
    ("wrong columns in train only", lambda w, o: run_args(w["bert"], w["bad_train"], o),
     "train.tsv: header has columns ['review', 'stars']"),
    ("more labels than classes", lambda w, o: run_args(w["bert"], w["three"], o),
     "the data has 3 distinct label(s) [0, 1, 2] but the model has 2 model classes (ids 0..1)"),
    ("more image classes than the model", lambda w, o: run_args(w["vit"], w["images4"], o,
                                                                task="image-classification"),
     "the data has 4 classes"),
    ("no supported attention", lambda w, o: run_args(w["decoder"], w["sst2"], o),
     "no supported softmax self-attention in GPT2ForSequenceClassification"),
    ("truncated safetensors", lambda w, o: run_args(w["truncated"], w["sst2"], o), "is truncated or corrupt"),
    ("garbage safetensors", lambda w, o: run_args(w["garbage"], w["sst2"], o), "is truncated or corrupt"),
    ("model folder without tokenizer", lambda w, o: run_args(w["no_tokenizer"], w["sst2"], o),
     "no tokenizer files in"),
    ("model is a file", lambda w, o: run_args(w["file"], w["sst2"], o), "is a file; pass the folder"),
    ("model is a run folder", lambda w, o: run_args(w["finished"], w["sst2"], o),
     "is a luna-convert run folder, not a model"),
    ("already converted model", lambda w, o: run_args(w["converted"], w["sst2"], o),
     "is already converted to linear attention; start from the original"),
    ("--set a whole section", lambda w, o: run_args(w["bert"], w["sst2"], o, "--set", "train=3"),
     "setting train is a group of settings"),
    ("--set without =", lambda w, o: run_args(w["bert"], w["sst2"], o, "--set", "train.lr"),
     "--set expects key=value"),
    ("--set unknown schedule", lambda w, o: run_args(w["bert"], w["sst2"], o, "--set", "train.schedule=wavy"),
     "train.schedule must be linear, cosine or constant, got 'wavy'"),
    ("--set negative max_steps", lambda w, o: run_args(w["bert"], w["sst2"], o, "--set", "train.max_steps=-5"),
     "train.max_steps must be a whole number of steps (0: no finetuning), or null"),
    ("--set warmup_ratio >= 1", lambda w, o: run_args(w["bert"], w["sst2"], o, "--set", "train.warmup_ratio=2"),
     "train.warmup_ratio must be a fraction in [0, 1)"),
    ("--set negative checkpoint_every",
     lambda w, o: run_args(w["bert"], w["sst2"], o, "--set", "train.checkpoint_every=-1"),
     "train.checkpoint_every must be a whole number of steps"),
    ("--set negative distill steps",
     lambda w, o: run_args(w["bert"], w["sst2"], o, "--method", "hedgehog", "--set", "distill.steps=-3"),
     "distill.steps must be 0 or more"),
    ("--set zero max_train_examples",
     lambda w, o: run_args(w["bert"], w["sst2"], o, "--set", "train.max_train_examples=0"),
     "train.max_train_examples must be a positive integer or null"),
    ("--set unknown method option", lambda w, o: run_args(w["bert"], w["sst2"], o, "--set", "method_options.foo=1"),
     "unknown option(s) ['foo'] for method 'luna'"),
    ("--set negative method option",
     lambda w, o: run_args(w["bert"], w["sst2"], o, "--set", "method_options.projections=-1"),
     "invalid options for method 'luna'"),
    ("--set even DWC kernel", lambda w, o: run_args(w["bert"], w["sst2"], o, "--set", "method_options.dwc_kernel=2"),
     "dwc_kernel must be a positive odd integer"),
    ("--set method_options not a mapping", lambda w, o: run_args(w["bert"], w["sst2"], o, "--set", "method_options=3"),
     "setting method_options must be a mapping"),
    ("--mixed-precision unknown", lambda w, o: run_args(w["bert"], w["sst2"], o, "--mixed-precision", "fp8"),
     "train.mixed_precision must be no, bf16 or fp16"),
    ("--resume with other options", lambda w, o: ["run", "--resume", str(w["unfinished"]), "--lr", "1e-5"],
     "--resume continues a run with the settings saved in its config.json; drop --lr"),
    ("--resume a missing folder", lambda w, o: ["run", "--resume", "/no/such/run"], "no such folder"),
    ("--resume a folder that is not a run", lambda w, o: ["run", "--resume", str(w["empty"])],
     "no config.json there; pass a run folder"),
    ("--run-dir that holds files", lambda w, o: run_args(w["bert"], w["sst2"], o, "--run-dir", str(w["foreign"])),
     "already exists and is not empty; pass --overwrite"),
    ("--overwrite of a folder that is not a run",
     lambda w, o: run_args(w["bert"], w["sst2"], o, "--run-dir", str(w["foreign"]), "--overwrite"),
     "is not a luna-convert run folder (it holds notes.txt)"),
    ("--run-dir is a file", lambda w, o: run_args(w["bert"], w["sst2"], o, "--run-dir", str(w["file"])),
     "is a file; choose another run folder"),
]


@pytest.mark.parametrize("case, build, message", RUN_CASES, ids=[c[0] for c in RUN_CASES])
def test_run_bad_input(world, tmp_path, case, build, message):
    out = tmp_path / "out"
    before = {p: p.read_bytes() for p in world["foreign"].iterdir()}
    assert_one_line_error(build(world, out), message, out)
    assert {p: p.read_bytes() for p in world["foreign"].iterdir()} == before  # never touched


EVAL_CASES = [
    ("eval an empty folder", lambda w: ["eval", str(w["empty"])], "is not a model folder (no config.json"),
    ("eval a data folder", lambda w: ["eval", str(w["sst2"])], "is not a model folder"),
    ("eval a file", lambda w: ["eval", str(w["file"])], "is a file; pass a run folder"),
    ("eval an unfinished run", lambda w: ["eval", str(w["unfinished"])],
     "is an unfinished luna-convert run (no model/ yet)"),
    ("eval truncated safetensors", lambda w: ["eval", str(w["truncated"]), "--task", "sst2", "--data-dir",
                                              str(w["sst2"])], "is truncated or corrupt"),
]


@pytest.mark.parametrize("case, build, message", EVAL_CASES, ids=[c[0] for c in EVAL_CASES])
def test_eval_bad_input(world, case, build, message):
    assert_one_line_error(build(world), message)


def test_a_mistyped_relative_folder_is_not_sent_to_the_hub(world, monkeypatch):
    """"outputs/<typo>" has the shape of a hub id ("org/name"); its first part being a local folder says it is a path."""
    monkeypatch.chdir(world["root"])
    assert_one_line_error(["eval", "empty/no-such-run"], "model folder empty/no-such-run does not exist")
    assert_one_line_error(["run", "--model", "empty/no-such-model", "--data-dir", "SST-2", "--task", "sst2",
                           "--output-dir", "out"], "model folder empty/no-such-model does not exist",
                          world["root"] / "out")


def test_load_of_a_folder_that_is_not_a_converted_model(world):
    from luna_convert.serialization import load

    with pytest.raises(LunaConvertError, match="not a luna-convert model folder.*transformers checkpoint"):
        load(world["bert"])
    with pytest.raises(LunaConvertError, match="not a luna-convert model folder.*pass a run folder"):
        load(world["empty"])
    with pytest.raises(LunaConvertError, match="does not exist"):
        load(world["root"] / "nowhere")
    assert load(world["finished"]).training is False  # a run folder loads its model/


def _cli_subprocess(*args: str):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)  # the CLI itself must silence library progress bars
    return subprocess.run([sys.executable, "-m", "luna_convert", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_real_cli_prints_exactly_one_line_and_debug_shows_the_traceback(world, tmp_path):
    args = run_args(world["truncated"], world["sst2"], tmp_path / "out")
    proc = _cli_subprocess(*args)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and "truncated or corrupt" in proc.stderr
    debug = _cli_subprocess("--debug", *args)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "LunaConvertError" in debug.stderr
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ --overwrite
def test_existing_run_folder_is_kept_unless_overwrite(world, tmp_path):
    """A finished run's folder is left byte-for-byte alone without --overwrite; with it, the new run
    replaces it completely (a stale teacher score, checkpoint pointer or distilled weights of the
    old run must not leak into the new one)."""
    run_dir = tmp_path / "my-run"
    args = run_args(world["bert"], world["sst2"], tmp_path, "--run-dir", str(run_dir), "--method", "t2r")
    first = invoke_cli(*args)
    assert first.exit_code == 0, first.output[-2000:]
    snapshot = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}

    assert_one_line_error(args, "already exists and is not empty; pass --overwrite")
    assert {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == snapshot

    # Plant what a different earlier run could have left, then overwrite.
    (run_dir / "teacher.json").write_text(json.dumps({"metrics": {"accuracy": 0.123}, "seconds": 1.0}))
    (run_dir / "trainer_state.json").write_text(json.dumps({"stage": "finetune", "step": 1, "checkpoint": "x"}))
    (run_dir / "checkpoints" / "distilled").mkdir(parents=True)
    (run_dir / "checkpoints" / "distilled" / "stale.txt").write_text("old")
    again = invoke_cli(*args, "--overwrite")
    assert again.exit_code == 0, again.output[-2000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["teacher_score"] != 0.123 and results["run_dir"] == str(run_dir)
    assert not (run_dir / "trainer_state.json").exists() and not (run_dir / "checkpoints").exists()
    assert json.loads((run_dir / "config.json").read_text())["overwrite"] is True


def test_two_runs_started_in_the_same_second_get_two_folders(tmp_path, monkeypatch):
    from datetime import datetime

    import luna_convert.run.pipeline as pipeline
    from luna_convert.run.config import RunConfig

    class FrozenClock:
        @staticmethod
        def now():
            return datetime(2026, 1, 2, 3, 4, 5)

    monkeypatch.setattr(pipeline, "datetime", FrozenClock)
    config = RunConfig(output_dir=str(tmp_path), name="r", method="luna")
    first = pipeline.new_run_dir(config)
    first.mkdir()
    second = pipeline.new_run_dir(config)
    assert first.name == "r-luna-20260102-030405" and second.name == "r-luna-20260102-030405-2"
