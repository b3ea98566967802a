"""convert(): every method on every supported architecture (transformers BERT and ViT,
timm ViT with and without register tokens), on transformers v5 and v4.57 alike."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from luna_convert.adapters import LinearizedAttention, key_padding_mask
from luna_convert.layers.attention import AttentionMode, LinearAttention
from luna_convert.conversion import CONFIG_ATTR, convert, feature_map_parameters, is_converted, linear_attention_modules
from luna_convert.errors import ConversionError, LunaConvertError, UnknownNameError
from luna_convert.linear_methods import METHODS as METHOD_SPECS
from builders import randomize_dwc

from conftest import (ARCHITECTURES, HEADS, HIDDEN, LAYERS, VOCAB, example_inputs, logits_of, make_bert,
                      make_distilbert)

METHODS = sorted(METHOD_SPECS)
ARCHS = sorted(ARCHITECTURES)


def converted(arch: str, method: str, **options):
    model = ARCHITECTURES[arch]()
    original = copy.deepcopy(model)
    report = convert(model, method, **options)
    return original, model, report


# ------------------------------------------------------------ every method x arch
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", METHODS)
def test_every_attention_replaced_and_weights_kept(arch, method):
    original, model, report = converted(arch, method)
    converted_modules = [m for m in model.modules() if isinstance(m, LinearizedAttention)]
    assert len(converted_modules) == LAYERS == len(report.modules)
    assert len(linear_attention_modules(model)) == LAYERS
    assert is_converted(model) and not is_converted(original)
    # The converted class still is an instance of the original one (host-library hooks rely on it).
    originals = {name: type(m) for name, m in original.named_modules()}
    for r in report.modules:
        module = model.get_submodule(r.name)
        assert isinstance(module, originals[r.name]) and type(module).__name__ == f"Linear{r.original_class}"
    # Every original tensor (Q/K/V/O projections included) is still there, bit for bit, under the same key.
    before, after = original.state_dict(), model.state_dict()
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor), key
    projections = [k for k in before if any(p in k for p in ("query.", "key.", "value.", "q_proj.", "k_proj.",
                                                              "v_proj.", "o_proj.", "qkv.", "attn.proj.",
                                                              "attention.output.dense.", "q_lin.", "k_lin.",
                                                              "v_lin.", "out_lin."))]
    assert len(projections) >= 4 * LAYERS  # the projections were part of the comparison
    # New parameters live only under the added linear_attn submodules.
    added = set(after) - set(before)
    # exactly the converted layers' own tensors (none for a fixed map such as ELU; Performer's W is a buffer)
    assert added == {f"{name}.{key}" for name, m in model.named_modules() if isinstance(m, LinearAttention)
                     for key in m.state_dict()}
    assert all(".linear_attn." in k for k in added)
    assert sum(after[k].numel() for k in added if k in dict(model.named_parameters())) == report.params_added


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", METHODS)
def test_converted_model_gives_finite_logits(arch, method):
    _, model, _ = converted(arch, method)
    randomize_dwc(model)
    with torch.no_grad():
        logits = logits_of(model, example_inputs(arch))
    assert logits.shape == (2, 3)
    assert bool(torch.isfinite(logits).all())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", METHODS)
def test_distill_mode_reproduces_original_logits(arch, method):
    original, model, _ = converted(arch, method)
    randomize_dwc(model)  # the teacher path must ignore DWC
    for la in linear_attention_modules(model):
        la.set_mode(AttentionMode.DISTILL_ATTENTION)
    inputs = example_inputs(arch)
    with torch.no_grad():
        torch.testing.assert_close(logits_of(model, inputs), logits_of(original, inputs), atol=1e-4, rtol=1e-4)
    losses = [la.distill_loss for la in linear_attention_modules(model)]
    assert len(losses) == LAYERS
    assert all(loss is not None and bool(torch.isfinite(loss)) and float(loss) > 0 for loss in losses)
    # Switching distillation off gives linear attention again (different logits).
    for la in linear_attention_modules(model):
        la.set_mode(AttentionMode.LINEAR)
    with torch.no_grad():
        assert not torch.allclose(logits_of(model, inputs), logits_of(original, inputs), atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_distillation_trains_only_feature_maps(arch):
    _, model, _ = converted(arch, "hedgehog")
    for p in model.parameters():
        p.requires_grad_(False)
    params = feature_map_parameters(model)
    for p in params:
        p.requires_grad_(True)
    for la in linear_attention_modules(model):
        la.set_mode(AttentionMode.DISTILL_ATTENTION)
    logits_of(model, example_inputs(arch))
    loss = torch.stack([la.distill_loss for la in linear_attention_modules(model)]).mean()
    loss.backward()
    assert params and all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in params)
    assert any(bool(p.grad.abs().sum() > 0) for p in params)


@pytest.mark.parametrize("arch", ARCHS)
def test_training_step_reaches_original_and_new_weights(arch):
    _, model, _ = converted(arch, "luna")
    model.train()
    logits_of(model, example_inputs(arch)).logsumexp(-1).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert any(g is not None and bool(g.abs().sum() > 0) for n, g in grads.items() if ".linear_attn." in n)
    qkv = [g for n, g in grads.items() if n.endswith(("query.weight", "q_proj.weight", "qkv.weight", "q_lin.weight"))]
    assert qkv and all(g is not None and bool(g.abs().sum() > 0) for g in qkv)


# ---------------------------------------------------------------- padding (BERT)
@pytest.mark.parametrize("make", [make_bert, make_distilbert], ids=["bert", "distilbert"])
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("method", METHODS)
def test_bert_padding_invariance(method, attn_implementation, make):
    model = make(attn_implementation)
    convert(model, method, **({"dwc": True} if method != "luna" else {}))
    randomize_dwc(model)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (1, 6), generator=g)
    with torch.no_grad():
        alone = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        no_mask = model(input_ids=ids).logits
        padded_ids = torch.cat([ids, torch.randint(1, VOCAB, (1, 5), generator=g)], 1)  # garbage "pads"
        mask = torch.cat([torch.ones(1, 6), torch.zeros(1, 5)], 1).long()
        padded = model(input_ids=padded_ids, attention_mask=mask).logits
        # The same sequence batched with a longer one.
        other = torch.randint(1, VOCAB, (1, 11), generator=g)
        batch = model(input_ids=torch.cat([padded_ids, other]),
                      attention_mask=torch.cat([mask, torch.ones(1, 11, dtype=torch.long)])).logits
    torch.testing.assert_close(no_mask, alone, atol=0, rtol=0)
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batch[:1], alone, atol=1e-5, rtol=1e-5)
    assert bool(torch.isfinite(batch).all())


def test_bert_padding_changes_output_without_mask():
    """The invariance above is not vacuous: unmasked extra tokens do change the logits."""
    model = make_bert()
    convert(model, "t2r")
    ids = torch.randint(1, VOCAB, (1, 6))
    with torch.no_grad():
        alone = model(input_ids=ids).logits
        longer = model(input_ids=torch.cat([ids, torch.randint(1, VOCAB, (1, 5))], 1)).logits
    assert not torch.allclose(alone, longer, atol=1e-5)


# ----------------------------------------------------------- output_attentions
@pytest.mark.parametrize("arch", ["hf-bert", "hf-distilbert", "hf-vit"])
def test_output_attentions_still_runs(arch):
    _, model, _ = converted(arch, "t2r")
    inputs = example_inputs(arch)
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    assert bool(torch.isfinite(out.logits).all())
    attentions = [a for a in (out.attentions or ()) if a is not None]
    text = arch != "hf-vit"
    n = inputs["attention_mask"].shape[1] if text else 1 + (32 // 8) ** 2
    for a in attentions:  # where the library passes them on: the explicit linear attention rows
        assert a.shape == (2, HEADS, n, n)
        torch.testing.assert_close(a.sum(-1), torch.ones(2, HEADS, n), atol=1e-4, rtol=0)
        if text:  # pad keys get no weight
            assert torch.all(a[0, :, :, -3:] == 0)


# --------------------------------------------------------- DWC grid and prefix
@pytest.mark.parametrize("arch, prefix", [("hf-vit", 1), ("timm-vit", 1), ("timm-vit-reg", 3), ("hf-bert", None)])
def test_dwc_gets_patch_grid_and_prefix_tokens(arch, prefix, monkeypatch):
    _, model, _ = converted(arch, "luna", dwc=True)
    calls = []
    for la in linear_attention_modules(model):
        assert la.dwc is not None and la.dwc.spatial == (prefix is not None)
        original_forward = la.dwc.forward
        la.dwc.forward = lambda v, key_mask=None, grid=None, num_prefix=0, f=original_forward, **kw: (
            calls.append((grid, num_prefix)) or f(v, key_mask, grid, num_prefix, **kw))
    with torch.no_grad():
        logits_of(model, example_inputs(arch))
    assert len(calls) == LAYERS
    expected = (None, 0) if prefix is None else ((4, 4), prefix)
    assert all(c == expected for c in calls), calls


def test_timm_prefix_tokens_get_no_dwc():
    _, model, _ = converted("timm-vit-reg", "luna", dwc=True)
    randomize_dwc(model)
    attn = model.blocks[0].attn
    la = attn.linear_attn
    v = torch.randn(1, HEADS, 3 + 16, HIDDEN // HEADS)
    out = la.dwc(v, None, (4, 4), 3)
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    assert bool(out[:, :, 3:].abs().sum() > 0)


# ---------------------------------------------------------------- errors, report
def test_converting_twice_raises():
    model = make_bert()
    convert(model, "t2r")
    with pytest.raises(ConversionError, match="already converted"):
        convert(model, "luna")


def test_model_without_supported_attention_raises_naming_classes():
    model = nn.Sequential(nn.Linear(4, 4), nn.MultiheadAttention(4, 2))
    with pytest.raises(ConversionError, match="MultiheadAttention"):
        convert(model, "luna")
    with pytest.raises(ConversionError, match="none"):
        convert(nn.Sequential(nn.Linear(2, 2)), "luna")


def test_causal_model_is_refused():
    from transformers import BertConfig, BertLMHeadModel

    config = BertConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        intermediate_size=64, vocab_size=VOCAB, is_decoder=True)
    model = BertLMHeadModel(config)
    with pytest.raises(ConversionError, match="Bert(Sdpa)?SelfAttention"):
        convert(model, "luna")
    assert not is_converted(model)


def test_timm_attention_with_rotary_or_relative_positions_is_refused():
    """Same attributes as timm's Attention, but positions are added inside attention: not convertible."""
    import timm

    model = timm.create_model("vit_relpos_base_patch16_224", img_size=32, embed_dim=32, depth=1, num_heads=4)
    with pytest.raises(ConversionError, match="RelPosAttention"):
        convert(model, "t2r")


