"""ModernBERT (transformers 4.57 and 5.x): global layers converted with rotary q/k before the feature map,
local (sliding-window) layers softmax unless convert_local_layers=True, packed inputs refused.
Tiny models built from configs: 3 layers, global / local / global, a window of 2 tokens each side."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import HEADS, HIDDEN, INIT_STD, NUM_LABELS, VOCAB, seed_everything, transformers_major
from luna_convert.layers.attention import AttentionMode
from luna_convert import convert, load, save
from luna_convert.adapters import LinearizedAttention, sliding_window_key_padding_mask
from luna_convert.conversion import feature_map_parameters, is_converted, linear_attention_modules
from luna_convert.errors import ConversionError
from luna_convert.folder_layout import CONVERSION_FILE
from luna_convert.ops.context import AttentionContext
from luna_convert.ops.reference import linear_attention_weights

V5 = transformers_major() >= 5
HEAD_DIM = HIDDEN // HEADS
HALF_WINDOW = 2
CONFIG = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=3, num_attention_heads=HEADS,
              intermediate_size=64, max_position_embeddings=64, global_attn_every_n_layers=2,
              local_attention=2 * HALF_WINDOW, initializer_range=INIT_STD, num_labels=NUM_LABELS, pad_token_id=0,
              bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
GLOBAL, LOCAL = ["model.layers.0.attn", "model.layers.2.attn"], ["model.layers.1.attn"]
KINDS = ["ModernBertForMaskedLM", "ModernBertForSequenceClassification"]


def make(kind: str = KINDS[0], attn_implementation: str | None = None):
    import transformers

    seed_everything()
    config = transformers.ModernBertConfig(**CONFIG)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    return getattr(transformers, kind)(config).eval()


def batch() -> dict:
    """Two sequences of 9 tokens (longer than the window); the first has 3 pads at the end."""
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def converted(model) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, LinearizedAttention)]


# ----------------------------------------------------------------------------- (a) weights kept
@pytest.mark.parametrize("kind", KINDS)
def test_global_layers_convert_keeping_every_weight(kind):
    original = make(kind)
    model = make(kind)
    before = dict((*model.named_parameters(), *model.named_buffers()))
    report = convert(model, "luna")
    assert [m.name for m in report.modules] == converted(model) == GLOBAL
    assert report.kept_local == LOCAL and "kept softmax: 1 sliding-window" in str(report)
    after = dict((*model.named_parameters(), *model.named_buffers()))
    assert all(after[name] is tensor for name, tensor in before.items())  # the very same tensors
    state = model.state_dict()
    for name, value in original.state_dict().items():  # nothing lost, nothing changed
        assert torch.equal(state[name], value), name
    inputs = batch()
    difference = (logits(model, inputs) - logits(original, inputs)).abs().max().item()
    print(f"{kind}: original vs converted (LUNA, untrained) max |logit diff| {difference:.3g}")


# ----------------------------------------------------------------------------- (b) padding invariance
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("local", [False, True], ids=["global-only", "local-too"])
def test_padding_never_changes_real_tokens(kind, attn_implementation, local):
    """Every mask reaching a converted layer (v5 local layers: the banded one) is read as key padding."""
    model = make(kind, attn_implementation)
    convert(model, "luna", convert_local_layers=local)
    assert converted(model) == (sorted(GLOBAL + LOCAL) if local else GLOBAL)
    inputs = batch()
    padded = logits(model, inputs)
    alone = logits(model, {k: v[:1, :6] for k, v in inputs.items()})
    # measured: <= 9.6e-7 (float32 summation order), both transformers versions
    torch.testing.assert_close(alone, padded[:1, :6] if kind.endswith("MaskedLM") else padded[:1], atol=1e-5,
                               rtol=0)


# ----------------------------------------------------------------------------- (c) save / load
@pytest.mark.parametrize("local", [False, True], ids=["global-only", "local-too"])
def test_save_and_load_rebuild_the_same_model_offline(tmp_path, local):
    model = make(KINDS[1])
    convert(model, "hedgehog", convert_local_layers=local)
    save(model, tmp_path / "m")
    saved = json.loads((tmp_path / "m" / CONVERSION_FILE).read_text())["conversion"]
    assert saved["convert_local_layers"] is local
    loaded = load(tmp_path / "m")
    assert converted(loaded) == converted(model)
    torch.testing.assert_close(logits(loaded, batch()), logits(model, batch()), atol=0, rtol=0)


# ----------------------------------------------------------------------------- (d) reference
def rotary_theta(config, local: bool) -> float:
    if V5:
        return config.rope_parameters["sliding_attention" if local else "full_attention"]["rope_theta"]
    return config.local_rope_theta if local else config.global_rope_theta


def rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE written out (rotate-half convention): x [B, H, N, d] at positions 0..N-1."""
    n, d = x.shape[-2:]
    angles = torch.arange(n, dtype=torch.float64)[:, None] / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    x = x.double()
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


