"""Library-version specific behaviour. The same file runs in the transformers v5 environment
and in the transformers 4.57 (last v4) one; each checks the layout it actually has."""

from __future__ import annotations

import copy

import pytest
import torch

from luna_convert.layers.attention import AttentionMode
from luna_convert.adapters import key_padding_mask
from luna_convert.conversion import convert, linear_attention_modules
from luna_convert.errors import ConversionError

from conftest import HEADS, HIDDEN, LAYERS, VOCAB, example_inputs, make_bert, make_hf_vit, transformers_major, \
    vit_has_proj_layout

V4 = transformers_major() < 5
only_v4 = pytest.mark.skipif(not V4, reason="transformers v4 API (head_mask, BertSdpaSelfAttention, relative positions)")
only_v5 = pytest.mark.skipif(V4, reason="transformers v5 API")


def _distill(model):
    for la in linear_attention_modules(model):
        la.set_mode(AttentionMode.DISTILL_ATTENTION)
    return model


# ----------------------------------------------------------------------- layouts
def test_vit_layout_of_this_transformers_version():
    model = make_hf_vit()
    report = convert(model, "luna")
    if vit_has_proj_layout():  # transformers >= 5.10: ViTAttention owns q/k/v/o projections
        assert [m.name for m in report.modules] == [f"vit.layers.{i}.attention" for i in range(LAYERS)]
        assert {m.original_class for m in report.modules} == {"ViTAttention"}
        assert {m.adapter for m in report.modules} == {"hf-proj"}
    else:  # v4 (and v5 up to 5.7): ViTSelfAttention with query/key/value, output in attention.output.dense
        assert [m.name for m in report.modules] == [f"vit.encoder.layer.{i}.attention.attention" for i in range(LAYERS)]
        assert {m.original_class for m in report.modules} == {"ViTSelfAttention"}
        assert {m.adapter for m in report.modules} == {"hf-separate"}


@pytest.mark.skipif(V4 or not vit_has_proj_layout(), reason="needs the transformers >= 5.10 ViT layout")
def test_v5_vit_attention_with_q_proj_is_converted():
    from transformers.models.vit.modeling_vit import ViTAttention

    model = make_hf_vit()
    convert(model, "t2r")
    attention = model.vit.layers[0].attention
    assert isinstance(attention, ViTAttention) and hasattr(attention, "o_proj")


@only_v4
def test_v4_vit_self_attention_is_converted():
    from transformers.models.vit.modeling_vit import ViTSelfAttention

    model = make_hf_vit()
    convert(model, "t2r")
    attention = model.vit.encoder.layer[0].attention
    assert isinstance(attention.attention, ViTSelfAttention)
    assert hasattr(attention.attention, "linear_attn") and not hasattr(attention.output, "linear_attn")


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_bert_self_attention_class_per_version(impl):
    report = convert(make_bert(impl), "t2r")
    expected = "BertSdpaSelfAttention" if V4 and impl == "sdpa" else "BertSelfAttention"
    assert {m.original_class for m in report.modules} == {expected}
    assert [m.name for m in report.modules] == [f"bert.encoder.layer.{i}.attention.self" for i in range(LAYERS)]


def test_timm_is_1_0_and_plain_attention_is_converted():
    import timm
    from timm.layers.attention import Attention

    from conftest import make_timm_vit

    assert timm.__version__.startswith("1.0.")
    model = make_timm_vit()
    report = convert(model, "luna")
    assert {m.adapter for m in report.modules} == {"timm"}
    assert all(isinstance(b.attn, Attention) for b in model.blocks)