def test_roformer_rotary_attention_is_refused():
    from transformers import RoFormerConfig, RoFormerModel

    model = RoFormerModel(RoFormerConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                         intermediate_size=64, vocab_size=VOCAB, embedding_size=32))
    with pytest.raises(ConversionError, match="RoFormerSelfAttention"):
        convert(model, "luna")


def test_unknown_method_hints_close_match():
    with pytest.raises(UnknownNameError, match="Did you mean luna") as info:
        convert(make_bert(), "lunaa")
    assert isinstance(info.value, LunaConvertError) and "hedgehog" in str(info.value)


def test_unknown_option_raises_and_leaves_model_alone():
    model = make_bert()
    with pytest.raises(ConversionError, match="projection.*Did you mean projections"):
        convert(model, "luna", projection=4)
    with pytest.raises(ConversionError, match="feature_dim"):
        convert(model, "hedgehog", feature_dim=4)  # hedgehog's D is fixed at 2d
    assert not is_converted(model)


def test_invalid_option_value_is_a_conversion_error_and_leaves_model_alone():
    model = make_bert()
    with pytest.raises(ConversionError, match="channel_bank"):
        convert(model, "luna", channel_bank="nope")
    with pytest.raises(ConversionError, match="even"):
        convert(model, "luna", channel_bank="fourier", channels=3)
    assert not is_converted(model) and not linear_attention_modules(model)


