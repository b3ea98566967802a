"""The DWC branch sees the true patch grid of every input, and
attention an adapter cannot convert faithfully is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from luna_convert.adapters import key_padding_mask
from luna_convert.conversion import convert, is_converted, linear_attention_modules
from luna_convert.errors import ConversionError
from luna_convert.ops.linear import divide_by_last_column

from conftest import HEADS, HIDDEN, IMAGE, LAYERS, VOCAB, make_hf_vit, make_timm_vit
from builders import randomize_dwc


def record_dwc_calls(model) -> list:
    """(conv, grid, prefix, v, output) of every DWC call in ``model``."""
    calls = []
    for la in linear_attention_modules(model):
        # LinearAttention hands the branch its attention output as ``plus``, summed into the branch's output
        # (before its division where ``divide`` is given: the pass divides as it adds)
        la.dwc.register_forward_hook(
            lambda m, args, kwargs, out: calls.append((m.conv, args[2], args[3], args[0], out - attention_output(kwargs))),
            with_kwargs=True)
    return calls


def attention_output(dwc_kwargs: dict) -> torch.Tensor:
    plus, divide = dwc_kwargs["plus"], dwc_kwargs.get("divide")
    return plus if divide is None else divide_by_last_column(plus.clone(), *divide)


def reference_dwc(conv: nn.Conv2d, v: torch.Tensor, grid, prefix: int) -> torch.Tensor:
    """torch's own depthwise Conv2d over the patch grid (row-major tokens after ``prefix``);
    prefix tokens get nothing."""
    b, h, n, d = v.shape
    gh, gw = grid
    patches = v[:, :, prefix:].reshape(b * h, gh, gw, d).permute(0, 3, 1, 2)
    out = F.conv2d(patches, conv.weight, conv.bias, padding=conv.padding, groups=d)
    out = out.permute(0, 2, 3, 1).reshape(b, h, gh * gw, d)
    return F.pad(out, (0, 0, prefix, 0))


# (height, width) of inputs to a 32-px model with 8-px patches, and the true grid
SIZES = [((IMAGE, IMAGE), (4, 4)), ((IMAGE, 48), (4, 6)), ((40, 40), (5, 5)), ((48, IMAGE), (6, 4))]


def check_true_grid(model, run, size, grid, prefix: int) -> None:
    convert(model, "luna", dwc=True)
    randomize_dwc(model)
    calls = record_dwc_calls(model)
    with torch.no_grad():
        run(model, torch.randn(2, 3, *size))
    assert len(calls) == LAYERS
    for conv, got_grid, got_prefix, v, out in calls:
        assert (tuple(got_grid), got_prefix) == (grid, prefix)
        # measured: at most 6.0e-7 (float32 summation order of kernels.depthwise_conv_tokens vs torch's conv)
        torch.testing.assert_close(out, reference_dwc(conv, v, grid, prefix), atol=2e-6, rtol=0)


@pytest.mark.parametrize("size, grid", SIZES)
def test_transformers_vit_dwc_gets_the_grid_of_the_input(size, grid):
    """40x40 on a 32-px model used to be treated as a 4x4 grid with 10 prefix tokens, 32x48 as 4x4 + 9."""
    check_true_grid(make_hf_vit(), lambda m, x: m(pixel_values=x, interpolate_pos_encoding=True), size, grid, 1)


@pytest.mark.parametrize("size, grid", SIZES)
@pytest.mark.parametrize("reg_tokens", [0, 2])
def test_timm_dynamic_size_vit_dwc_gets_the_grid_of_the_input(size, grid, reg_tokens):
    check_true_grid(make_timm_vit(dynamic_img_size=True, reg_tokens=reg_tokens), lambda m, x: m(x), size, grid,
                    1 + reg_tokens)


def test_timm_non_square_configured_vit_dwc_gets_its_grid():
    """A model built for 32x48 images: 4x6 patches (the square guess took 4x4 + 9 prefix tokens)."""
    from luna_convert.model_building import create_timm_model

    model = create_timm_model("vit_tiny_patch16_224", img_size=(IMAGE, 48), patch_size=8, embed_dim=HIDDEN,
                              depth=LAYERS, num_heads=HEADS, num_classes=3).eval()
    check_true_grid(model, lambda m, x: m(x), (IMAGE, 48), (4, 6), 1)


def test_dwc_grid_survives_copy_and_reload(tmp_path):
    """A deep copy (or a reloaded model) reads its own patch embedding, not the original's."""
    import copy

    import luna_convert

    model = make_timm_vit(dynamic_img_size=True)
    convert(model, "luna", dwc=True)
    twin = copy.deepcopy(model)
    luna_convert.save(model, tmp_path / "saved")
    for other in (twin, luna_convert.load(tmp_path / "saved")):
        calls = record_dwc_calls(other)
        with torch.no_grad():
            model(torch.randn(1, 3, 40, 40))  # the original runs at another size meanwhile
            other(torch.randn(1, 3, IMAGE, 48))
        assert [tuple(c[1]) for c in calls] == [(4, 6)] * LAYERS