# -------------------------------------------------------- masks reaching attention
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_mask_reaching_self_attention_is_understood(impl):
    """Record the mask this transformers version hands to BERT self-attention and check
    that it normalises to the key-padding pattern of the batch."""
    model = make_bert(impl)
    seen = []

    def hook(_module, args, kwargs):
        seen.append(kwargs["attention_mask"] if "attention_mask" in kwargs else (args[1] if len(args) > 1 else None))

    handle = model.bert.encoder.layer[0].attention.self.register_forward_pre_hook(hook, with_kwargs=True)
    inputs = example_inputs("hf-bert")
    with torch.no_grad():
        model(**inputs)
        model(input_ids=inputs["input_ids"][1:])  # no padding at all
    handle.remove()
    padded, unpadded = seen
    assert padded is not None and padded.dim() == 4
    if V4:
        assert padded.is_floating_point()  # v4: additive masks (eager [B,1,1,N], sdpa [B,1,N,N])
        assert padded.shape[2] == (1 if impl == "eager" else padded.shape[3])
    assert torch.equal(key_padding_mask(padded), inputs["attention_mask"].bool())
    assert key_padding_mask(unpadded) is None


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_distill_path_matches_original_for_both_implementations(impl):
    model = make_bert(impl)
    original = copy.deepcopy(model)
    convert(model, "t2r")
    _distill(model)
    inputs = example_inputs("hf-bert")
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, original(**inputs).logits, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ v4 specifics
@only_v4
@pytest.mark.parametrize("arch", ["hf-bert", "hf-vit"])
def test_v4_head_mask_is_applied(arch):
    """v4 passes head_mask (ViT positionally). Zeroing head 0 equals zeroing its columns of the
    output projection; in distill mode the converted model matches the original under a head mask."""
    make = make_bert if arch == "hf-bert" else make_hf_vit
    model = make("eager")
    original = copy.deepcopy(model)
    convert(model, "t2r")
    inputs = example_inputs(arch)
    head_mask = torch.ones(HEADS)
    head_mask[0] = 0.0
    d = HIDDEN // HEADS
    pruned = copy.deepcopy(model)
    layers = pruned.bert.encoder.layer if arch == "hf-bert" else pruned.vit.encoder.layer
    with torch.no_grad():
        for layer in layers:
            layer.attention.output.dense.weight[:, :d] = 0.0
        masked = model(**inputs, head_mask=head_mask).logits
        torch.testing.assert_close(masked, pruned(**inputs).logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(masked, model(**inputs).logits, atol=1e-4)
        _distill(model)
        torch.testing.assert_close(model(**inputs, head_mask=head_mask).logits,
                                   original(**inputs, head_mask=head_mask).logits, atol=1e-4, rtol=1e-4)


@only_v4
def test_v4_bert_output_attentions_are_linear_attention_rows():
    model = make_bert("eager")
    convert(model, "hedgehog")
    inputs = example_inputs("hf-bert")
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    assert len(out.attentions) == LAYERS
    for a in out.attentions:
        assert a.shape == (2, HEADS, 7, 7)
        torch.testing.assert_close(a.sum(-1), torch.ones(2, HEADS, 7), atol=1e-4, rtol=0)
        assert torch.all(a[0, ..., 4:] == 0)


@only_v4
@pytest.mark.parametrize("kind", ["relative_key", "relative_key_query"])
def test_v4_bert_with_relative_positions_is_refused(kind):
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        intermediate_size=64, vocab_size=VOCAB, position_embedding_type=kind)
    with pytest.raises(ConversionError, match="Bert(Sdpa)?SelfAttention"):
        convert(BertForSequenceClassification(config), "luna")


# ------------------------------------------------------------------ v5 specifics
@only_v5
def test_v5_output_attentions_are_linear_attention_rows():
    model = make_hf_vit()
    convert(model, "t2r")
    with torch.no_grad():
        out = model(**example_inputs("hf-vit"), output_attentions=True)
    assert len(out.attentions) == LAYERS
    n = 1 + 16
    for a in out.attentions:
        assert a.shape == (2, HEADS, n, n)
        torch.testing.assert_close(a.sum(-1), torch.ones(2, HEADS, n), atol=1e-4, rtol=0)