def test_a_method_alias_finds_the_method_and_may_not_shadow_a_name():
    from luna_convert.linear_methods.base import Method
    from luna_convert.linear_methods.registry import ALIASES, get_method, register

    elu = METHOD_SPECS["elu"]
    with pytest.raises(ValueError, match="'luna' is registered twice"):
        register(Method(name="elu-again", core=elu.core, description="", paper="", details="", aliases=("luna",)))
    assert "elu-again" not in METHOD_SPECS and "luna" not in ALIASES  # nothing half-registered
    try:
        register(Method(name="elu-renamed", core=elu.core, description="", paper="", details="", aliases=("elu-old",)))
        assert get_method("elu-old") is METHOD_SPECS["elu-renamed"]
        report = convert(make_bert(), "elu-old")
        assert report.method == "elu-renamed"
    finally:
        METHOD_SPECS.pop("elu-renamed", None)
        ALIASES.pop("elu-old", None)


@pytest.mark.parametrize("method", METHODS)
def test_report_fields(method):
    model = make_bert()
    report = convert(model, method)
    spec = METHOD_SPECS[method]
    assert report.method == method
    assert type(report.options) is spec.options and report.options == spec.options()  # the typed object
    assert report.to_dict()["options"] == spec.defaults
    names = [r.name for r in report.modules]
    assert names == [f"bert.encoder.layer.{i}.attention.self" for i in range(LAYERS)]
    for r in report.modules:
        la = model.get_submodule(r.name).linear_attn
        assert (r.num_heads, r.head_dim) == (HEADS, HIDDEN // HEADS)
        assert r.feature_dim == la.feature_dim
        assert r.params_added == sum(p.numel() for p in la.parameters())  # 0 for a fixed map without DWC
        assert r.adapter == "hf-separate"
    assert report.params_added == sum(r.params_added for r in report.modules)
    d = report.to_dict()
    assert d["params_added"] == report.params_added and len(d["modules"]) == LAYERS
    assert f"replaced {LAYERS} attention modules" in str(report)
    with_dwc = convert(make_bert(), method, dwc=True)  # the DWC branch always adds parameters
    assert with_dwc.params_added == sum(r.params_added for r in with_dwc.modules) >= report.params_added
    assert with_dwc.params_added > 0
    config = getattr(model, CONFIG_ATTR)
    assert config.method == method and config.targets == names


def test_feature_dims_per_method():
    d = HIDDEN // HEADS
    expected = {"luna": d * 2, "t2r": 64, "t2r-hh": 64, "hedgehog": 2 * d}  # luna: M = head_dim, L = 2 by default
    for method, dim in expected.items():
        assert convert(make_bert(), method).modules[0].feature_dim == dim


def test_options_override_defaults():
    report = convert(make_bert(), "luna", projections=4, channels=2, dwc=False)
    assert report.modules[0].feature_dim == 8
    model = make_bert()
    convert(model, "t2r", feature_dim=16, dwc=True, dwc_kernel=5)
    layer = linear_attention_modules(model)[0]
    assert layer.feature_dim == 16 and layer.dwc is not None and layer.dwc.conv.kernel_size == (5,)


def test_filter_fn_restricts_targets():
    model = make_bert()
    report = convert(model, "t2r", filter_fn=lambda _m, name: name.startswith("bert.encoder.layer.0."))
    assert [r.name for r in report.modules] == ["bert.encoder.layer.0.attention.self"]
    assert not isinstance(model.bert.encoder.layer[1].attention.self, LinearizedAttention)


def test_converted_modules_follow_model_dtype():
    model = make_bert().to(torch.bfloat16)
    convert(model, "luna")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ids = torch.randint(1, VOCAB, (2, 5))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.tensor([[1] * 5, [1, 1, 0, 0, 0]])).logits
    assert logits.dtype == torch.bfloat16 and bool(torch.isfinite(logits).all())


