"""Families beyond the first four (docs/architectures.md): each converts keeping every original weight,
or is refused with a one-line message naming the family and why. Tiny models built from configs."""

from __future__ import annotations

import pytest
import torch

from conftest import HEADS, HIDDEN, IMAGE, INIT_STD, LAYERS, PATCH, VOCAB, seed_everything, transformers_major
from luna_convert import convert, load, save
from luna_convert.conversion import is_converted
from luna_convert.errors import ConversionError

V5 = transformers_major() >= 5
SIZES = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=64,
             initializer_range=INIT_STD, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
TEXT = dict(SIZES, vocab_size=VOCAB, max_position_embeddings=64)
VISION = dict(SIZES, image_size=IMAGE, patch_size=PATCH)
CLIP_SIZES = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=64,
                  image_size=IMAGE, patch_size=PATCH, attention_dropout=0.0)


def build(config_class: str, model_class: str, **options):
    import transformers

    seed_everything()
    config = getattr(transformers, config_class)(**options)
    return getattr(transformers, model_class)(config).eval()


TEXT_MODELS = {
    "roberta": lambda: build("RobertaConfig", "RobertaForSequenceClassification", **TEXT),
    "xlm-roberta": lambda: build("XLMRobertaConfig", "XLMRobertaForSequenceClassification", **TEXT),
    "camembert": lambda: build("CamembertConfig", "CamembertForSequenceClassification", **TEXT),
    "electra": lambda: build("ElectraConfig", "ElectraForSequenceClassification", embedding_size=HIDDEN, **TEXT),
    "bert-token-classification": lambda: build("BertConfig", "BertForTokenClassification", num_labels=5, **TEXT),
    "bert-question-answering": lambda: build("BertConfig", "BertForQuestionAnswering", **TEXT),
    "albert": lambda: build("AlbertConfig", "AlbertForSequenceClassification", embedding_size=16, **TEXT),
}
VISION_MODELS = {
    "deit-distilled": lambda: build("DeiTConfig", "DeiTForImageClassificationWithTeacher", num_labels=3, **VISION),
    "dinov2-registers": lambda: build("Dinov2WithRegistersConfig", "Dinov2WithRegistersModel", num_register_tokens=2,
                                      **VISION),
    "dinov2": lambda: build("Dinov2Config", "Dinov2Model", **VISION),
    "clip-vision": lambda: build("CLIPVisionConfig", "CLIPVisionModel", **CLIP_SIZES),
    "siglip-vision": lambda: build("SiglipVisionConfig", "SiglipVisionModel", **CLIP_SIZES),
}


