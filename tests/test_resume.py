"""Crash and resume: a CLI run killed with SIGKILL mid-finetune or mid-distillation resumes with
``--resume RUN_DIR`` and ends exactly where an uninterrupted run with the same seed ends.

The crashed run is a real ``luna-convert run`` subprocess; the uninterrupted reference and the
resume run the same CLI in-process (typer's CliRunner) to keep the file fast. Dropout is on
(the tiny BERT keeps transformers' 0.1) and images are textured with train-time augmentation,
so the RNG, the data order, the optimizer and the scheduler all have to come back exactly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from luna_convert.cli import app
from luna_convert.engine.training import STATE_FILE

from builders import write_bert_checkpoint, write_sst2, write_timm_checkpoint

STEPS, EVERY = 9, 3  # 6 batches per epoch: the run crosses an epoch boundary


@pytest.fixture(scope="module")
def text_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume-text")
    return write_bert_checkpoint(root / "bert"), write_sst2(root / "SST-2")


def write_textured_images(folder: Path, per_class: int = 8) -> Path:
    """Noise images: random crops and flips really change the pixels (flat colours would not)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", per_class), ("val", 3)):
        for c, cls in enumerate(("cat", "dog", "fox")):
            (folder / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                pixels = (rng.random((24, 24, 3)) * 120 + 60 * c).clip(0, 255).astype("uint8")
                Image.fromarray(pixels).save(folder / split / cls / f"{i}.png")
    return folder


def cli_args(model: Path, data: Path, task: str, method: str, out: Path, *extra: str, steps: int = STEPS) -> list[str]:
    return ["run", "--model", str(model), "--task", task, "--data-dir", str(data), "--method", method,
            "--max-steps", str(steps), "--batch-size", "8", "--lr", "1e-3", "--seed", "0",
            "--set", f"train.checkpoint_every={EVERY}", "--output-dir", str(out), *extra]


def cli_in_process(args: list[str]) -> None:
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output[-3000:]


def only_run(out: Path) -> Path:
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return run_dir


def start_and_kill(args: list[str], out: Path, ready) -> Path:
    """Start the CLI in a subprocess, SIGKILL it as soon as ``ready(run_dir)`` holds; returns the run folder."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "luna_convert", *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    try:
        while True:
            runs = [p for p in out.glob("*") if p.is_dir()] if out.is_dir() else []
            if runs and ready(runs[0]):
                break
            if proc.poll() is not None:
                pytest.fail(f"the run ended (rc {proc.returncode}) before it could be killed: {proc.stderr.read()[-2000:]}")
            assert time.monotonic() < deadline, "the run never reached the point to kill it"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return runs[0]


def trainer_step(run_dir: Path) -> int:
    try:
        return json.loads((run_dir / STATE_FILE).read_text())["step"]
    except (OSError, ValueError):  # not there yet (it is written atomically: never half)
        return -1


def log_entries(run_dir: Path, stage: str) -> list[dict]:
    path = run_dir / "train_log.jsonl"
    if not path.is_file():
        return []
    entries = []
    for line in path.read_text().splitlines():
        try:
            entries.append(json.loads(line))
        except ValueError:  # a line torn by the kill is possible; the resume drops it
            continue
    return [e for e in entries if e["stage"] == stage]


def assert_intact_after_kill(run_dir: Path) -> None:
    """Whatever the killed run left is whole: every JSON parses, the pointed-to checkpoint is loadable."""
    assert not (run_dir / "results.json").exists(), "the run finished before the kill: nothing was tested"
    for name in ("config.json", "teacher.json", STATE_FILE):
        if (run_dir / name).exists():
            json.loads((run_dir / name).read_text())
    if trainer_step(run_dir) >= 0:
        state = json.loads((run_dir / STATE_FILE).read_text())
        load_file(run_dir / "checkpoints" / state["checkpoint"] / "model.safetensors")


def assert_same_run(reference: Path, resumed: Path) -> None:
    ref, res = (json.loads((d / "results.json").read_text()) for d in (reference, resumed))
    assert res["final_loss"] == ref["final_loss"]
    assert res["converted_metrics"] == ref["converted_metrics"]
    assert res["steps"] == ref["steps"]
    a, b = (load_file(d / "model" / "model.safetensors") for d in (reference, resumed))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # The resumed log reads as one run: each step once, with the reference's losses.
    for stage in ("distill", "finetune"):
        ref_log = [(e["step"], e["loss"]) for e in log_entries(reference, stage)]
        assert [(e["step"], e["loss"]) for e in log_entries(resumed, stage)] == ref_log


def test_killed_during_finetune_resumes_to_identical_result(text_setup, tmp_path):
    model_dir, data_dir = text_setup
    cli_in_process(cli_args(model_dir, data_dir, "sst2", "luna", tmp_path / "reference"))
    reference = only_run(tmp_path / "reference")
    assert [e["step"] for e in log_entries(reference, "finetune")] == list(range(1, STEPS + 1))

    crash_out = tmp_path / "crash"
    run_dir = start_and_kill(cli_args(model_dir, data_dir, "sst2", "luna", crash_out), crash_out,
                             lambda d: trainer_step(d) >= EVERY)
    assert_intact_after_kill(run_dir)
    assert EVERY <= trainer_step(run_dir) < STEPS
    cli_in_process(["run", "--resume", str(run_dir)])
    assert_same_run(reference, run_dir)
    # Resuming a finished run is refused (one line, exit 2) and leaves it as it is.
    before = (run_dir / "results.json").read_text()
    result = CliRunner().invoke(app, ["run", "--resume", str(run_dir)])
    assert result.exit_code == 2 and "already finished" in result.output
    assert (run_dir / "results.json").read_text() == before


def test_killed_during_distillation_resumes_to_identical_result(text_setup, tmp_path):
    model_dir, data_dir = text_setup
    extra = ("--distill-steps", "16")
    cli_in_process(cli_args(model_dir, data_dir, "sst2", "hedgehog", tmp_path / "reference", *extra, steps=6))
    reference = only_run(tmp_path / "reference")

    crash_out = tmp_path / "crash"
    run_dir = start_and_kill(cli_args(model_dir, data_dir, "sst2", "hedgehog", crash_out, *extra, steps=6), crash_out,
                             lambda d: len(log_entries(d, "distill")) >= 3)
    assert_intact_after_kill(run_dir)
    assert not (run_dir / "checkpoints" / "distilled" / "linear_attention.json").exists(), "distillation had ended"
    cli_in_process(["run", "--resume", str(run_dir)])
    assert_same_run(reference, run_dir)
    assert not list(run_dir.rglob(".*.tmp")), "temporary files of the killed attempt were left behind"


class _Crash(BaseException):
    """Stands in for the kill in the in-process test below (nothing in the tool catches it)."""


def test_image_run_with_augmentation_and_accumulation_resumes_to_identical_result(tmp_path_factory, tmp_path,
                                                                                  monkeypatch):
    """Per-example augmentation seeding and the update count of a short last accumulation window.

    24 images in batches of 5 with grad_accum 2: 3 updates per epoch (after batches 2, 4 and 5), and
    the checkpoint after update 2 falls mid-epoch; 6 updates span two epochs. The crash is simulated in-process (right after
    that checkpoint) to save a subprocess start; the SIGKILL tests above cover the real thing.
    """
    from accelerate.state import GradientState

    import luna_convert.engine.training as training

    root = tmp_path_factory.mktemp("resume-image")
    model_dir, data_dir = write_timm_checkpoint(root / "vit"), write_textured_images(root / "images")
    extra = ("--batch-size", "5", "--set", "train.grad_accum=2", "--set", "train.checkpoint_every=2")
    args = lambda out: cli_args(model_dir, data_dir, "image-classification", "t2r", out, *extra, steps=6)  # noqa: E731
    cli_in_process(args(tmp_path / "reference"))
    reference = only_run(tmp_path / "reference")

    real_save = training.save_checkpoint

    def save_then_crash(accelerator, run_dir, stage, step, keep=1):
        real_save(accelerator, run_dir, stage, step, keep)
        raise _Crash

    monkeypatch.setattr(training, "save_checkpoint", save_then_crash)
    with pytest.raises(_Crash):
        CliRunner().invoke(app, args(tmp_path / "crash"), catch_exceptions=False)
    monkeypatch.undo()
    GradientState._reset_state()  # the interrupted loop never told accelerate that it left its dataloader
    run_dir = only_run(tmp_path / "crash")
    assert trainer_step(run_dir) == 2
    cli_in_process(["run", "--resume", str(run_dir)])
    assert_same_run(reference, run_dir)


def error_line(result) -> str:
    """The one line a user error prints (stderr), checked to be exactly one line with no traceback."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output[-2000:]
    errors = [line for line in lines if line.startswith("error:")]
    # In-process, transformers may have been imported (with its tqdm bars on) before the CLI could
    # turn them off; the subprocess tests in test_bad_input.py check that stderr is exactly one line.
    assert len(errors) == 1 and lines[-1] == errors[0], lines
    assert "Traceback" not in result.output
    return errors[0]


def test_non_finite_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(text_setup, tmp_path,
                                                                                   monkeypatch):
    import luna_convert.engine.training as training

    model_dir, data_dir = text_setup
    real_loss, calls = training.task_loss, []

    def loss_that_turns_nan(logits, labels):
        calls.append(1)
        loss = real_loss(logits, labels)
        return loss * float("nan") if len(calls) == 5 else loss

    monkeypatch.setattr(training, "task_loss", loss_that_turns_nan)
    result = CliRunner().invoke(app, cli_args(model_dir, data_dir, "sst2", "t2r", tmp_path))
    line = error_line(result)
    assert f"finetune loss became nan at step 5 of {STEPS}" in line
    assert "last good checkpoint (step 3)" in line and "--lr" in line
    run_dir = only_run(tmp_path)
    assert trainer_step(run_dir) == 3
    load_file(run_dir / "checkpoints" / "finetune-0000003" / "model.safetensors")
    assert not (run_dir / "results.json").exists() and not (run_dir / "model").exists()


def test_huge_learning_rate_stops_with_one_line(text_setup, tmp_path):
    """A real divergence (no monkeypatching): lr=1e30 blows the weights up after the first update."""
    model_dir, data_dir = text_setup
    result = CliRunner().invoke(app, cli_args(model_dir, data_dir, "sst2", "t2r", tmp_path, "--lr", "1e30",
                                              "--set", "train.checkpoint_every=1"))
    line = error_line(result)
    assert re.search(rf"finetune loss became (nan|-?inf) at step \d+ of {STEPS}; training stopped", line), line
    assert not (only_run(tmp_path) / "results.json").exists()


def test_non_finite_distillation_loss_stops_with_one_line(text_setup, tmp_path, monkeypatch):
    from luna_convert.layers import attention

    model_dir, data_dir = text_setup
    real = attention.attention_distillation_loss
    monkeypatch.setattr(attention, "attention_distillation_loss", lambda *a, **k: real(*a, **k) * float("inf"))
    result = CliRunner().invoke(app, cli_args(model_dir, data_dir, "sst2", "hedgehog", tmp_path, "--distill-steps", "4"))
    line = error_line(result)
    assert "distillation loss became" in line and "at step 1 of 4" in line and "distill.lr" in line
    assert not (only_run(tmp_path) / "checkpoints" / "distilled").exists()


CHURN = r"""
import json, sys
from pathlib import Path
from luna_convert.fileio import atomic_directory, atomic_write_json
root = Path(sys.argv[1])
i = 0
while True:
    i += 1
    atomic_write_json(root / "results.json", {"i": i, "blob": "x" * 300_000})
    with atomic_directory(root / "model", overwrite=True) as tmp:
        (tmp / "weights.bin").write_bytes(i.to_bytes(8, "little") * 250_000)
        (tmp / "meta.json").write_text(json.dumps({"i": i}))
    if i == 1:
        (root / "started").write_text("")
"""


def _whole_model_folder(folder: Path) -> None:
    i = json.loads((folder / "meta.json").read_text())["i"]
    assert (folder / "weights.bin").read_bytes() == i.to_bytes(8, "little") * 250_000


def test_files_and_folders_are_whole_after_sigkill_at_random_moments(tmp_path):
    """A writer rewriting a JSON file and a model folder in a loop, killed at random times: what is
    left is always a whole old or new version, never a torn file or a half-written folder."""
    rng = np.random.default_rng(0)
    for attempt in range(6):
        root = tmp_path / str(attempt)
        root.mkdir()
        proc = subprocess.Popen([sys.executable, "-c", CHURN, str(root)])
        while not (root / "started").exists():
            assert proc.poll() is None, "the writer died"
            time.sleep(0.005)
        time.sleep(float(rng.uniform(0.0, 0.3)))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert json.loads((root / "results.json").read_text())["blob"] == "x" * 300_000
        model = root / "model"
        if model.exists():
            _whole_model_folder(model)
        else:  # killed between the two renames of a swap (rare): the old folder waits aside, whole
            _whole_model_folder(root / ".model.old")


def test_an_interrupted_folder_swap_is_undone_by_the_next_write(tmp_path):
    from luna_convert.errors import LunaConvertError
    from luna_convert.fileio import atomic_directory

    aside = tmp_path / ".model.old"  # what a kill between "old aside" and "new in" leaves
    aside.mkdir()
    (aside / "weights.bin").write_bytes(b"old")
    with pytest.raises(LunaConvertError, match="already exists"):
        with atomic_directory(tmp_path / "model"):
            pass
    assert (tmp_path / "model" / "weights.bin").read_bytes() == b"old" and not aside.exists()
    with atomic_directory(tmp_path / "model", overwrite=True) as tmp:
        (tmp / "weights.bin").write_bytes(b"new")
    assert (tmp_path / "model" / "weights.bin").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # nothing left aside
    # the usual permissions (umask applied), not mkdtemp's/mkstemp's private 0700/0600
    from luna_convert.fileio import DIR_MODE, FILE_MODE, atomic_write_json

    assert (tmp_path / "model").stat().st_mode & 0o777 == DIR_MODE
    atomic_write_json(tmp_path / "r.json", {})
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == FILE_MODE
