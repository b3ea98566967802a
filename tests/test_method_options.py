"""A method's options are validated once, into its options dataclass, and that object goes from the run config
through convert(), the layers, save and load; the config reads and validates them without importing torch."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from luna_convert.conversion import CONFIG_ATTR, convert, linear_attention_modules
from luna_convert.errors import ConversionError, LunaConvertError
from luna_convert.linear_methods import METHODS
from luna_convert.linear_methods.luna_options import LunaOptions
from luna_convert.linear_methods.registry import OPTIONS, Method, register
from luna_convert.run import pipeline
from luna_convert.run.config import RunConfig
from luna_convert.serialization import CONVERSION_FILE, load, save

from builders import config_for, write_bert_checkpoint, write_sst2
from conftest import example_inputs, logits_of, make_bert


@pytest.fixture
def count_validations(monkeypatch):
    """calls[0]: how many LunaOptions objects were validated (``__post_init__`` ran) since the fixture began."""
    calls = [0]
    check = LunaOptions.__post_init__

    def counted(self):
        calls[0] += 1
        check(self)

    monkeypatch.setattr(LunaOptions, "__post_init__", counted)
    return calls


def test_a_run_validates_its_options_once_and_converts_with_that_object(tmp_path, count_validations, monkeypatch):
    config = config_for(write_bert_checkpoint(tmp_path / "bert"), write_sst2(tmp_path / "SST-2"), "sst2", "luna",
                        tmp_path / "out", max_steps=0)
    config.method_options = {"projections": 4, "channels": 4, "convert_local_layers": True}
    count_validations[0] = 0
    seen = []

    def spy(model, method, *args, **kwargs):
        seen.append(kwargs)
        return convert(model, method, *args, **kwargs)

    monkeypatch.setattr(pipeline, "convert", spy)
    results = pipeline.run_conversion(config)
    assert count_validations[0] == 1  # once, with the config; pre-flight, convert, the layers and save reuse it
    (given,) = seen
    assert given["options"] is config.attention_options() and given["convert_local_layers"] is True
    assert "projections" not in given  # the object, not the options by name
    assert results.conversion.options == asdict(config.attention_options())
    meta = json.loads((Path(results.run_dir) / "model" / CONVERSION_FILE).read_text())
    assert meta["conversion"]["options"] == asdict(LunaOptions(projections=4, channels=4))


def test_the_config_keeps_one_object_until_its_options_change(count_validations):
    config = RunConfig(method_options={"projections": 4})
    config.validate()
    first = config.attention_options()
    config.validate()
    assert config.attention_options() is first and count_validations[0] == 1
    config.method_options["projections"] = 8  # changed in place: validated again
    assert config.attention_options().projections == 8 and count_validations[0] == 2
    config.method_options["projections"] = 8.0  # equal, but not an integer: not the cached object
    with pytest.raises(ConversionError, match="projections must be a positive integer"):
        config.attention_options()
    assert RunConfig(method="softmax", method_options={"projections": -1}).attention_options() is None


def test_layers_and_the_saved_folder_hold_the_one_object_and_load_rebuilds_it(tmp_path, count_validations):
    options = LunaOptions(projections=4, channels=4, dwc=False)
    model = make_bert()
    report = convert(model, "luna", options=options)
    assert count_validations[0] == 1  # only the object made above
    assert report.options is options and getattr(model, CONFIG_ATTR).options is options
    layers = linear_attention_modules(model)
    assert layers and all(layer.options is options and type(layer.options) is LunaOptions for layer in layers)
    assert all(layer.phi_q.options is options for layer in layers)
    inputs = example_inputs("hf-bert")
    with torch.no_grad():
        expected = logits_of(model, inputs)
    folder = save(model, tmp_path / "model")
    assert json.loads((folder / CONVERSION_FILE).read_text())["conversion"]["options"] == asdict(options)
    count_validations[0] = 0
    loaded = load(folder)
    assert count_validations[0] == 1  # the saved fields read into one object, handed to every layer
    rebuilt = getattr(loaded, CONFIG_ATTR).options
    assert type(rebuilt) is LunaOptions and rebuilt == options
    assert all(layer.options is rebuilt for layer in linear_attention_modules(loaded))
    with torch.no_grad():
        assert torch.equal(logits_of(loaded, inputs), expected)


def test_a_folder_with_options_saved_by_name_and_missing_some_still_loads(tmp_path):
    """linear_attention.json written before an option existed: the dict form, a key missing; it loads into
    the options object, the missing key at the value that version used (``saved_before``)."""
    model = make_bert()
    convert(model, "luna", projections=4, channels=2, exp_span=LunaOptions.saved_before["exp_span"])
    folder = save(model, tmp_path / "model")
    meta = json.loads((folder / CONVERSION_FILE).read_text())
    del meta["conversion"]["options"]["exp_span"]
    (folder / CONVERSION_FILE).write_text(json.dumps(meta))
    options = getattr(load(folder), CONFIG_ATTR).options
    assert type(options) is LunaOptions and options.exp_span == LunaOptions.saved_before["exp_span"]
    meta["conversion"]["options"]["no_such_option"] = 1
    (folder / CONVERSION_FILE).write_text(json.dumps(meta))
    with pytest.raises(LunaConvertError, match=r"unknown option\(s\) \['no_such_option'\] for method 'luna'"):
        load(folder)


def test_the_run_config_reads_and_validates_options_without_torch():
    code = ("import sys\n"
            "from luna_convert.run.config import RunConfig\n"
            "assert 'torch' not in sys.modules, 'importing the config loaded torch'\n"
            "options = RunConfig.from_dict({'method': 'sorting', 'method_options': {'projections': 3}}).attention_options()\n"
            "assert type(options).__name__ == 'SortingOptions' and options.projections == 3\n"
            "for bad in ({'projectons': 3}, {'window': 2}):\n"
            "    try:\n"
            "        RunConfig.from_dict({'method': 'sorting', 'method_options': bad})\n"
            "    except Exception as e:\n"
            "        print(type(e).__name__, e)\n"
            "assert 'torch' not in sys.modules, 'validating the options loaded torch'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("ConversionError unknown option(s) ['projectons'] for method 'sorting'. Did you mean "
                               "projections?")
    assert lines[1].startswith("ConversionError invalid options for method 'sorting' (window must be 0 for 'sorting'")


def test_the_cli_help_imports_no_torch():
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom luna_convert.cli import app\n"
            "result = CliRunner().invoke(app, ['run', '--help'])\n"
            "assert result.exit_code == 0, result.output\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_every_options_module_declares_what_its_method_file_registers():
    for name, declared in OPTIONS.items():
        assert METHODS[name].options is declared.options and METHODS[name].kind == declared.kind, name
    assert {"luna", "t2r", "t2r-hh", "sorting"} <= set(OPTIONS)


def test_a_method_registered_with_other_options_than_declared_is_refused():
    elu = METHODS["elu"]
    with pytest.raises(ValueError, match="'luna' is registered twice"):
        register(Method(name="luna", core=elu.core, description="", paper="", details=""))
    declared = dict(OPTIONS)
    try:
        OPTIONS["test-mismatch"] = OPTIONS["luna"]
        with pytest.raises(ValueError, match="declared with LunaOptions .* registered with AttentionOptions"):
            register(Method(name="test-mismatch", core=elu.core, description="", paper="", details=""))
        assert "test-mismatch" not in METHODS
    finally:
        OPTIONS.clear()
        OPTIONS.update(declared)


def test_an_lra_encoder_validates_its_options_once_for_all_its_blocks(count_validations):
    from luna_convert.lra.config import LRAConfig
    from luna_convert.lra.model import EncoderSettings, LRAEncoder

    config = LRAConfig(method="luna", method_options={"luna": {"projections": 4}})
    config.check()  # validates the options, as every LRA run's config is
    model = LRAEncoder(EncoderSettings(), vocab=16, num_classes=2, max_length=8, method="luna",
                       options=config.attention_options())
    layers = [block.attention.linear for block in model.blocks]
    assert len(layers) > 1 and count_validations[0] == 1
    assert all(layer.options is layers[0].options for layer in layers) and layers[0].options.projections == 4


def test_compare_validates_each_methods_options_once_for_all_its_runs(tmp_path, count_validations, monkeypatch):
    from luna_convert.run import compare

    class Stop(Exception):
        pass

    def first_run(cfg, console=None):
        cfg.check_runnable()  # what run_conversion does first
        assert type(cfg.attention_options()) is LunaOptions and cfg.attention_options().projections == 4
        raise Stop

    monkeypatch.setattr(compare, "run_conversion", first_run)
    config = RunConfig(model="some-model", task="sst2", method="luna", method_options={"projections": 4})
    with pytest.raises(Stop):
        compare.run_compare(config, ["luna"], [0, 1], tmp_path / "cmp", control=False)
    assert count_validations[0] == 1  # checked before any run starts; the run's config is a copy of that one


def test_compares_control_is_the_configs_control_copy(tmp_path, monkeypatch):
    """The control run converts nothing: no method options, no layers kept (``RunConfig.control``)."""
    from luna_convert.run import compare

    class Stop(Exception):
        pass

    def first_run(cfg, console=None):
        assert (cfg.method, cfg.method_options, cfg.keep_softmax_layers) == ("softmax", {}, [])
        assert cfg.attention_options() is None and cfg.run_dir.endswith("softmax-seed0")
        raise Stop

    monkeypatch.setattr(compare, "run_conversion", first_run)
    config = RunConfig(model="some-model", task="sst2", method="luna", method_options={"projections": 4},
                       keep_softmax_layers=[0])
    with pytest.raises(Stop):
        compare.run_compare(config, ["luna"], [0], tmp_path / "cmp")
    assert config.method_options == {"projections": 4} and config.keep_softmax_layers == [0]