def text_batch(model) -> dict:
    """Two sequences; the first has 3 pads at the end (pad ids as the model's embeddings expect)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    return {"input_ids": ids.masked_fill(mask == 0, model.config.pad_token_id or 0), "attention_mask": mask}


def image_batch(size: int = IMAGE) -> dict:
    return {"pixel_values": torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(7))}


def first_output(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)[0]  # logits, start_logits or last_hidden_state


def converted_keeping_weights(make, method: str = "luna", **options):
    """(original model's output on ``inputs``, converted model), checking every original parameter
    and buffer is still the very same tensor after conversion."""
    model = make()
    before = {name: t for name, t in (*model.named_parameters(), *model.named_buffers())}
    report = convert(model, method, **options)
    after = {name: t for name, t in (*model.named_parameters(), *model.named_buffers())}
    assert all(after[name] is t for name, t in before.items())
    assert report.modules
    return model, report


@pytest.mark.parametrize("family", sorted(TEXT_MODELS))
def test_text_family_converts_keeping_weights_padding_invariant_and_saves(family, tmp_path):
    make = TEXT_MODELS[family]
    original = make()
    inputs = text_batch(original)
    reference = first_output(original, inputs)
    model, report = converted_keeping_weights(make)
    out = first_output(model, inputs)
    print(f"{family}: {len(report.modules)} modules, original vs converted max |diff| "
          f"{(out - reference).abs().max().item():.3g}")
    # Padding invariance: the padded row alone (unpadded) gives the same output as in the batch.
    alone = {k: v[:1, :6] for k, v in inputs.items()}
    single = first_output(model, alone)
    batched = out[:1, :6] if out.dim() == 3 or (out.dim() == 2 and out.shape[1] == 9) else out[:1]
    # measured: <= 2.4e-7 (float32 summation order)
    torch.testing.assert_close(single, batched, atol=1e-5, rtol=0)
    save(model, tmp_path / "m")
    torch.testing.assert_close(first_output(load(tmp_path / "m"), inputs), out, atol=0, rtol=0)


@pytest.mark.parametrize("family", sorted(VISION_MODELS))
def test_vision_family_converts_keeping_weights_and_saves(family, tmp_path):
    make = VISION_MODELS[family]
    inputs = image_batch()
    reference = first_output(make(), inputs)
    model, report = converted_keeping_weights(make, dwc=True)
    out = first_output(model, inputs)
    print(f"{family}: {len(report.modules)} modules, original vs converted max |diff| "
          f"{(out - reference).abs().max().item():.3g}")
    save(model, tmp_path / "m")
    torch.testing.assert_close(first_output(load(tmp_path / "m"), inputs), out, atol=0, rtol=0)


@pytest.mark.parametrize("family, prefix", [("deit-distilled", 2), ("dinov2-registers", 3), ("dinov2", 1),
                                            ("clip-vision", 1), ("siglip-vision", 0)])
def test_vision_prefix_tokens_reach_the_dwc_grid(family, prefix):
    """DeiT: CLS + distillation token; DINOv2 with registers: CLS + 2 registers; SigLIP: none."""
    model, _ = converted_keeping_weights(VISION_MODELS[family], dwc=True)
    attention = next(m for m in model.modules() if hasattr(m, "linear_attn"))
    grid = (IMAGE // PATCH,) * 2
    assert attention.patch_grid.layout(prefix + grid[0] * grid[1]) == (grid, prefix)
    first_output(model, image_batch())
    assert attention.patch_grid.current == grid


def test_dinov2_interpolated_positions_at_another_resolution():
    model, _ = converted_keeping_weights(VISION_MODELS["dinov2"], dwc=True)
    out = first_output(model, image_batch(48))  # DINOv2 always interpolates its position embeddings
    assert out.shape == (2, 1 + 6 * 6, HIDDEN) and bool(torch.isfinite(out).all())
    assert next(m for m in model.modules() if hasattr(m, "linear_attn")).patch_grid.current == (6, 6)


def test_albert_shared_attention_is_converted_once_and_stays_shared():
    make = TEXT_MODELS["albert"]
    original_params = sum(p.numel() for p in make().parameters())
    model, report = converted_keeping_weights(make)
    shared = {id(m) for m in model.modules() if hasattr(m, "linear_attn")}
    assert len(report.modules) == 1 and len(shared) == 1
    assert sum(p.numel() for p in model.parameters()) == original_params + report.params_added


def test_clip_and_siglip_keep_their_softmax_scale():
    for family in ("clip-vision", "siglip-vision"):
        model, report = converted_keeping_weights(VISION_MODELS[family], method="t2r")
        assert all(m.adapter == "hf-vision-tower" for m in report.modules)
        attention = next(m for m in model.modules() if hasattr(m, "linear_attn"))
        assert attention.linear_attn.softmax_scale == attention.scale == (HIDDEN // HEADS) ** -0.5


# ----------------------------------------------------------------------------- refusals
REFUSED = {
    "mpnet": (lambda: build("MPNetConfig", "MPNetModel", **TEXT), "MPNet", "relative-position bias"),
    "deberta-v2": (lambda: build("DebertaV2Config", "DebertaV2Model", **TEXT), "DeBERTa", "disentangled attention"),
    "deberta": (lambda: build("DebertaConfig", "DebertaModel", **TEXT), "DeBERTa", "disentangled attention"),
    "beit": (lambda: build("BeitConfig", "BeitModel", use_relative_position_bias=True, **VISION), "BEiT",
             "relative-position bias"),
    "data2vec-vision": (lambda: build("Data2VecVisionConfig", "Data2VecVisionModel", use_relative_position_bias=True,
                                      **VISION), "data2vec-vision", "relative-position bias"),
    "swin": (lambda: build("SwinConfig", "SwinModel", image_size=IMAGE, patch_size=4, embed_dim=16, depths=[1, 1],
                           num_heads=[2, 2], window_size=4), "Swin", "shifted-window masks"),
    "bert-relative_key": (lambda: build("BertConfig", "BertModel", position_embedding_type="relative_key", **TEXT),
                          "BERT family with relative position embeddings", "relative-position scores"),
    "bert-relative_key_query": (lambda: build("BertConfig", "BertModel", position_embedding_type="relative_key_query",
                                              **TEXT),
                                "BERT family with relative position embeddings", "relative-position scores"),
}


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_refused_family_names_the_family_and_the_reason(family):
    make, name, reason = REFUSED[family]
    model = make()
    with pytest.raises(ConversionError) as info:
        convert(model, "luna")
    message = str(info.value)
    assert name in message and reason in message and "\n" not in message
    assert not is_converted(model)


def test_clip_text_tower_is_left_softmax():
    """CLIP's text attention is causal: the adapter matches the vision tower only."""
    model = build("CLIPTextConfig", "CLIPTextModel", vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, intermediate_size=64)
    with pytest.raises(ConversionError, match="no supported softmax self-attention in CLIPTextModel"):
        convert(model, "luna")