# --------------------------------------------------------------------------- item 9
def tiny_swin():
    from transformers import SwinConfig, SwinForImageClassification

    return SwinForImageClassification(SwinConfig(image_size=IMAGE, patch_size=4, embed_dim=16, depths=[1, 1],
                                                 num_heads=[2, 2], window_size=4, num_labels=3))


def tiny_beit(**bias):
    from transformers import BeitConfig, BeitForImageClassification

    return BeitForImageClassification(BeitConfig(image_size=IMAGE, patch_size=8, hidden_size=HIDDEN,
                                                 num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                                 intermediate_size=64, num_labels=3, **bias))


@pytest.mark.parametrize("make", [tiny_swin, lambda: tiny_beit(use_relative_position_bias=True),
                                  lambda: tiny_beit(use_shared_relative_position_bias=True)],
                         ids=["swin", "beit", "beit-shared-bias"])
@pytest.mark.parametrize("method", ["luna", "t2r"])
def test_relative_position_attention_is_refused_naming_the_bias_table(make, method):
    model = make()
    with pytest.raises(ConversionError, match="relative_position_bias_table") as info:
        convert(model, method)
    assert "\n" not in str(info.value)
    assert not is_converted(model)


def test_attention_with_a_member_the_adapter_ignores_is_refused():
    """The guard itself, whatever the library: an extra learned tensor or submodule on a matched module."""
    from conftest import make_bert

    model = make_bert()
    attention = next(m for m in model.modules() if type(m).__name__.endswith("SelfAttention"))
    attention.head_gain = nn.Parameter(torch.ones(HEADS))
    with pytest.raises(ConversionError, match=r"SelfAttention holds head_gain,"):
        convert(model, "t2r")
    del attention.head_gain
    attention.rotary = nn.Module()  # parameter-free but unknown: named by itself
    with pytest.raises(ConversionError, match=r"holds rotary,"):
        convert(model, "t2r")
    assert not is_converted(model)


def tiny_text(kind: str):
    import transformers

    sizes = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=64,
                 vocab_size=VOCAB, max_position_embeddings=64, num_labels=2)
    if kind == "roberta":
        return transformers.RobertaForSequenceClassification(transformers.RobertaConfig(**sizes))
    return transformers.ElectraForSequenceClassification(transformers.ElectraConfig(embedding_size=HIDDEN, **sizes))


@pytest.mark.parametrize("kind", ["roberta", "electra"])
def test_roberta_and_electra_still_convert(kind):
    model = tiny_text(kind).eval()
    report = convert(model, "luna")
    assert len(report.modules) == LAYERS
    ids = torch.randint(3, VOCAB, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    assert logits.shape == (2, 2) and bool(torch.isfinite(logits).all())


def test_an_additive_score_bias_in_the_mask_is_refused():
    """A mask that is neither 0 (keep) nor very negative (drop) carries a bias linear attention would drop."""
    padding = torch.zeros(1, 1, 1, 5)
    padding[..., -1] = torch.finfo(torch.float32).min
    assert key_padding_mask(padding).tolist() == [[True] * 4 + [False]]
    bias = torch.zeros(1, HEADS, 5, 5)
    bias[0, 0, 1, 2] = 0.25
    with pytest.raises(ValueError, match="adds biases to the scores"):
        key_padding_mask(bias)


def test_vision_model_without_a_patch_embedding_conv_refuses_dwc_only():
    """Without the patch-embedding convolution nothing tells DWC the grid of an input: refused, not guessed."""
    model = make_timm_vit()
    model.patch_embed.proj = nn.Identity()  # e.g. patches cut by a custom layer
    with pytest.raises(ConversionError, match="cannot find the patch-embedding convolution.*dwc=False"):
        convert(model, "luna", dwc=True)
    assert not is_converted(model)
    convert(model, "luna")  # no DWC (the default), no grid needed
    assert is_converted(model)


def test_dwc_refuses_inputs_with_dropped_patches():
    model = make_timm_vit(patch_drop_rate=0.5).train()
    convert(model, "luna", dwc=True)
    with pytest.raises(ValueError, match=r"cannot hold the 4x4 patch grid"):
        model(torch.randn(2, 3, IMAGE, IMAGE))