# ------------------------------------------------------------ mask normalisation
def _expected(lengths, n):
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]


def test_key_padding_mask_formats():
    n, lengths = 5, [5, 3]
    keep = _expected(lengths, n)
    minf = torch.finfo(torch.float32).min
    additive = torch.zeros(2, n).masked_fill(~keep, minf)
    formats = {
        "2d long": keep.long(),
        "2d bool": keep,
        "v4 eager [B,1,1,N]": additive[:, None, None, :],
        "v4 sdpa [B,1,N,N]": additive[:, None, None, :].expand(2, 1, n, n),
        "v5 sdpa bool [B,1,N,N]": keep[:, None, None, :].expand(2, 1, n, n),
        "-10000 convention": torch.zeros(2, n).masked_fill(~keep, -10000.0)[:, None, None, :],
        "-inf": torch.zeros(2, n).masked_fill(~keep, float("-inf"))[:, None, None, :],
        "bf16 additive": additive.to(torch.bfloat16)[:, None, None, :],
        "3d bool": keep[:, None, :].expand(2, n, n),
    }
    for name, mask in formats.items():
        got = key_padding_mask(mask)
        assert got is not None and torch.equal(got, keep), name
    # Pad query rows that keep everything (or nothing) do not hide the padding.
    rows = keep[:, None, :].expand(2, n, n).clone()
    rows[1, 3:] = True
    assert torch.equal(key_padding_mask(rows[:, None]), keep)
    rows[1, 3:] = False
    assert torch.equal(key_padding_mask(rows[:, None]), keep)


