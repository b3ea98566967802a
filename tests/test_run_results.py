"""The run's record (``run.results.RunResults``): written once, read back by attribute, old files still read."""

from __future__ import annotations

import json

import pytest

from luna_convert.errors import LunaConvertError
from luna_convert.run.results import RESULTS_SCHEMA_VERSION, RunResults

# results.json as runs wrote it before the record had a schema version (every key the pipeline wrote then).
OLD_RESULTS = """{
  "recipe": "sst2-luna", "method": "luna", "task": "sst2", "model": "bert-base-uncased",
  "headline_metric": "accuracy", "teacher_score": 0.9, "converted_score": 0.875, "recovered_pct": 97.2222,
  "stage_scores": {"after_conversion": 0.5, "after_distillation": 0.7, "final": 0.875},
  "head_fit": {"mean_kl": 0.125, "heads": [[0.1, 0.2]]},
  "lora": null, "method_recipe": {"train.added_lr": 0.001},
  "teacher_metrics": {"accuracy": 0.9, "f1": 0.89}, "converted_metrics": {"accuracy": 0.875, "f1": 0.86},
  "eval_examples": 872, "truncated_examples": 3, "truncated_by_split": {"validation": 3},
  "resolved": null, "steps": {"distill": 4, "finetune": 6}, "final_loss": 0.31,
  "timings": {"teacher_eval_s": 1.5, "distill_s": 2.0, "finetune_s": 12.0, "eval_s": 1.25, "total_s": 20.0},
  "seed": 3, "num_processes": 1, "device": "cpu",
  "conversion": {"method": "luna", "options": {"feature_dim": 16}, "params_added": 1234,
                 "modules": [{"name": "layer.0"}, {"name": "layer.1"}], "kept_local": [], "kept_softmax": []},
  "config": {"model": "bert-base-uncased", "task": "sst2", "method": "luna", "seed": 3},
  "versions": {"luna_convert": "0.1.0", "torch": "2.5.0"},
  "run_dir": "outputs/sst2-luna-20250101-120000", "finished_at": "2025-01-01T12:30:00+00:00"
}"""


def test_an_old_results_file_reads_by_attribute_and_writes_back_the_same_keys(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(OLD_RESULTS)
    run = RunResults.read(path)
    assert (run.method, run.task, run.headline_metric, run.teacher_score, run.converted_score) == \
        ("luna", "sst2", "accuracy", 0.9, 0.875)
    assert (run.steps.distill, run.steps.finetune) == (4, 6)
    assert (run.timings.distill_s, run.timings.finetune_s, run.timings.total_s) == (2.0, 12.0, 20.0)
    assert run.conversion.options == {"feature_dim": 16} and run.conversion.params_added == 1234
    assert len(run.conversion.modules) == 2 and run.attention_kl == 0.125
    assert run.stage_score("after_distillation") == 0.7 and run.truncated_by_split == {"validation": 3}
    assert run.finished_at == "2025-01-01T12:30:00+00:00" and run.run_dir.endswith("120000")
    # Written back: the same keys and values, plus the version.
    run.write(tmp_path / "again.json")
    again = json.loads((tmp_path / "again.json").read_text())
    assert again == {**json.loads(OLD_RESULTS), "schema_version": RESULTS_SCHEMA_VERSION}
    assert next(iter(again)) == "schema_version"
    assert RunResults.read(tmp_path / "again.json") == run


def test_a_minimal_old_file_takes_the_defaults_and_keeps_keys_it_does_not_know(tmp_path):
    data = {"method": "t2r", "task": "mrpc", "headline_metric": "f1", "teacher_score": 0.8, "converted_score": 0.6,
            "run_dir": "r", "timings": {"finetune_s": 3.0}, "a_later_key": [1, 2]}
    run = RunResults.from_json(data)
    assert run.stage_score("final") == 0.6 and run.stage_score("after_conversion") is None
    assert run.steps.finetune == 0 and run.timings.distill_s is None and run.conversion is None
    assert run.extra == {"a_later_key": [1, 2]} and run.attention_kl is None
    assert run.to_json() == {**data, **{k: v for k, v in run.to_json().items() if k not in data}}
    assert run.to_json()["timings"] == {"finetune_s": 3.0}  # a stage the run did not have stays absent
    assert run["steps"] == {"distill": 0, "finetune": 0}  # the JSON form, by key


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("converted_score"), "lacks converted_score"),
    (lambda d: d.update(schema_version=RESULTS_SCHEMA_VERSION + 1), "newer than this luna-convert"),
    (lambda d: d.update(steps={"distill": 1, "pretrain": 2}), "pretrain"),
])
def test_a_results_file_no_version_wrote_is_one_line_error(tmp_path, change, message):
    data = json.loads(OLD_RESULTS)
    change(data)
    (tmp_path / "results.json").write_text(json.dumps(data))
    with pytest.raises(LunaConvertError, match=message) as e:
        RunResults.read(tmp_path / "results.json")
    assert "\n" not in str(e.value) and "results.json" in str(e.value)


def test_a_run_writes_its_record_once_and_it_reads_back_equal(tmp_path):
    from builders import config_for, write_bert_checkpoint, write_sst2
    from luna_convert.run.pipeline import run_conversion

    config = config_for(write_bert_checkpoint(tmp_path / "bert"), write_sst2(tmp_path / "SST-2"), "sst2", "hedgehog",
                        tmp_path / "out", max_steps=1)
    config.distill.steps = 1
    results = run_conversion(config)
    assert isinstance(results, RunResults) and results.schema_version == RESULTS_SCHEMA_VERSION
    saved = RunResults.read(tmp_path / "out" / results.run_dir.rsplit("/", 1)[-1] / "results.json")
    assert saved == results
    assert (saved.steps.distill, saved.steps.finetune) == (1, 1) and saved.timings.distill_s > 0
    assert saved.conversion.method == "hedgehog" and saved.run_config().method == "hedgehog"
