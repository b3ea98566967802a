"""A converted model is saved and loaded the ways users already save models: pickle and torch.save (in a fresh
process too), transformers' save_pretrained -> AutoModel*.from_pretrained (converted after ``import luna_convert``,
refused without it, never a softmax model), luna_convert.load of a save_pretrained folder, and timm state dicts
that a plain timm model refuses."""

from __future__ import annotations

import copy
import io
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import luna_convert
from luna_convert.conversion import CONFIG_ATTR, convert, is_converted, linear_attention_modules
from luna_convert.linear_methods import METHODS
from luna_convert.serialization import CONVERSION_FILE, load, save

from conftest import example_inputs, logits_of, make_bert, make_hf_vit, make_timm_vit

BUILDERS = {"hf-bert": make_bert, "hf-vit": make_hf_vit, "timm-vit": make_timm_vit}
METHOD_NAMES = sorted(METHODS)
ROOT = Path(__file__).resolve().parent.parent


def converted(arch: str, method: str):
    """A tiny model of ``arch`` converted with ``method``, every added parameter moved off its initial value (so
    that a load that rebuilt the layers without reading their weights would show)."""
    model = BUILDERS[arch]()
    convert(model, method)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in linear_attention_modules(model):
            for p in layer.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def logits(model, arch: str) -> torch.Tensor:
    with torch.no_grad():
        return logits_of(model.eval(), example_inputs(arch))


def run_python(code: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT / "tests")


# ------------------------------------------------------------------ pickle and torch.save
@pytest.mark.parametrize("arch", sorted(BUILDERS))
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_pickle_torch_save_and_deepcopy_give_the_same_model(arch, method):
    model = converted(arch, method)
    want = logits(model, arch)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = {"pickle": pickle.loads(pickle.dumps(model)), "torch.save": torch.load(buffer, weights_only=False),
              "deepcopy": copy.deepcopy(model)}
    for how, again in copies.items():
        assert is_converted(again) and type(again) is type(model), how
        assert getattr(again, CONFIG_ATTR) == getattr(model, CONFIG_ATTR), how
        assert torch.equal(logits(again, arch), want), how


def test_converted_models_unpickle_in_a_fresh_process(tmp_path):
    """Every method on a BERT, a transformers ViT and a timm ViT, pickled here and unpickled in a new interpreter
    that imports nothing but torch and pickle (unpickling imports what it needs): outputs equal to the bit."""
    cases = []
    for arch in sorted(BUILDERS):
        for method in METHOD_NAMES:
            model = converted(arch, method)
            path = tmp_path / f"{arch}-{method}.pt"
            torch.save({"model": model, "inputs": example_inputs(arch), "logits": logits(model, arch)}, path)
            cases.append(path)
    code = ("import sys, torch\n"
            "assert 'luna_convert' not in sys.modules\n"
            "for path in sys.argv[1:]:\n"
            "    case = torch.load(path, weights_only=False)\n"
            "    model, inputs = case['model'].eval(), case['inputs']\n"
            "    with torch.no_grad():\n"
            "        out = model(inputs['x']) if 'x' in inputs else model(**inputs).logits\n"
            "    assert torch.equal(out, case['logits']), path\n"
            "    assert any(type(m).__name__.startswith('Linear') for m in model.modules()), path\n"
            "print('unpickled', len(sys.argv) - 1)\n")
    out = run_python(code, *cases)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["unpickled", str(len(METHOD_NAMES) * len(BUILDERS))]


# ------------------------------------------------------------------ save_pretrained -> from_pretrained
AUTO_CLASS = {"hf-bert": "AutoModelForSequenceClassification", "hf-vit": "AutoModelForImageClassification"}


@pytest.mark.parametrize("arch", sorted(AUTO_CLASS))
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_save_pretrained_then_auto_from_pretrained_gives_the_converted_model(arch, method, tmp_path):
    import transformers

    model = converted(arch, method)
    model.save_pretrained(tmp_path)
    fields = json.loads((tmp_path / "config.json").read_text())
    original_type = type(model.config).__mro__[2].model_type  # Linear<Config> -> (mixin, Config)
    assert fields["model_type"] == "luna_convert" and fields["base_model_type"] == original_type
    assert fields["linear_attention"]["method"] == method
    # in memory the config is still the original type's (peft and others read it)
    assert model.config.model_type == original_type and model.config.to_dict()["model_type"] == original_type
    loaded = getattr(transformers, AUTO_CLASS[arch]).from_pretrained(tmp_path)
    assert type(loaded) is type(model) and is_converted(loaded)
    assert getattr(loaded, CONFIG_ATTR).to_dict() == getattr(model, CONFIG_ATTR).to_dict()
    assert torch.equal(logits(loaded, arch), logits(model, arch))
    # luna_convert.load reads the same folder (the record from config.json)
    assert not (tmp_path / CONVERSION_FILE).exists()
    assert torch.equal(logits(load(tmp_path), arch), logits(model, arch))


def test_a_bare_encoder_and_a_sharded_folder_load_converted(tmp_path):
    model = converted("hf-bert", "llops")  # LLoPS keeps unsaved index buffers: they must be made again on load
    model.save_pretrained(tmp_path / "whole")
    bare = __import__("transformers").AutoModel.from_pretrained(tmp_path / "whole")
    assert type(bare).__name__ == "BertModel" and len(linear_attention_modules(bare)) == 2
    inputs = example_inputs("hf-bert")
    with torch.no_grad():
        assert torch.equal(bare(**inputs).last_hidden_state, model.bert(**inputs).last_hidden_state)
    model.save_pretrained(tmp_path / "shards", max_shard_size="40KB")
    assert len(list((tmp_path / "shards").glob("model-*.safetensors"))) > 1
    assert torch.equal(logits(load(tmp_path / "shards"), "hf-bert"), logits(model, "hf-bert"))


