"""Export of converted models: ONNX run by ONNX Runtime and torch.export programs, against the model in
PyTorch; attention kept in linear form in the ONNX graph; torch.jit.trace refused with one sentence."""

from __future__ import annotations

import pytest
import torch
import transformers

import luna_convert
from builders import cli_error_line, invoke_cli
from conftest import ARCHITECTURES, make_bert
from luna_convert.errors import LunaConvertError
from luna_convert.export import PARITY_TOLERANCE, export_model
from luna_convert.layers.attention import TRACING_REFUSED
from luna_convert.linear_methods.registry import METHODS

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

ONNX_METHODS = sorted(name for name in METHODS if name != "sorting")
FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


TRANSFORMERS_V5 = int(transformers.__version__.split(".")[0]) >= 5


def _bert_inputs(batch: int, length: int, pad: int = 0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 99, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if pad:
        mask[-1, length - pad:] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
            "token_type_ids": torch.zeros(batch, length, dtype=torch.long)}


def _onnx_matches(path, model, inputs: dict) -> float:
    """|ONNX Runtime - PyTorch| / max |PyTorch| on ``inputs`` (a batch the export never saw)."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    got = session.run(None, {n: inputs[n].numpy() for n in names})[0]
    with torch.no_grad():
        out = model(**{n: inputs[n] for n in names})
    expected = (out if isinstance(out, torch.Tensor) else out[0]).numpy()
    return float(abs(got - expected).max() / abs(expected).max())


def _quadratic_values(path, floats_only: bool = True) -> list[str]:
    """Values in the ONNX graph with two sequence axes: an N x N attention matrix (``floats_only``), or any
    N x N tensor (a mask, its reductions)."""
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)), data_prop=True)
    found = []
    for value in model.graph.value_info:
        dims = [d.dim_param for d in value.type.tensor_type.shape.dim]
        if (value.type.tensor_type.elem_type in FLOAT_TYPES or not floats_only) and dims.count("sequence") >= 2:
            found.append(f"{value.name} {dims}")
    return found


@pytest.mark.parametrize("method", ONNX_METHODS)
def test_onnx_matches_pytorch_for_every_method_on_bert(method, tmp_path):
    model = make_bert(layers=1)
    luna_convert.convert(model, method=method)
    result = export_model(model, tmp_path / "m.onnx", length=8)
    assert result.relative_error < PARITY_TOLERANCE
    # a batch of another size and length, padded, run by a fresh ONNX Runtime session
    assert _onnx_matches(tmp_path / "m.onnx", model, _bert_inputs(3, 13, pad=4, seed=3)) < PARITY_TOLERANCE


def test_onnx_graph_has_no_quadratic_attention_but_the_original_has(tmp_path):
    original = make_bert(layers=1)
    export_model(original, tmp_path / "softmax.onnx", length=8)
    assert _quadratic_values(tmp_path / "softmax.onnx"), "the check must see softmax's N x N scores"
    converted = make_bert(layers=1)
    luna_convert.convert(converted, method="luna")
    export_model(converted, tmp_path / "luna.onnx", length=8)
    assert _quadratic_values(tmp_path / "luna.onnx") == []
    if TRANSFORMERS_V5:  # v5 builds masks through an interface the export switches to [B, N]
        assert _quadratic_values(tmp_path / "luna.onnx", floats_only=False) == []  # no N x N mask either
        assert converted.config._attn_implementation == "sdpa"  # switched back after the export


def test_padding_masks_only_leaves_models_with_softmax_layers_alone():
    from luna_convert.adapters.padding_masks import padding_masks_only

    kept = make_bert(layers=2)
    luna_convert.convert(kept, method="hedgehog", keep_softmax_layers=[0])
    with padding_masks_only(kept) as switched:
        assert not switched and kept.config._attn_implementation == "sdpa"
    converted = make_bert(layers=2)
    luna_convert.convert(converted, method="hedgehog")
    inputs = _bert_inputs(2, 9, pad=3, seed=1)
    with torch.no_grad():
        expected = converted(**inputs, output_hidden_states=True).hidden_states[-1]
        with padding_masks_only(converted) as switched:
            got = converted(**inputs, output_hidden_states=True).hidden_states[-1]
    assert switched == (TRANSFORMERS_V5)
    assert torch.equal(got, expected)  # the layers read the same padding from [B, N] as from [B, 1, N, N]


@pytest.mark.parametrize("arch", ["hf-vit", "timm-vit"])
@pytest.mark.parametrize("method", ["luna", "hedgehog", "t2r"])
def test_onnx_matches_pytorch_on_vits(arch, method, tmp_path):
    model = ARCHITECTURES[arch]()
    luna_convert.convert(model, method=method)
    result = export_model(model, tmp_path / "m.onnx")
    assert result.input_names == ["pixel_values"]
    assert result.relative_error < PARITY_TOLERANCE
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run(None, {"pixel_values": images.numpy()})[0])
    with torch.no_grad():
        expected = model(images) if arch == "timm-vit" else model(pixel_values=images).logits
    assert float((got - expected).abs().max() / expected.abs().max()) < PARITY_TOLERANCE


@pytest.mark.parametrize("variant", [{"method": "hedgehog", "window": 2}, {"method": "luna", "dwc": True},
                                     {"method": "t2r", "keep_softmax_layers": [0]}])
def test_windows_dwc_and_kept_softmax_layers_export(variant, tmp_path):
    model = make_bert(layers=2)
    luna_convert.convert(model, **variant)
    export_model(model, tmp_path / "m.onnx", length=10)
    assert _onnx_matches(tmp_path / "m.onnx", model, _bert_inputs(2, 12, pad=3, seed=4)) < PARITY_TOLERANCE


def test_sorting_is_refused_for_onnx_with_the_reason(tmp_path):
    model = make_bert(layers=1)
    luna_convert.convert(model, method="sorting")
    with pytest.raises(LunaConvertError, match="sorting kernel cannot be exported to ONNX.*--format pt2"):
        export_model(model, tmp_path / "m.onnx")
    assert not list(tmp_path.iterdir()), "nothing is written"


def test_pt2_program_runs_and_matches(tmp_path):
    model = make_bert(layers=1)
    luna_convert.convert(model, method="luna")
    result = export_model(model, tmp_path / "m.pt2", fmt="pt2", length=8)
    assert result.relative_error < PARITY_TOLERANCE
    program = torch.export.load(str(tmp_path / "m.pt2")).module()
    inputs = _bert_inputs(3, 11, pad=2, seed=6)
    with torch.no_grad():
        expected = model(**inputs).logits
        got = program(inputs["input_ids"], inputs["attention_mask"], inputs["token_type_ids"])
    assert float((got - expected).abs().max() / expected.abs().max()) < PARITY_TOLERANCE


def test_export_command_writes_a_checked_file_and_refuses_bad_input(tmp_path):
    model = make_bert(layers=1)
    luna_convert.convert(model, method="t2r")
    luna_convert.save(model, tmp_path / "saved")
    out = tmp_path / "deploy" / "model.onnx"
    result = invoke_cli("export", tmp_path / "saved", "--output", out, "--length", 8)
    assert result.exit_code == 0, result.output
    assert out.is_file() and "matches PyTorch" in result.stdout and "input_ids" in result.stdout
    assert _onnx_matches(out, model, _bert_inputs(2, 9, pad=2)) < PARITY_TOLERANCE
    again = invoke_cli("export", tmp_path / "saved", "--output", out)
    assert "already exists; pass --overwrite" in cli_error_line(again)
    wrong = invoke_cli("export", tmp_path / "saved", "--output", tmp_path / "m.x", "--format", "tflite")
    assert "unknown export format 'tflite'" in cli_error_line(wrong)
    assert sorted(p.name for p in (tmp_path / "deploy").iterdir()) == ["model.onnx"], "no partial file left"


@pytest.mark.parametrize("method", ["luna", "elu", "t2r"])
def test_jit_trace_is_refused_with_one_sentence(method):
    model = make_bert(layers=1)
    luna_convert.convert(model, method=method)
    inputs = _bert_inputs(2, 6, pad=2)
    with pytest.raises(RuntimeError) as caught:
        torch.jit.trace(model, (inputs["input_ids"], inputs["attention_mask"]), strict=False)
    assert TRACING_REFUSED in str(caught.value)
    assert "torch.export" in TRACING_REFUSED and "\n" not in TRACING_REFUSED


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("method", ["luna", "hedgehog", "t2r", "cosformer", "flexformer"])
def test_torch_export_of_a_layer_matches_eager_in_float32_and_bfloat16(method, dtype):
    from luna_convert.layers.attention import LinearAttention

    layer = LinearAttention(method, 16, 2, 0.25).to(dtype).eval()
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 2, 12, 16, generator=g).to(dtype) for _ in range(3))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 8:] = False
    batch, tokens = torch.export.Dim("batch", min=2, max=16), torch.export.Dim("tokens", min=3, max=64)
    dims = {"q": {0: batch, 2: tokens}, "k": {0: batch, 2: tokens}, "v": {0: batch, 2: tokens},
            "key_mask": {0: batch, 1: tokens}}
    with torch.no_grad():
        program = torch.export.export(layer, (q, k, v, mask), dynamic_shapes=dims, strict=False)
        q2, k2, v2 = (torch.randn(3, 2, 20, 16, generator=g).to(dtype) for _ in range(3))
        mask2 = torch.ones(3, 20, dtype=torch.bool)
        mask2[0, 15:] = False
        got, want = program.module()(q2, k2, v2, mask2), layer(q2, k2, v2, mask2)
    scale = want.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= 4 * torch.finfo(dtype).eps * scale
    # no write into part of a tensor (the denominator's column, LUNA's DWC taps): exported, each copies the whole
    decomposed = program.run_decompositions()  # functional, as ONNX gets it
    assert not [node for module in decomposed.graph_module.modules() if isinstance(module, torch.fx.GraphModule)
                for node in module.graph.nodes if "scatter" in str(node.target)]