def test_key_padding_mask_read_once_is_never_stale():
    """Layers share the read mask while the tensor is unchanged: an in-place edit (also of an inference
    tensor, which has no version counter) or another tensor with the same values is read afresh."""
    keep = _expected([5, 3], 5)
    mask = keep.long()
    assert torch.equal(key_padding_mask(mask), keep)
    assert key_padding_mask(mask) is key_padding_mask(mask)  # the next layers' reading
    mask[1] = 1
    assert key_padding_mask(mask) is None
    assert torch.equal(key_padding_mask(keep.long()), keep)
    with torch.inference_mode():
        frozen = keep.long()
        assert torch.equal(key_padding_mask(frozen), keep)
        frozen[1] = 1
        assert key_padding_mask(frozen) is None
    # An example that is all padding (every query row keeps nothing) keeps no key, as before.
    empty = keep[:, None, :].expand(2, 5, 5).clone()
    empty[1] = False
    assert key_padding_mask(empty[:, None]).tolist() == [[True] * 5, [False] * 5]


def test_key_padding_mask_all_real_is_none():
    assert key_padding_mask(None) is None
    assert key_padding_mask(torch.ones(2, 4, dtype=torch.long)) is None
    assert key_padding_mask(torch.zeros(2, 1, 4, 4)) is None


def test_key_padding_mask_refuses_causal_masks():
    causal = torch.ones(4, 4, dtype=torch.bool).tril()[None, None].expand(2, 1, 4, 4)
    with pytest.raises(ValueError, match="key-padding"):
        key_padding_mask(causal)
    with pytest.raises(ValueError, match="eager"):
        key_padding_mask(object())  # e.g. a flex-attention BlockMask


def test_linear_attention_module_type():
    _, model, _ = converted("hf-bert", "luna")
    la = model.bert.encoder.layer[0].attention.self.linear_attn
    assert isinstance(la, LinearAttention) and la.phi_k is not None  # keys' own map (separate_key_map)
    _, model, _ = converted("hf-bert", "t2r")
    assert model.bert.encoder.layer[0].attention.self.linear_attn.phi_k is None  # one map, stored once


def test_package_exports_are_the_functions_after_submodule_imports():
    # The lazy exports must not be shadowed by submodules of the same name.
    import luna_convert
    import luna_convert.conversion  # noqa: F401  (what any internal import does)
    import luna_convert.linear_methods  # noqa: F401

    assert callable(luna_convert.convert) and callable(luna_convert.methods)
