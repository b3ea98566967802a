"""Attention maps (LUNA paper, Figure 4): the CLS rows of softmax and linear attention.

Tiny converted models are saved with luna_convert.save; the rows the tool returns are checked
against the formulas written out here from the model's own projections, and the PNGs are
opened back.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from luna_convert.tools.attention_map import attention_map_command, compute_attention_map, open_image
from luna_convert.cli import app
from luna_convert.conversion import convert
from luna_convert.run.models import load_model
from luna_convert.serialization import save

from conftest import make_timm_vit
from builders import write_bert_checkpoint

SENTENCE = "the movie was very good not bad"


def perturb_added_weights(model, seed: int = 0) -> None:
    """Non-trivial feature maps and DWC (a fresh conversion starts at identity / zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "linear_attn" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A run-like folder: config.json naming the original BERT + model/ holding its LUNA conversion."""
    import transformers

    root = tmp_path_factory.mktemp("attn-text")
    original = write_bert_checkpoint(root / "bert")
    tokenizer = transformers.AutoTokenizer.from_pretrained(original)
    model = transformers.BertForSequenceClassification.from_pretrained(original)
    convert(model, "luna")
    perturb_added_weights(model)
    with torch.no_grad():  # peaked attention (the checkpoint's 0.02 init gives nearly uniform rows)
        for layer in model.bert.encoder.layer:
            layer.attention.self.query.weight.mul_(15)
            layer.attention.self.key.weight.mul_(15)
    run = root / "run"
    save(model, run / "model", tokenizer=tokenizer, extra={"task": "sst2"})
    (run / "config.json").write_text(json.dumps({"model": str(original), "method": "luna", "train": {}}))
    return run, original


@pytest.fixture(scope="module")
def image_model(tmp_path_factory):
    model = make_timm_vit(reg_tokens=2)  # CLS + 2 registers before the 4 x 4 patch grid
    convert(model, "hedgehog")
    perturb_added_weights(model, seed=1)
    folder = tmp_path_factory.mktemp("attn-image") / "vit"
    save(model, folder, extra={"image_config": {"mean": [0.5] * 3, "std": [0.5] * 3, "size": 32}})
    return folder


def explicit_rows(q: torch.Tensor, k: torch.Tensor, module, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Query 0 of one example, heads averaged, straight from the definitions. q, k: [H, N, d]."""
    soft = torch.softmax(torch.einsum("hd,hnd->hn", q[:, 0], k) * scale, dim=-1)  # [H, N]
    phi_q, phi_k = module.features(q[None], k[None])
    scores = torch.einsum("hf,hnf->hn", phi_q[0, :, 0], phi_k[0])
    linear = scores / scores.sum(-1, keepdim=True)
    return soft.mean(0).numpy(), linear.mean(0).numpy()


def assert_png(path: Path) -> None:
    assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as img:
        assert img.size[0] > 100 and img.size[1] > 100


@pytest.mark.parametrize("layer", [0, -1])
def test_text_rows_match_the_formulas_and_png(text_run, tmp_path, layer):
    run, _ = text_run
    out, amap = attention_map_command(run, text=SENTENCE, layer=layer, output=tmp_path / "text.png")
    assert_png(out)
    assert amap.kind == "text" and amap.tokens[0] == "[CLS]" and len(amap.tokens) == len(amap.softmax)
    assert amap.layer == (layer % amap.num_layers) and amap.num_layers == 2
    assert amap.softmax.sum() == pytest.approx(1.0, abs=1e-5)
    assert amap.linear.sum() == pytest.approx(1.0, abs=1e-4)  # the kernel's eps in the denominator
    assert (amap.linear >= 0).all() and not np.allclose(amap.linear, amap.softmax, atol=1e-3)

    # The formulas, from the hidden states entering the layer and its query/key projections.
    loaded = load_model(str(run / "model"))
    bert = loaded.model
    encoded = loaded.tokenizer(SENTENCE, return_tensors="pt")
    with torch.no_grad():
        hidden = bert(**encoded, output_hidden_states=True).hidden_states[amap.layer]
        attention = bert.bert.encoder.layer[amap.layer].attention.self
        heads = lambda x: x[0].view(x.shape[1], 4, -1).transpose(0, 1)  # noqa: E731  [H, N, d]
        q, k = heads(attention.query(hidden)), heads(attention.key(hidden))
        soft, linear = explicit_rows(q, k, attention.linear_attn, attention.linear_attn.softmax_scale)
    np.testing.assert_allclose(amap.softmax, soft, atol=1e-5)
    np.testing.assert_allclose(amap.linear, linear, atol=1e-4)


def test_teacher_softmax_row_is_the_original_models_attention(text_run, tmp_path):
    """--original teacher: the softmax row of the original, unconverted model (what it really attends to)."""
    import transformers

    run, original = text_run
    _, amap = attention_map_command(run, text=SENTENCE, layer=1, output=tmp_path / "t.png", original="teacher")
    assert amap.original == str(original)
    teacher = transformers.BertForSequenceClassification.from_pretrained(original, attn_implementation="eager").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(original)
    with torch.no_grad():
        attentions = teacher(**tokenizer(SENTENCE, return_tensors="pt"), output_attentions=True).attentions
    np.testing.assert_allclose(amap.softmax, attentions[1][0, :, 0].mean(0).numpy(), atol=1e-5)
    _, own = attention_map_command(run, text=SENTENCE, layer=1, output=tmp_path / "c.png")
    np.testing.assert_allclose(amap.linear, own.linear, atol=1e-7)  # the linear row is the converted model's


def test_image_rows_match_the_formulas_and_png(image_model, tmp_path):
    from luna_convert.tools.attention_map import _image_inputs

    out, amap = attention_map_command(image_model, image="digits:7", layer=-1, output=tmp_path / "image.png")
    assert_png(out)
    assert amap.kind == "image" and amap.grid == (4, 4) and amap.num_prefix == 3 and len(amap.softmax) == 19
    assert amap.picture.shape == (32, 32, 3)
    assert amap.softmax.sum() == pytest.approx(1.0, abs=1e-5)
    assert amap.linear.sum() == pytest.approx(1.0, abs=1e-4)
    soft_map, linear_map = amap.patch_maps()
    assert soft_map.shape == linear_map.shape == (4, 4)

    loaded = load_model(str(image_model))
    vit = loaded.model
    inputs, _ = _image_inputs(loaded, open_image("digits:7"))
    with torch.no_grad():  # timm's forward_features up to the last block's attention, by hand
        x = vit.norm_pre(vit._pos_embed(vit.patch_embed(inputs["pixel_values"])))
        for block in vit.blocks[:-1]:
            x = block(x)
        attn = vit.blocks[-1].attn
        qkv = attn.qkv(vit.blocks[-1].norm1(x)).reshape(1, x.shape[1], 3, attn.num_heads, attn.head_dim)
        q, k, _ = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        q, k = attn.q_norm(q)[0], attn.k_norm(k)[0]
        soft, linear = explicit_rows(q, k, attn.linear_attn, attn.scale)
    np.testing.assert_allclose(amap.softmax, soft, atol=1e-5)
    np.testing.assert_allclose(amap.linear, linear, atol=1e-4)


def test_compute_attention_map_takes_a_loaded_model_and_a_pil_image(image_model):
    loaded = load_model(str(image_model))
    picture = Image.fromarray((np.random.default_rng(0).random((50, 40, 3)) * 255).astype("uint8"))
    amap = compute_attention_map(loaded, image=picture, layer=0)
    assert amap.layer == 0 and amap.softmax_heads.shape == (4, 19)
    np.testing.assert_allclose(amap.softmax_heads.sum(-1), 1.0, atol=1e-5)


def test_cli_writes_png_and_refuses_to_overwrite(image_model, text_run, tmp_path):
    out = tmp_path / "cli.png"
    args = ["attention-map", str(image_model), "--image", "digits:3", "--layer", "-1", "--output", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert_png(out)
    before = out.read_bytes()
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 2 and "already exists; pass --overwrite" in again.stderr
    assert out.read_bytes() == before
    assert CliRunner().invoke(app, [*args, "--overwrite"]).exit_code == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--text", "good"], "this is an image model: pass --image"),
        (["--image", "digits:1", "--layer", "5"], "--layer 5 is out of range: the model has 2 converted attention layers"),
        (["--image", "/no/such.png"], "image /no/such.png does not exist"),
        (["--image", "digits:99999"], "use digits:N with N in 0..1796"),
        ([], "pass exactly one of --text"),
        (["--image", "digits:1", "--original", "teacher"], "--original teacher needs a run folder"),
    ],
)
def test_cli_bad_inputs_one_line(image_model, tmp_path, args, message):
    result = CliRunner().invoke(app, ["attention-map", str(image_model), "--output", str(tmp_path / "x.png"), *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "x.png").exists()


def test_cli_refuses_an_unconverted_model(text_run, tmp_path):
    _, original = text_run
    result = CliRunner().invoke(app, ["attention-map", str(original), "--text", "good", "-o", str(tmp_path / "x.png")])
    assert result.exit_code == 2 and "has no converted model" in result.stderr
