"""The window hybrid's check (engine/hybrid_check.py): a window run records the score and each layer's output
with the linear part removed, and says so when the linear part is bypassed; other runs record nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from luna_convert.conversion import convert, linear_attention_modules
from luna_convert.engine.hybrid_check import BYPASS_CHANGE, output_change, window_layers
from luna_convert.layers.attention import AttentionMode, attention_mode
from luna_convert.run.pipeline import run_conversion
from builders import config_for, write_bert_checkpoint, write_sst2
from conftest import make_bert


class Lines:
    """A console that keeps what the run says."""

    def __init__(self):
        self.lines = []

    def print(self, *args, **kwargs):
        self.lines.append(" ".join(str(a) for a in args))


@pytest.fixture(scope="module")
def text_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return write_bert_checkpoint(root / "bert"), write_sst2(root / "SST-2")


def _batches(seed: int = 0, n: int = 4, tokens: int = 12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 60, (n, tokens), generator=g)
    mask = torch.ones(n, tokens, dtype=torch.long)
    mask[1, 7:] = 0
    return [{"input_ids": ids, "attention_mask": mask}]


def test_the_linear_part_changes_each_layers_output_until_gamma_is_zero():
    model = make_bert()
    convert(model, "hedgehog", window=2)
    layers = window_layers(model)
    assert len(layers) == len(linear_attention_modules(model)) > 0
    change = output_change(layers, model, _batches())
    assert all(c > BYPASS_CHANGE for c in change), change
    with torch.no_grad():
        for layer in layers:
            layer.window_mix.fill_(-50.0)  # gamma = exp(-50): the linear part weighs nothing
    assert max(output_change(layers, model, _batches())) < 1e-6
    assert all(layer.mode is AttentionMode.LINEAR for layer in layers)  # the check leaves the modes as they were


def test_window_only_mode_is_the_layer_with_gamma_zero_and_refused_without_a_window():
    model = make_bert()
    convert(model, "hedgehog", window=2)
    layer = window_layers(model)[0]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, layer.num_heads, 9, layer.head_dim, generator=g) for _ in range(3))
    with attention_mode([layer], AttentionMode.WINDOW_ONLY):
        alone = layer(q, k, v)
    with torch.no_grad():
        layer.window_mix.fill_(-80.0)
    torch.testing.assert_close(alone, layer(q, k, v), rtol=1e-5, atol=1e-6)
    plain = make_bert()
    convert(plain, "hedgehog")
    with pytest.raises(RuntimeError, match="window"), attention_mode(linear_attention_modules(plain),
                                                                     AttentionMode.WINDOW_ONLY):
        linear_attention_modules(plain)[0](q, k, v)


@pytest.mark.parametrize("window, bypassed", [(1, False), (64, True)])
def test_a_window_run_records_the_check_and_says_when_the_linear_part_is_bypassed(text_setup, tmp_path, window,
                                                                                   bypassed):
    model_dir, data_dir = text_setup
    config = config_for(model_dir, data_dir, "sst2", "hedgehog", tmp_path, max_steps=2)
    config.method_options = {"window": window}
    console = Lines()
    results = run_conversion(config, console=console)
    check = json.loads((Path(results.run_dir) / "results.json").read_text())["hybrid_check"]
    assert check == results.hybrid_check
    assert check["score"] == results.converted_score and len(check["output_change"]) == 2
    assert check["linear_part_bypassed"] is bypassed
    said = [line for line in console.lines if line.startswith("hybrid check")]
    assert len(said) == 1 and ("bypassed" in said[0]) is bypassed
    if bypassed:  # every sentence fits in a 64-token window: the layers are exact softmax, no linear term
        assert check["window_only_score"] == check["score"] and max(check["output_change"]) == 0.0
    else:
        assert max(check["output_change"]) >= BYPASS_CHANGE


def test_a_run_without_a_window_has_no_check(text_setup, tmp_path):
    model_dir, data_dir = text_setup
    results = run_conversion(config_for(model_dir, data_dir, "sst2", "elu", tmp_path, max_steps=1))
    assert results.hybrid_check is None
    assert "hybrid_check" not in json.loads((Path(results.run_dir) / "results.json").read_text())
