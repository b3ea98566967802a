"""Transformers ViT checkpoints saved with their image processor,
unexpected exceptions in the CLI, every method through the pipeline on a transformers ViT, and
saving timm models made with plain ``timm.create_model``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import luna_convert
from luna_convert.cli import app
from luna_convert.errors import LunaConvertError
from luna_convert.run.models import load_model
from luna_convert.run.pipeline import evaluate_model, run_conversion

from conftest import IMAGE, NUM_LABELS, make_hf_vit
from builders import config_for, write_image_folder


def write_hf_vit_checkpoint(folder: Path, processor=None) -> Path:
    """A tiny ViT classifier saved like a hub checkpoint (config.json, model.safetensors) and, if
    given, its image processor (preprocessor_config.json)."""
    make_hf_vit().save_pretrained(folder)
    if processor is not None:
        processor.save_pretrained(folder)
    return folder


def processors():
    """(id, image processor, the square side it gives) for the layouts checkpoints use."""
    import transformers

    return [
        ("vit-height-width", lambda: transformers.ViTImageProcessor(size={"height": IMAGE, "width": IMAGE},
                                                                   image_mean=[0.1, 0.2, 0.3]), IMAGE),
        ("vit-int", lambda: transformers.ViTImageProcessor(size=IMAGE), IMAGE),
        # resize the short side to 40, then centre-crop 32: the model sees 32
        ("clip-shortest-edge-and-crop", lambda: transformers.CLIPImageProcessor(
            size={"shortest_edge": IMAGE + 8}, crop_size={"height": IMAGE, "width": IMAGE}), IMAGE),
        ("convnext-shortest-edge", lambda: transformers.ConvNextImageProcessor(size={"shortest_edge": IMAGE}), IMAGE),
    ]


@pytest.mark.parametrize("name, make, side", processors(), ids=[p[0] for p in processors()])
def test_saved_image_processor_gives_the_image_size(tmp_path, name, make, side):
    """transformers 5 reloads ``size`` as a SizeDict (4.57: a dict); both must give the side."""
    processor = make()
    folder = write_hf_vit_checkpoint(tmp_path / "vit", processor)
    loaded = load_model(str(folder))
    assert loaded.kind == "image" and loaded.image_processor is not None
    assert loaded.image_config["size"] == side
    assert loaded.image_config["mean"] == pytest.approx(tuple(processor.image_mean))
    assert loaded.image_config["std"] == pytest.approx(tuple(processor.image_std))


def test_non_square_processor_size_is_refused_naming_the_file(tmp_path):
    import transformers

    folder = write_hf_vit_checkpoint(tmp_path / "vit", transformers.ViTImageProcessor(size={"height": 32, "width": 48}))
    with pytest.raises(LunaConvertError, match=r"preprocessor_config\.json.*non-square size 32x48"):
        load_model(str(folder))


def test_cli_runs_a_vit_saved_with_its_processor(tmp_path):
    """The audit's case: `run --model DIR --data-dir IMAGEFOLDER` on a ViT folder with its
    ViTImageProcessor died with a TypeError traceback on transformers 5."""
    import transformers

    model_dir = write_hf_vit_checkpoint(
        tmp_path / "vit", transformers.ViTImageProcessor(size={"height": IMAGE, "width": IMAGE}))
    images = write_image_folder(tmp_path / "images")
    result = CliRunner().invoke(app, ["run", "--model", str(model_dir), "--data-dir", str(images), "--method", "t2r",
                                      "--max-steps", "1", "--batch-size", "4", "--output-dir", str(tmp_path / "out")])
    assert result.exit_code == 0, (result.output[-2000:], repr(result.exception))
    (results_file,) = (tmp_path / "out").glob("*/results.json")
    assert json.loads(results_file.read_text())["eval_examples"] == 9
    assert (results_file.parent / "model" / "preprocessor_config.json").is_file()


def test_unexpected_exception_is_one_line_naming_the_model_and_debug_shows_it(tmp_path, monkeypatch):
    import luna_convert.run.pipeline as pipeline

    def broken(config, resume=None, console=None):
        raise TypeError("int() argument must be a string, a bytes-like object or a real number, not 'SizeDict'")

    monkeypatch.setattr(pipeline, "run_conversion", broken)
    args = ["run", "--model", str(tmp_path / "my-vit"), "--data-dir", str(tmp_path / "my-images"),
            "--output-dir", str(tmp_path / "out")]
    result = CliRunner().invoke(app, args)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1, (result.output[-2000:], repr(result.exception))
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "Traceback" not in result.output
    line = lines[0]
    assert f"model {tmp_path / 'my-vit'}" in line and f"data {tmp_path / 'my-images'}" in line
    assert "TypeError: int() argument" in line and "rerun with --debug" in line
    assert "test_audit_loading.py" in line  # where it was raised
    debug = CliRunner().invoke(app, ["--debug", *args])
    assert isinstance(debug.exception, TypeError)  # --debug lets the real exception (and traceback) through


# ------------------------------------------------------------- item 0b: every method on a transformers ViT
@pytest.fixture(scope="module")
def hf_vit_setup(tmp_path_factory):
    """No preprocessor_config.json: the audit's case, apart from the processor problem above."""
    root = tmp_path_factory.mktemp("hf-vit")
    return write_hf_vit_checkpoint(root / "vit"), write_image_folder(root / "images")


