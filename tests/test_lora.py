"""The LoRA second stage (peft): what trains, what stays frozen, the merge, and a run with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import example_inputs, make_bert
from luna_convert import convert, load
from luna_convert.conversion import linear_attention_modules
from luna_convert.engine.lora import add_lora, head_module_names, merge_lora
from luna_convert.errors import LunaConvertError
from luna_convert.run.pipeline import run_conversion
from builders import config_for, write_bert_checkpoint, write_sst2


def test_lora_trains_adapters_head_and_what_conversion_added_then_merges_exactly():
    model = make_bert()
    convert(model, "luna", dwc=True)
    assert head_module_names(model) == ["dropout", "classifier"]
    summary = add_lora(model, rank=2)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("classifier.") or ".linear_attn." in n for n in trainable)
    assert any(".linear_attn.dwc." in n for n in trainable) and any("lora_A" in n for n in trainable)
    # every pretrained encoder Linear has an adapter: q, k, v, attention output, intermediate, output, pooler
    assert summary.adapted_layers == 2 * 6 + 1
    assert summary.trainable_params == sum(p.numel() for n, p in model.named_parameters() if n in trainable)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if n not in trainable}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    inputs = example_inputs("hf-bert")
    model.train()
    for _ in range(3):
        opt.zero_grad()
        model(**inputs).logits.pow(2).sum().backward()
        opt.step()
    model.eval()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    with torch.no_grad():
        adapted = model(**inputs).logits
    assert merge_lora(model) == summary.adapted_layers
    assert type(model.bert.encoder.layer[0].attention.self.query) is nn.Linear
    with torch.no_grad():
        merged = model(**inputs).logits
    # float32 merge: relative error measured 6.4e-7 (these three SGD steps at lr 0.5 grow the logits to ~1e4)
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)
    assert all(p.requires_grad for p in model.parameters())
    # the merged update of a pretrained weight has rank <= 2
    delta = model.bert.encoder.layer[0].attention.self.query.weight - frozen[
        "bert.encoder.layer.0.attention.self.query.base_layer.weight"]
    assert delta.abs().max() > 0 and torch.linalg.matrix_rank(delta.double(), atol=1e-6).item() <= 2


def test_run_with_lora_saves_the_plain_converted_model(tmp_path):
    model_dir, data_dir = write_bert_checkpoint(tmp_path / "bert"), write_sst2(tmp_path / "SST-2")
    config = config_for(model_dir, data_dir, "sst2", "hedgehog", tmp_path / "out")
    config.lora.rank = 2
    results = run_conversion(config)
    assert results["lora"]["rank"] == 2 and results["lora"]["alpha"] == 4.0
    assert results["lora"]["trainable_params"] < results["lora"]["total_params"]
    model = load(Path(results["run_dir"]) / "model")
    assert not any("lora" in n for n, _ in model.named_parameters()) and linear_attention_modules(model)
    from luna_convert.run.pipeline import evaluate_model

    again = evaluate_model(results["run_dir"])
    assert again["metrics"][results["headline_metric"]] == pytest.approx(results["converted_score"])
    assert json.loads((Path(results["run_dir"]) / "results.json").read_text())["lora"] == results["lora"]


@pytest.mark.parametrize("key, value, message", [
    ("rank", -1, "lora.rank must be 0 \\(off\\) or a positive integer"),
    ("alpha", 0, "lora.alpha must be positive"),
    ("dropout", 1.0, "lora.dropout must be a fraction"),
])
def test_bad_lora_settings_are_refused_before_the_run(tmp_path, key, value, message):
    config = config_for(tmp_path / "m", tmp_path / "d", "sst2", "luna", tmp_path / "out")
    config.lora.rank = 2
    setattr(config.lora, key, value)
    with pytest.raises(LunaConvertError, match=message):
        config.check_runnable()


def test_lora_without_peft_says_how_to_install(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now raises ImportError
    config = config_for(tmp_path / "m", tmp_path / "d", "sst2", "luna", tmp_path / "out")
    config.lora.rank = 4
    with pytest.raises(LunaConvertError, match=r"LoRA needs the peft library: pip install 'luna-convert\[lora\]'"):
        config.check_runnable()
