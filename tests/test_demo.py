"""The demo's teacher ships inside the package (checked by SHA-256), so `luna-convert demo` converts at once."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from luna_convert.run import teachers
from luna_convert.cli import app
from luna_convert.errors import LunaConvertError

NAME = "digits-vit"
SHIPPED = teachers.SHIPPED_DIR / NAME


def test_shipped_teacher_matches_its_checksums_and_loads():
    import torch

    import luna_convert
    from luna_convert.run.pipeline import evaluate_model

    assert teachers.builtin_dir(NAME, "anywhere") == SHIPPED  # not a per-output-dir cache
    for file in teachers.SHIPPED_SHA256[NAME]:
        size = (SHIPPED / file).stat().st_size
        assert size < 1_000_000, f"{file} is {size} bytes; the repository keeps shipped files small"
    model = luna_convert.load(SHIPPED)
    assert sum(p.numel() for p in model.parameters()) > 100_000 and all(torch.isfinite(p).all() for p in
                                                                         model.parameters())
    meta = json.loads((SHIPPED / "linear_attention.json").read_text())
    assert meta["task"] == "digits" and meta["conversion"] is None  # the original softmax model
    # A trained model, and the one its recorded score came from: a count of right answers, so exactly equal.
    metrics = evaluate_model(SHIPPED)["metrics"]
    assert metrics["accuracy"] == meta["teacher_metrics"]["accuracy"]
    assert metrics["accuracy"] > 0.9


@pytest.mark.parametrize("damage", ["flip a byte", "delete"])
def test_damaged_shipped_teacher_says_how_to_rebuild(tmp_path, damage):
    copy = tmp_path / NAME
    shutil.copytree(SHIPPED, copy)
    weights = copy / "model.safetensors"
    if damage == "delete":
        weights.unlink()
    else:
        data = bytearray(weights.read_bytes())
        data[-1] ^= 1  # one bit of one weight: still a loadable file, but not the shipped one
        weights.write_bytes(bytes(data))
    with pytest.raises(LunaConvertError) as info:
        teachers.shipped_teacher(NAME, copy)
    message = str(info.value)
    assert "\n" not in message and str(weights) in message
    assert ("is missing" if damage == "delete" else "does not match its recorded SHA-256") in message
    assert teachers.REBUILD_SCRIPT in message and "reinstall luna-convert" in message


def test_demo_with_a_damaged_teacher_exits_with_one_line_and_writes_nothing(tmp_path, monkeypatch):
    shutil.copytree(SHIPPED, tmp_path / "shipped" / NAME)
    (tmp_path / "shipped" / NAME / "linear_attention.json").write_text("{}")
    monkeypatch.setattr(teachers, "SHIPPED_DIR", tmp_path / "shipped")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["demo", "--output-dir", str(out)])
    assert result.exit_code == 2
    assert "does not match its recorded SHA-256" in result.output and "Traceback" not in result.output
    assert not out.exists()


def _no_training(*args, **kwargs):
    raise AssertionError("the demo trained its teacher instead of loading the shipped one")


def test_demo_converts_the_shipped_teacher_without_training_it(tmp_path, monkeypatch):
    monkeypatch.setattr(teachers, "train_builtin", _no_training)
    monkeypatch.chdir(tmp_path)  # nothing may depend on a teacher cached under the working folder
    out = tmp_path / "out"
    # A tiny budget: this checks the path (load, score, convert, distil, finetune, score, save), not the score.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # not the demo's 1: the demo must hand back the caller's setting
    try:
        result = CliRunner().invoke(app, ["demo", "--output-dir", str(out), "--set", "distill.steps=2",
                                          "--set", "train.max_steps=2", "--set", "train.max_eval_examples=32"])
        assert torch.get_num_threads() == 2  # (other in-process runs after it, e.g. the resume tests, depend on it)
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    (run_dir,) = out.glob("digits-vit-luna-*")
    results = json.loads((run_dir / "results.json").read_text())
    assert results["steps"] == {"distill": 2, "finetune": 2} and results["eval_examples"] == 32
    assert not (out / "teachers").exists()
    text = " ".join(result.output.split())  # rich may wrap long lines
    for words in ["loading the teacher digits-vit shipped with luna-convert", "scoring the original model",
                  "converted 4 attention modules to luna", "distilling attention for 2 steps",
                  "finetuning on the task for 2 steps", "scoring the converted model", f"results in {run_dir}"]:
        assert words in text, words
    # The original model of a demo run is the shipped teacher, also for `attention-map --original teacher`.
    from luna_convert.tools.attention_map import attention_map_command

    _, amap = attention_map_command(run_dir, image="digits:1", original="teacher", output=tmp_path / "map.png")
    assert amap.original == str(SHIPPED)
