"""The run config as one typed object: config.json's layout written and read back unchanged, defaults for
keys an older folder lacks, and every bad setting refused when the config is built, before a model loads."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from builders import write_bert_checkpoint, write_sst2
from luna_convert.cli import app
from luna_convert.errors import ConversionError, LunaConvertError
from luna_convert.run.config import RunConfig
from luna_convert.run.recipes import apply_overrides, load_recipe

# The defaults as recipes.DEFAULTS held them before the config was typed (config.json's settings, in order).
DEFAULTS_BEFORE = {
    "name": None, "description": "", "model": None, "task": None, "data_dir": None, "eval_split": None,
    "train_split": None, "metric": None, "columns": {"text": None, "text_pair": None, "label": None},
    "encoding": None, "skip_unreadable_images": False,  # added since, with defaults that read as before
    "method": "luna", "method_options": {}, "keep_softmax_layers": [], "seed": 42, "output_dir": "outputs",
    "train": {"lr": 2e-5, "added_lr": None, "weight_decay": 0.01, "schedule": "linear", "warmup_ratio": 0.06,
              "epochs": 3.0, "max_steps": None, "batch_size": 32, "eval_batch_size": 64, "grad_accum": 1,
              "max_length": 128, "image_size": None, "mixed_precision": "no", "checkpoint_every": 0,
              "max_grad_norm": 1.0, "augment": True, "max_train_examples": None, "max_eval_examples": None,
              "score_stages": True, "embedding_loss": "cosine", "teacher_kd": 0.0},
    "lora": {"rank": 0, "alpha": None, "dropout": 0.0},
    "distill": {"steps": None, "default_steps": 300, "lr": 1e-2, "target": "attention", "batch_size": None},
    "layer_selection": {"target_pct": 99.0, "holdout": 0.15, "time_lengths": [4096, 8192]},  # added since
}
# What a CLI run on own data adds after the settings (the order the dict-based config wrote them in).
RECORD_BEFORE = ["overwrite", "run_dir", "auto", "resolved"]


def test_defaults_and_setting_names_are_those_of_the_dict_config():
    assert RunConfig().to_dict() == DEFAULTS_BEFORE
    assert json.dumps(RunConfig().to_dict()) == json.dumps(DEFAULTS_BEFORE)  # same key order, same types
    dotted = [f"{k}.{leaf}" if isinstance(v, dict) and v else k
              for k, v in DEFAULTS_BEFORE.items() for leaf in (v if isinstance(v, dict) and v else [None])]
    assert RunConfig.setting_names() == dotted


@pytest.fixture(scope="module")
def own_data_run(tmp_path_factory):
    """config.json of a CLI run on own data (every record key written), as the pipeline saves it."""
    root = tmp_path_factory.mktemp("config-run")
    model, data = write_bert_checkpoint(root / "bert"), write_sst2(root / "SST-2")
    run_dir = root / "run"
    result = CliRunner().invoke(app, ["run", "--model", str(model), "--data-dir", str(data), "--method", "luna",
                                      "--max-steps", "1", "--batch-size", "8", "--run-dir", str(run_dir),
                                      "--output-dir", str(root / "out"), "--set", "method_options.projections=8",
                                      "--keep-softmax-layers", "0"])
    assert result.exit_code == 0, result.output[-2000:]
    return run_dir


def test_saved_config_json_keeps_its_layout_and_reads_back_unchanged(own_data_run):
    text = (own_data_run / "config.json").read_text()
    saved = json.loads(text)
    assert list(saved) == list(DEFAULTS_BEFORE) + RECORD_BEFORE
    for section in ("columns", "train", "lora", "distill"):
        assert list(saved[section]) == list(DEFAULTS_BEFORE[section]), section
    assert saved["overwrite"] is False and saved["run_dir"] == str(own_data_run)
    assert saved["auto"] == ["train.lr", "train.epochs", "train.max_length"]
    assert saved["resolved"]["task"] == saved["task"] == "text-classification"
    assert saved["method_options"] == {"projections": 8} and saved["keep_softmax_layers"] == [0]
    config = RunConfig.from_dict(saved)
    assert config.train.max_steps == 1 and config.resolved == saved["resolved"]
    assert config.to_dict() == saved
    assert json.dumps(config.to_dict(), indent=2) + "\n" == text  # byte for byte what the run wrote
    results = json.loads((own_data_run / "results.json").read_text())
    assert results["config"] == saved


def test_a_config_saved_before_newer_settings_existed_loads_with_their_defaults():
    saved = {**DEFAULTS_BEFORE, "model": "bert", "task": "sst2", "seed": 7, "train": {"lr": 1e-4, "max_steps": 5}}
    for newer in ("keep_softmax_layers", "lora", "metric", "train_split", "columns"):
        del saved[newer]
    saved["distill"] = {"steps": 2}
    config = RunConfig.from_dict(saved)
    assert (config.seed, config.train.lr, config.train.max_steps, config.distill.steps) == (7, 1e-4, 5, 2)
    assert config.keep_softmax_layers == [] and config.lora == RunConfig().lora and config.metric is None
    assert config.train.score_stages is True and config.distill.target == "attention"
    assert config.to_dict() == {**DEFAULTS_BEFORE, "model": "bert", "task": "sst2", "seed": 7,
                                "train": {**DEFAULTS_BEFORE["train"], "lr": 1e-4, "max_steps": 5},
                                "distill": {**DEFAULTS_BEFORE["distill"], "steps": 2}}


def test_from_dict_owns_its_lists_and_apply_overrides_leaves_its_input_alone():
    saved = {"method_options": {"projections": 8}, "keep_softmax_layers": [1]}
    config = RunConfig.from_dict(saved)
    config.method_options["projections"] = 4
    config.keep_softmax_layers.append(0)
    assert saved == {"method_options": {"projections": 8}, "keep_softmax_layers": [1]}
    changed = apply_overrides(config, {"train.lr": 1e-3, "method_options.channels": 8})
    assert config.train.lr == 2e-5 and "channels" not in config.method_options
    assert changed.train.lr == 1e-3 and changed.method_options == {"projections": 4, "channels": 8}


# ------------------------------------------------------------------ unknown names and types
def test_unknown_keys_name_the_setting_and_the_close_ones():
    with pytest.raises(LunaConvertError, match=r"unknown recipe setting 'train\.lrr'\. Did you mean train\.lr"):
        RunConfig.from_dict({"train": {"lrr": 1}})
    with pytest.raises(LunaConvertError, match=r"unknown setting 'train\.lrr'\. Did you mean train\.lr.*"
                                               r"Available: columns\.label, columns\.text, "):
        apply_overrides(load_recipe(None), {"train.lrr": 1})
    with pytest.raises(LunaConvertError, match=r"unknown recipe setting 'run_dir'"):  # the run's record, not a setting
        RunConfig.from_recipe({"run_dir": "somewhere"})
    with pytest.raises(LunaConvertError, match=r"unknown setting 'resolved'"):
        apply_overrides(load_recipe(None), {"resolved": {}})


@pytest.mark.parametrize("build, message", [
    (lambda: RunConfig.from_dict({"train": {"lr": "fast"}}), "setting train.lr must be a number, got 'fast'"),
    (lambda: RunConfig.from_dict({"seed": True}), "setting seed must be a number, got True"),
    (lambda: RunConfig.from_dict({"train": {"augment": 1}}), "setting train.augment must be true or false, got 1"),
    (lambda: RunConfig.from_dict({"train": 3}), "recipe setting train must be a mapping"),
    (lambda: RunConfig.from_dict({"method_options": 3}), "setting method_options must be a mapping"),
    (lambda: RunConfig.from_dict([1, 2]), "a run config must be a mapping of settings, got list"),
    (lambda: apply_overrides(RunConfig(), {"train": 3}),
     "setting train is a group of settings; set them one at a time, e.g. --set train.lr=..."),
    (lambda: apply_overrides(RunConfig(), {"method_options": 3}),
     "setting method_options must be a mapping, e.g. --set method_options.projections=16"),
], ids=["number", "bool-as-number", "strict-bool", "section-scalar", "options-scalar", "not-a-mapping",
        "--set-section", "--set-options"])
def test_values_of_the_wrong_type_are_refused(build, message):
    with pytest.raises(LunaConvertError) as error:
        build()
    assert str(error.value) == message or str(error.value).startswith(message), str(error.value)


def test_numbers_widen_to_the_type_of_their_default():
    config = RunConfig.from_dict({"train": {"epochs": 3, "lr": 1}, "lora": {"dropout": 0}, "description": 7})
    assert type(config.train.epochs) is float and type(config.train.lr) is float
    assert type(config.lora.dropout) is float and config.description == "7"
    assert config.to_dict()["train"]["epochs"] == 3.0 and config.train.batch_size == 32


# ------------------------------------------------------------------ range and choice checks
RANGE_CASES = [
    ({"task": "sst3"}, "unknown task 'sst3'"),
    ({"method": "lunar"}, "Did you mean luna"),
    ({"train.batch_size": 0}, "train.batch_size must be a positive integer, got 0"),
    ({"train.eval_batch_size": 1.5}, "train.eval_batch_size must be a positive integer, got 1.5"),
    ({"train.grad_accum": 0}, "train.grad_accum must be a positive integer, got 0"),
    ({"train.lr": 0}, "train.lr must be positive, got 0.0"),
    ({"train.lr": None}, "train.lr must be positive, got None"),
    ({"keep_softmax_layers": "0"}, "keep_softmax_layers must be a list of layer indices, e.g. [0, 5], got '0'"),
    ({"method": "softmax", "keep_softmax_layers": [0]}, "keep_softmax_layers needs a linear method"),
    ({"train.mixed_precision": "fp8"}, "train.mixed_precision must be no, bf16 or fp16, got 'fp8'"),
    ({"train.max_steps": -5}, "train.max_steps must be a whole number of steps (0: no finetuning), or null (then "
                              "train.epochs counts), "
                              "got -5; fix it with --set train.max_steps=..."),
    ({"train.epochs": 0}, "train.epochs must be a positive number, got 0.0"),
    ({"train.checkpoint_every": -1}, "train.checkpoint_every must be a whole number of steps"),
    ({"train.warmup_ratio": 1}, "train.warmup_ratio must be a fraction in [0, 1), got 1.0"),
    ({"train.added_lr": 0}, "train.added_lr must be positive, or null (train.lr), got 0"),
    ({"train.weight_decay": -0.1}, "train.weight_decay must be 0 or more, got -0.1"),
    ({"train.max_grad_norm": -1}, "train.max_grad_norm must be 0 or more (0 or null: no clipping), got -1.0"),
    ({"train.max_length": 0}, "train.max_length must be a positive integer, got 0"),
    ({"train.image_size": 0}, "train.image_size must be a positive integer or null (the model's size), got 0"),
    ({"train.schedule": "wavy"}, "train.schedule must be linear, cosine or constant, got 'wavy'"),
    ({"train.max_train_examples": 0}, "train.max_train_examples must be a positive integer or null (all), got 0"),
    ({"train.max_eval_examples": 0}, "train.max_eval_examples must be a positive integer or null (all), got 0"),
    ({"distill.steps": -3}, "distill.steps must be 0 or more, or null (the method's default), got -3"),
    ({"distill.default_steps": -1}, "distill.default_steps must be 0 or more, got -1"),
    ({"distill.lr": 0}, "distill.lr must be positive, got 0.0"),
    ({"distill.target": "weights"}, "distill.target must be attention, output or logits, got 'weights'"),
    ({"distill.batch_size": 0}, "distill.batch_size must be a positive integer or null (train.batch_size), got 0"),
    ({"lora.rank": -1}, "lora.rank must be 0 (off) or a positive integer, got -1"),
    ({"lora.alpha": 0}, "lora.alpha must be positive, or null (2 x rank), got 0"),
    ({"lora.dropout": 1}, "lora.dropout must be a fraction in [0, 1), got 1.0"),
    ({"method_options.foo": 1}, "unknown option(s) ['foo'] for method 'luna'"),
    ({"method_options.projections": -1}, "invalid options for method 'luna' (projections must be a positive integer"),
    ({"method_options.dwc_kernel": 2}, "dwc_kernel must be a positive odd integer"),
]


@pytest.mark.parametrize("overrides, message", RANGE_CASES, ids=[", ".join(c[0]) for c in RANGE_CASES])
def test_each_bad_setting_is_refused_when_the_config_is_built(overrides, message):
    with pytest.raises(LunaConvertError) as error:
        apply_overrides(load_recipe(None), overrides)  # what --set does
    assert message in str(error.value) and "\n" not in str(error.value)


PYTHON_CASES = [c for c in RANGE_CASES if not any(key.startswith("method_options.") for key in c[0])]


@pytest.mark.parametrize("overrides, message", PYTHON_CASES, ids=[", ".join(c[0]) for c in PYTHON_CASES])
def test_a_config_changed_in_python_is_checked_the_same_way(overrides, message):
    config = RunConfig()
    for key, value in overrides.items():
        config.set_setting(key, value)
    with pytest.raises(LunaConvertError, match=re.escape(message.split(", got")[0])):  # the value is not widened
        config.validate()


def test_a_score_stages_flag_that_is_not_a_bool_is_refused():
    """--set and recipes cannot give a non-bool (their type check is first); a config changed in Python can."""
    config = RunConfig()
    config.train.score_stages = 1
    with pytest.raises(LunaConvertError, match=r"train\.score_stages must be true or false, got 1"):
        config.validate()


def test_a_recipe_without_a_model_loads_and_is_refused_when_a_run_starts(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("description: no model yet\ntrain:\n  lr: 1.0e-4\n")
    config = load_recipe(str(recipe))
    assert config.name == "mine" and config.train.lr == 1e-4 and config.model is None
    with pytest.raises(LunaConvertError, match="^no model given: pass --model"):
        config.check_runnable()
    with pytest.raises(LunaConvertError, match="^no task given: pass --task NAME"):
        replace(config, model="bert").check_runnable()
    replace(config, model="bert", data_dir="mine/").check_runnable()  # own data: the task is inferred
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  schedule: wavy\n")
    with pytest.raises(LunaConvertError, match="train.schedule must be linear, cosine or constant"):
        load_recipe(str(bad))


def test_method_options_pass_convert_s_own_keyword_and_the_control_ignores_options():
    config = apply_overrides(load_recipe(None), {"method_options.convert_local_layers": True})
    assert config.method_options == {"convert_local_layers": True}
    # the control converts nothing: options given for the compared methods do not stop it
    RunConfig(method="softmax", method_options={"projections": -1}).validate()


# ------------------------------------------------------------------ refused before any model is loaded
def _no_model_loads(monkeypatch):
    import luna_convert.run.pipeline as pipeline

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad option was refused")

    monkeypatch.setattr(pipeline, "load_model", refuse)
    monkeypatch.setattr(pipeline, "ensure_builtin", refuse)


def test_a_bad_method_option_on_the_command_line_is_refused_before_the_model_is_looked_at(tmp_path, monkeypatch):
    _no_model_loads(monkeypatch)
    result = CliRunner().invoke(app, ["run", "--model", str(tmp_path / "no-such-model"), "--task", "sst2",
                                      "--output-dir", str(tmp_path / "out"), "--set", "method_options.projections=0"])
    assert result.exit_code == 2, (result.output[-2000:], repr(result.exception))
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "invalid options for method 'luna' (projections must be a positive integer" in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_run_started_from_python_checks_its_options_before_loading_the_model(tmp_path, monkeypatch):
    from luna_convert.run.pipeline import run_conversion

    _no_model_loads(monkeypatch)
    config = RunConfig(model=str(tmp_path / "no-such-model"), task="sst2", output_dir=str(tmp_path / "out"),
                       method="hedgehog", method_options={"feature_dim": 32})  # hedgehog has no feature_dim
    with pytest.raises(ConversionError, match=r"unknown option\(s\) \['feature_dim'\] for method 'hedgehog'"):
        run_conversion(config)
    assert not (tmp_path / "out").exists()