@pytest.mark.parametrize("method", sorted(luna_convert.METHODS))
def test_transformers_vit_runs_every_method_through_the_pipeline(hf_vit_setup, tmp_path, method):
    """LUNA (spatial DWC) stopped in the pre-flight check on every transformers ViT."""
    model_dir, images = hf_vit_setup
    config = config_for(model_dir, images, "image-classification", method, tmp_path, max_steps=2)
    results = run_conversion(config)
    assert len(results["conversion"]["modules"]) == 2
    assert results["conversion"]["modules"][0]["adapter"] in ("hf-proj", "hf-separate")
    assert results["steps"] == {"distill": 2 if luna_convert.METHODS[method].distill else 0, "finetune": 2}
    assert results["eval_examples"] == 9
    again = evaluate_model(results["run_dir"])
    assert again["converted"] and again["metrics"]["accuracy"] == results["converted_score"]


def test_preflight_check_leaves_the_model_untouched():
    from luna_convert.conversion import is_converted
    from luna_convert.run.preflight import check_convertible

    model = make_hf_vit()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    check_convertible(model, "luna", {})
    assert not is_converted(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks for m in model.modules())  # the probe's grid hook is on its own copy


# ------------------------------------------------------------- item 8: plain timm.create_model
TIMM_VARIANTS = {
    "registers-avg-pool-qk-norm-layer-scale-dynamic": dict(
        img_size=IMAGE, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=NUM_LABELS, reg_tokens=2,
        global_pool="avg", qk_norm=True, init_values=0.1, dynamic_img_size=True),
    "non-square-no-class-token-pre-norm": dict(
        img_size=(IMAGE, 48), patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=NUM_LABELS,
        class_token=False, global_pool="avg", mlp_ratio=2.0, no_embed_class=True, pre_norm=True),
}


@pytest.mark.parametrize("arch", ["vit_tiny_patch16_224", "deit_small_patch16_224"])
@pytest.mark.parametrize("variant", sorted(TIMM_VARIANTS))
@pytest.mark.parametrize("method", [None, "luna"])
def test_plain_timm_create_model_saves_and_loads(tmp_path, arch, variant, method):
    import timm

    torch.manual_seed(0)
    kwargs = TIMM_VARIANTS[variant]
    model = timm.create_model(arch, **kwargs).eval()
    if method is not None:
        luna_convert.convert(model, method, dwc=True)
        with torch.no_grad():  # DWC starts at zero: give it weights so the comparison covers it
            for name, p in model.named_parameters():
                if ".dwc." in name:
                    p.normal_(0.0, 0.3)
    luna_convert.save(model, tmp_path / "saved")
    spec = json.loads((tmp_path / "saved" / "linear_attention.json").read_text())["model"]
    assert spec["library"] == "timm" and spec["model_name"] == arch
    again = luna_convert.load(tmp_path / "saved")
    size = kwargs["img_size"] if isinstance(kwargs["img_size"], tuple) else (kwargs["img_size"],) * 2
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x), atol=0, rtol=0)  # the same tensors: bit-exact


def test_timm_model_without_its_architecture_name_is_refused(tmp_path):
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(img_size=IMAGE, patch_size=8, embed_dim=32, depth=1, num_heads=4, num_classes=3)
    model.pretrained_cfg = {}  # built from the class, not by name: nothing says which entry point rebuilds it
    with pytest.raises(LunaConvertError, match=r"cannot tell which timm architecture.*create_timm_model"):
        luna_convert.save(model, tmp_path / "saved")
    assert not (tmp_path / "saved").exists()


def test_timm_model_whose_shapes_cannot_be_rebuilt_is_refused(tmp_path):
    import timm

    model = timm.create_model("vit_tiny_patch16_224", img_size=IMAGE, patch_size=8, embed_dim=32, depth=1, num_heads=4)
    model.blocks[0].mlp.fc2 = torch.nn.Linear(128, 32, bias=False)  # surgery no constructor argument describes
    with pytest.raises(LunaConvertError, match=r"cannot rebuild this timm vit_tiny_patch16_224.*fc2.bias"):
        luna_convert.save(model, tmp_path / "saved")
    assert not (tmp_path / "saved").exists()