@pytest.mark.parametrize("method", ["llops", "taylor"])
def test_buffers_no_file_holds_are_made_again_after_transformers_loads(method):
    """transformers' loader leaves a meta-built model's unsaved buffers as uninitialised memory (which may happen to
    hold the right values); ``restore_unsaved_buffers`` sets them as a new layer computes them."""
    from luna_convert.serialization import restore_unsaved_buffers

    model = converted("hf-bert", method)
    want = {}
    for i, layer in enumerate(linear_attention_modules(model)):
        saved = set(layer.state_dict())
        for name, buffer in layer.named_buffers():
            if name not in saved:
                want[i, name] = buffer.clone()
                buffer.fill_(-7 if not buffer.is_floating_point() else float("nan"))
    assert want, f"{method} keeps no unsaved buffer: pick a method that does"
    restore_unsaved_buffers(model)
    layers = linear_attention_modules(model)
    assert all(torch.equal(layers[i].get_buffer(name), value) for (i, name), value in want.items())


def test_luna_convert_save_writes_a_folder_the_auto_classes_load_converted(tmp_path):
    from transformers import AutoModelForSequenceClassification

    model = converted("hf-bert", "luna")
    folder = save(model, tmp_path / "m")
    loaded = AutoModelForSequenceClassification.from_pretrained(folder)
    assert is_converted(loaded) and torch.equal(logits(loaded, "hf-bert"), logits(model, "hf-bert"))


AUTO_LOAD = ("from transformers import AutoModelForSequenceClassification as Auto\n"
             "def logits(model):\n"
             "    with torch.no_grad():\n"
             "        return model.eval()(**inputs).logits\n")


def test_without_luna_convert_transformers_refuses_the_folder_and_with_it_loads_it(tmp_path):
    """In a fresh process: transformers alone refuses the folder with an error naming luna_convert, instead of
    loading softmax BERT; ``import luna_convert`` afterwards (transformers already imported) registers the type."""
    model = converted("hf-bert", "luna")
    model.save_pretrained(tmp_path / "m")
    torch.save({"inputs": example_inputs("hf-bert"), "logits": logits(model, "hf-bert")}, tmp_path / "want.pt")
    code = ("import sys, torch\n"
            f"want = torch.load(sys.argv[2]); inputs = want['inputs']\n{AUTO_LOAD}"
            "try:\n"
            "    Auto.from_pretrained(sys.argv[1])\n"
            "except ValueError as e:\n"
            "    print('refused:', str(e).splitlines()[0])\n"
            "else:\n"
            "    print('loaded without luna_convert')\n"
            "assert 'luna_convert' not in sys.modules\n"
            "import luna_convert\n"
            "model = Auto.from_pretrained(sys.argv[1])\n"
            "assert luna_convert.is_converted(model) and torch.equal(logits(model), want['logits'])\n"
            "print('converted')\n")
    out = run_python(code, tmp_path / "m", tmp_path / "want.pt")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("refused:") and "model type `luna_convert`" in lines[0], lines
    assert lines[-1] == "converted"


def test_importing_luna_convert_first_registers_when_transformers_is_imported(tmp_path):
    model = converted("hf-bert", "hedgehog")
    model.save_pretrained(tmp_path / "m")
    torch.save({"inputs": example_inputs("hf-bert"), "logits": logits(model, "hf-bert")}, tmp_path / "want.pt")
    code = ("import sys, torch\n"
            "import luna_convert\n"
            "assert 'transformers' not in sys.modules, 'importing luna_convert imported transformers'\n"
            f"want = torch.load(sys.argv[2]); inputs = want['inputs']\n{AUTO_LOAD}"
            "model = Auto.from_pretrained(sys.argv[1])\n"
            "assert luna_convert.is_converted(model) and torch.equal(logits(model), want['logits'])\n"
            "print('converted')\n")
    out = run_python(code, tmp_path / "m", tmp_path / "want.pt")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["converted"]


def test_a_folder_loaded_through_auto_saves_and_pickles_again(tmp_path):
    from transformers import AutoModelForImageClassification

    model = converted("hf-vit", "luna")
    model.save_pretrained(tmp_path / "a")
    loaded = AutoModelForImageClassification.from_pretrained(tmp_path / "a")
    loaded.save_pretrained(tmp_path / "b")
    again = AutoModelForImageClassification.from_pretrained(tmp_path / "b")
    want = logits(model, "hf-vit")
    assert torch.equal(logits(again, "hf-vit"), want)
    assert torch.equal(logits(pickle.loads(pickle.dumps(again)), "hf-vit"), want)


# ------------------------------------------------------------------ timm
def test_a_plain_timm_model_refuses_a_converted_state_dict_and_luna_convert_load_reads_it(tmp_path):
    model = converted("timm-vit", "luna")
    fresh = make_timm_vit()
    with pytest.raises(RuntimeError, match="Unexpected key"):
        fresh.load_state_dict(model.state_dict(), strict=True)
    folder = luna_convert.save(model, tmp_path / "m")  # the documented route: safetensors + linear_attention.json
    assert torch.equal(logits(load(folder), "timm-vit"), logits(model, "timm-vit"))