@pytest.mark.parametrize("method, options", [("luna", {"dwc": False}), ("hedgehog", {}), ("t2r", {})])
@pytest.mark.parametrize("layer", ["model.layers.2.attn", "model.layers.1.attn"], ids=["global", "local"])
def test_one_converted_layer_equals_rotary_then_the_explicit_kernel_formula(method, options, layer):
    """Wqkv -> RoPE on q and k (the layer's own theta) -> the method's explicit N x N weights over real
    keys (ops.reference) -> Wo, against the converted layer inside the model."""
    model = make()
    convert(model, method, filter_fn=lambda _m, name: name == layer, convert_local_layers=True, **options)
    attention = dict(model.named_modules())[layer]
    seen = {}
    attention.register_forward_hook(lambda m, args, out: seen.update(x=args[0], out=out[0]))
    inputs = batch()
    logits(model, inputs)
    with torch.no_grad():
        x, la = seen["x"], attention.linear_attn
        b, n, _ = x.shape
        q, k, v = attention.Wqkv(x).view(b, n, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        theta = rotary_theta(model.config, local=layer in LOCAL)
        q, k = rotate(q, theta).float(), rotate(k, theta).float()
        real = inputs["attention_mask"].bool()
        weights = linear_attention_weights(*la.features(q, k, AttentionContext(real, n)), real, la.eps,
                                           la.divisor.clamp)
        want = attention.Wo((weights @ v).transpose(1, 2).reshape(b, n, HIDDEN))
    # measured: <= 1.4e-7 (float32 vs the float64 rotary)
    torch.testing.assert_close(seen["out"][real], want[real], atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- (e) local layers
def test_local_layers_stay_softmax_unless_asked():
    model = make()
    convert(model, "t2r")
    assert converted(model) == GLOBAL and type(dict(model.named_modules())[LOCAL[0]]).__name__ == "ModernBertAttention"
    model = make()
    report = convert(model, "t2r", convert_local_layers=True)
    assert converted(model) == [m.name for m in report.modules] == sorted(GLOBAL + LOCAL) and not report.kept_local
    model = make()
    with pytest.raises(ConversionError, match="sliding-window.*convert_local_layers=True"):
        convert(model, "t2r", filter_fn=lambda _m, name: name in LOCAL)
    assert not is_converted(model)


def band(real: torch.Tensor, half: int) -> torch.Tensor:
    """bool [B, 1, N, N]: key j for query i where j is real and |i - j| <= half."""
    position = torch.arange(real.shape[-1])
    return (((position[:, None] - position[None, :]).abs() <= half) & real[:, None, :])[:, None]


def test_sliding_window_mask_gives_its_key_padding_and_refuses_other_masks():
    real = torch.tensor([[True] * 6 + [False] * 3, [True] * 9])
    additive = torch.zeros(2, 1, 9, 9).masked_fill(~band(real, HALF_WINDOW), torch.finfo(torch.float32).min)
    for mask in (band(real, HALF_WINDOW), additive, real.long()):  # v5 sdpa, v4/v5 eager, flash's [B, N]
        assert sliding_window_key_padding_mask(mask, HALF_WINDOW).tolist() == real.tolist()
    assert sliding_window_key_padding_mask(band(torch.ones(2, 9, dtype=torch.bool), HALF_WINDOW), HALF_WINDOW) is None
    causal = torch.ones(9, 9, dtype=torch.bool).tril()[None, None] & real[:, None, :, None]
    for other in (band(real, HALF_WINDOW + 1), causal):
        with pytest.raises(ValueError, match="not a bidirectional window of 2 tokens"):
            sliding_window_key_padding_mask(other, HALF_WINDOW)


# ----------------------------------------------------------------------------- (f) distillation
def test_distillation_follows_the_original_and_trains_the_feature_maps():
    """In distillation mode each converted layer returns softmax attention of the same rotated q, k: the
    model reproduces the original; the loss reaches every feature-map parameter; a few steps train them."""
    from accelerate import Accelerator

    from luna_convert.engine.training import distill_attention

    original = make()
    model = make()
    convert(model, "hedgehog")
    layers = linear_attention_modules(model)
    for layer in layers:
        layer.set_mode(AttentionMode.DISTILL_ATTENTION)
    inputs = batch()
    real = inputs["attention_mask"].bool()
    out = model(**inputs).logits
    # measured: <= 1.3e-6 (float32: SDPA in the layer vs the original's attention)
    torch.testing.assert_close(out[real], logits(original, inputs)[real], atol=1e-5, rtol=0)
    torch.stack([layer.distill_loss for layer in layers]).mean().backward()
    params = feature_map_parameters(model)
    assert params and all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in params)
    for layer in layers:
        layer.set_mode(AttentionMode.LINEAR)
    start = [p.detach().clone() for p in params]
    result = distill_attention(Accelerator(cpu=True), model, [inputs] * 3, steps=3, lr=1e-2)
    assert result.steps == 3 and math.isfinite(result.final_loss)
    assert all(not torch.equal(p, p0) for p, p0 in zip(params, start))


# ----------------------------------------------------------------------------- (g) packed input
def test_packed_inputs_are_refused_with_how_to_load():
    model = make()
    convert(model, "luna")
    inputs = batch()
    if V5:  # flash attention's packed-batch arguments, handed down to every layer
        packed = {"cu_seq_lens_q": torch.tensor([0, 6, 15], dtype=torch.int32), "cu_seq_lens_k": None}
    else:  # v4 unpads the batch itself under flash attention and hands the layers cu_seqlens
        model.config._attn_implementation, packed = "flash_attention_2", {}
    with pytest.raises(ConversionError, match="packed, unpadded tokens.*attn_implementation='sdpa'") as info:
        model(**inputs, **packed)
    assert "\n" not in str(info.value)


def test_v4_flash_attention_model_is_refused_before_conversion():
    if V5:
        pytest.skip("transformers v4 API: v5 ModernBERT has no packed flash-attention path of its own")
    model = make()
    model.config._attn_implementation = "flash_attention_2"  # what a GPU with flash-attn picks by default
    with pytest.raises(ConversionError, match="ModernBERT under flash attention.*attn_implementation='sdpa'"):
        convert(model, "luna")
    assert not is_converted(model)


def test_modernbert_decoder_causal_attention_is_not_matched():
    import transformers

    seed_everything()
    config = transformers.ModernBertDecoderConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                                                  num_attention_heads=HEADS, intermediate_size=64,
                                                  pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                                  cls_token_id=1, sep_token_id=2)
    with pytest.raises(ConversionError, match="no supported softmax self-attention in ModernBertDecoderModel"):
        convert(transformers.ModernBertDecoderModel(config).eval(), "luna")
