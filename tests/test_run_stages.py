"""A run's named stages: each callable alone, together giving exactly what ``run_conversion`` gives; a tiny
run's loss pinned, so a change in the stages' order (seeding, conversion, scoring) shows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from luna_convert.folder_layout import CONFIG_FILE, DISTILLED_DIR, MODEL_DIR, RESULTS_FILE, TEACHER_FILE, WEIGHTS_FILE
from luna_convert.run import pipeline
from luna_convert.run.pipeline import (STAGES, convert_stage, distil_stage, finetune_stage, load_stage, resolve_stage,
                                       run_conversion, save_stage, score_stage)
from luna_convert.run.preflight import preflight
from builders import config_for, write_bert_checkpoint, write_sst2

COMPARED = ("converted_metrics", "teacher_metrics", "stage_scores", "final_loss", "steps")
# The tiny hedgehog run below (2 distillation steps, 3 finetuning steps, seed 0), as the pipeline gave it before
# it was split into stages.
PINNED_LOSS = 0.6895540356636047
PINNED_STAGE_SCORES = {"after_conversion": 0.7, "after_distillation": 0.7, "final": 0.7}


@pytest.fixture(scope="module")
def text_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("stages")
    return write_bert_checkpoint(root / "bert"), write_sst2(root / "SST-2")


@pytest.fixture(scope="module")
def whole_run(text_setup, tmp_path_factory) -> Path:
    model_dir, data_dir = text_setup
    results = run_conversion(config_for(model_dir, data_dir, "sst2", "hedgehog", tmp_path_factory.mktemp("whole")))
    return Path(results.run_dir)


def test_the_driver_calls_the_named_stages_in_order(text_setup, tmp_path, monkeypatch):
    assert STAGES == ("resolve", "preflight", "load", "convert", "distil", "finetune", "score", "save")
    called = []

    def recorded(name, stage):
        def call(*args, **kwargs):
            called.append(name)
            return stage(*args, **kwargs)
        return call

    for name in STAGES:
        attr = name if name == "preflight" else f"{name}_stage"
        monkeypatch.setattr(pipeline, attr, recorded(name, getattr(pipeline, attr)))
    model_dir, data_dir = text_setup
    run_conversion(config_for(model_dir, data_dir, "sst2", "elu", tmp_path, max_steps=1))
    assert tuple(called) == STAGES


def test_each_stage_alone_and_all_of_them_give_the_whole_run(text_setup, whole_run, tmp_path):
    model_dir, data_dir = text_setup
    run = resolve_stage(config_for(model_dir, data_dir, "sst2", "hedgehog", tmp_path))
    assert not run.resuming and not run.run_dir.exists()  # resolving writes nothing
    checked = preflight(run.config, run.run_dir, run.accelerator, run.task, run.say)
    assert not run.run_dir.exists()  # nor does the pre-flight
    loaded = load_stage(run, checked)
    assert (run.run_dir / CONFIG_FILE).is_file() and (run.run_dir / TEACHER_FILE).is_file()
    assert set(run.timings) == {"teacher_eval_s"} and loaded.kd_teacher is None  # teacher_kd is off
    converted = convert_stage(run, loaded.model, checked.eval_loaders)
    assert converted.report.method == "hedgehog" and converted.distill_steps == 2
    assert converted.distilled is None and converted.trainer_state is None  # nothing to resume
    assert set(run.stage_scores) == {"after_conversion"}
    distil_stage(run, loaded.model, checked, converted)
    assert (run.run_dir / DISTILLED_DIR / WEIGHTS_FILE).is_file()
    assert set(run.stage_scores) == {"after_conversion", "after_distillation"}
    trained = finetune_stage(run, loaded, checked, converted)
    assert trained.finetuned.steps == 3 and trained.lora is None
    results = score_stage(run, trained, checked, loaded, converted)
    assert not (run.run_dir / RESULTS_FILE).exists() and not (run.run_dir / MODEL_DIR).exists()  # save writes them
    save_stage(run, trained, checked, results)

    ours, whole = (json.loads((d / RESULTS_FILE).read_text()) for d in (run.run_dir, whole_run))
    assert {k: ours[k] for k in COMPARED} == {k: whole[k] for k in COMPARED}
    a, b = (load_file(d / MODEL_DIR / WEIGHTS_FILE) for d in (run.run_dir, whole_run))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_tiny_run_gives_the_pinned_loss_and_scores(whole_run):
    """Measured on the single-function pipeline before it was split into stages (the same numbers, weights
    equal bit for bit there and here); rel 1e-5 leaves room for another CPU's float rounding, not for a
    change in what the stages do or the order they draw random numbers in."""
    saved = json.loads((whole_run / RESULTS_FILE).read_text())
    assert saved["steps"] == {"distill": 2, "finetune": 3}
    assert saved["final_loss"] == pytest.approx(PINNED_LOSS, rel=1e-5)
    assert saved["stage_scores"] == PINNED_STAGE_SCORES

