"""Export a converted model for deployment: ONNX (run by a stock ONNX Runtime) or a torch.export program
(``.pt2``), each checked against the model in PyTorch before the file is written.

The graph takes the layers' PyTorch reference path (``ops.native.reference_kernels``): standard operators
only, no native kernel, so the file runs without luna-convert installed. Attention stays in linear form:
no [N, N] tensor in the graph (tests/test_export.py checks the ONNX graph's shapes).

Inputs, by name: ``input_ids``, ``attention_mask`` and, where the model's forward takes it,
``token_type_ids`` for text models; ``pixel_values`` for image models (timm's models too, whose forward
calls it ``x``). Batch and sequence length are dynamic (image size is fixed). Output 0 is the model's first
output: the logits of a classifier, the last hidden state of a base model.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .conversion import linear_attention_modules
from .errors import LunaConvertError
from .adapters.padding_masks import padding_masks_only
from .linear_methods.base import MethodCore
from .ops.native import reference_kernels

FORMATS = ("onnx", "pt2")
ONNX_OPSET = 18
# ONNX Runtime (or the exported program) must match PyTorch within this fraction of the output's largest
# magnitude, on the example inputs and on a second batch of another size: else nothing is written.
PARITY_TOLERANCE = 1e-4
EXPORT_EXTRA = "pip install 'luna-convert[export]'"


@dataclass
class ExportResult:
    """What ``export_model`` wrote and how closely the file reproduces the model."""

    path: Path
    format: str
    input_names: list[str]
    output_name: str
    dynamic: dict[str, list[str]]
    max_abs_error: float  # |file's output - PyTorch's|, largest over both checked batches
    output_scale: float  # max |PyTorch output| over the same batches
    seconds: float
    checked_shapes: list[dict[str, list[int]]] = field(default_factory=list)

    @property
    def relative_error(self) -> float:
        return self.max_abs_error / max(self.output_scale, 1e-30)


class _FirstOutput(nn.Module):
    """The model behind named tensor inputs, returning its first output as one tensor."""

    def __init__(self, model: nn.Module, input_names: list[str], positional: bool):
        super().__init__()
        self.model, self.input_names, self.positional = model, input_names, positional

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        out = self.model(*inputs) if self.positional else self.model(**dict(zip(self.input_names, inputs)))
        if isinstance(out, torch.Tensor):
            return out
        return out[0]  # a transformers ModelOutput or a tuple: its first (non-None) field


@dataclass
class _Signature:
    names: list[str]
    positional: bool  # timm: forward(x)
    image_shape: tuple[int, ...] | None  # (channels, height, width) for image models
    vocab_size: int = 0
    max_length: int = 0
    type_vocab_size: int = 0


def _signature(model: nn.Module) -> _Signature:
    """The inputs the export names, from the model's forward and config."""
    config = getattr(model, "config", None)
    if config is None:  # timm: forward(x); any other module without a config is refused
        patch_embed = getattr(model, "patch_embed", None)
        if patch_embed is None or not hasattr(patch_embed, "img_size"):
            raise LunaConvertError(f"cannot tell the inputs of {type(model).__name__} (neither a transformers model "
                                   "nor a timm ViT); export it with torch.onnx.export inside "
                                   "luna_convert.ops.native.reference_kernels()")
        return _Signature(["pixel_values"], True, (patch_embed.proj.in_channels, *patch_embed.img_size))
    params = inspect.signature(model.forward).parameters
    if "pixel_values" in params:
        size = config.image_size if isinstance(config.image_size, (list, tuple)) else (config.image_size,) * 2
        return _Signature(["pixel_values"], False, (getattr(config, "num_channels", 3), *size))
    if "input_ids" not in params:
        raise LunaConvertError(f"{type(model).__name__}'s forward takes neither input_ids nor pixel_values; only "
                               "text and image encoders are exported")
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if "token_type_ids" in params else [])
    return _Signature(names, False, None, int(config.vocab_size),
                      int(getattr(config, "max_position_embeddings", 0) or 512),
                      int(getattr(config, "type_vocab_size", 0) or 0))


def example_batch(signature: _Signature, batch: int, length: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Made-up inputs: random images, or token ids with the first example padded at its end."""
    g = torch.Generator().manual_seed(seed)
    if signature.image_shape is not None:
        return (torch.randn(batch, *signature.image_shape, generator=g),)
    ids = torch.randint(1, max(2, signature.vocab_size), (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, max(1, length - length // 3):] = 0
    inputs = [ids.masked_fill(mask == 0, 0), mask]
    if "token_type_ids" in signature.names:
        types = torch.zeros(batch, length, dtype=torch.long)
        if signature.type_vocab_size > 1:
            types[:, length // 2:] = 1
        inputs.append(types)
    return tuple(inputs)


def _refuse_unexportable(model: nn.Module, fmt: str) -> None:
    if fmt not in FORMATS:
        raise LunaConvertError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    methods = {layer.method for layer in linear_attention_modules(model)}
    if fmt == "onnx" and "sorting" in methods:
        raise LunaConvertError("the sorting kernel cannot be exported to ONNX: it sorts the keys and searches them "
                               "(searchsorted), which has no ONNX operator; export it with --format pt2")


def _dynamic_axes(signature: _Signature) -> dict[str, dict[int, str]]:
    if signature.image_shape is not None:
        return {"pixel_values": {0: "batch"}}
    return {name: {0: "batch", 1: "sequence"} for name in signature.names}


def _float32_copy(model: nn.Module) -> nn.Module:
    """The model in float32, eval mode (a copy when it is in another precision: the user's model is not changed)."""
    if any(p.dtype != torch.float32 for p in model.parameters() if p.is_floating_point()):
        model = copy.deepcopy(model).float()
    return model.eval()


@contextlib.contextmanager
def frozen_for_export(model: nn.Module):
    """Every method core of ``model`` frozen for the export (``MethodCore.frozen_for_export``)."""
    with contextlib.ExitStack() as stack:
        for core in model.modules():
            if isinstance(core, MethodCore):
                stack.enter_context(core.frozen_for_export())
        yield


def export_model(model: nn.Module, output: str | Path, fmt: str = "onnx", length: int = 16,
                 overwrite: bool = False) -> ExportResult:
    """Write ``model`` (converted or not) to ``output`` as ONNX or a torch.export program, float32, and check
    the file against the model in PyTorch on two batches of different sizes (``length`` tokens for the first
    text batch). Raises LunaConvertError, writing nothing, where the file would not match."""
    output = Path(output)
    if output.exists() and not overwrite:
        raise LunaConvertError(f"{output} already exists; pass --overwrite (overwrite=True) or choose another --output")
    if output.parent.exists() and not output.parent.is_dir():
        raise LunaConvertError(f"{output.parent} is a file; choose an --output inside a folder")
    _refuse_unexportable(model, fmt)
    model = _float32_copy(model)
    signature = _signature(model)
    if signature.image_shape is None:
        length = max(2, min(length, signature.max_length))
    wrapper = _FirstOutput(model, signature.names, signature.positional).eval()
    batches = [example_batch(signature, 2, length), example_batch(signature, 3, max(2, length // 2 + 1), seed=1)]
    start = time.perf_counter()
    output.parent.mkdir(parents=True, exist_ok=True)
    # written aside and renamed once checked (torch.export.load wants the .pt2 suffix)
    fd, partial = tempfile.mkstemp(prefix=".partial-", suffix=f".{fmt}", dir=output.parent)
    os.close(fd)
    try:
        with torch.no_grad():
            expected = [wrapper(*b) for b in batches]  # as the model runs in PyTorch: native kernels where they apply
            with reference_kernels(), padding_masks_only(model), frozen_for_export(model):
                run = (_write_onnx if fmt == "onnx" else _write_pt2)(wrapper, batches[0], signature, Path(partial))
            got = [run(b) for b in batches]
        error = max(float((g - e).abs().max()) for g, e in zip(got, expected))
        scale = max(float(e.abs().max()) for e in expected)
        if not math.isfinite(error) or error > PARITY_TOLERANCE * max(scale, 1e-30):
            raise LunaConvertError(f"the exported {fmt} model does not match PyTorch (largest difference {error:.3g} "
                                   f"for outputs up to {scale:.3g}); nothing was written")
        os.replace(partial, output)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    dynamic = {name: list(axes.values()) for name, axes in _dynamic_axes(signature).items()}
    return ExportResult(output, fmt, signature.names, "output", dynamic, error, scale, time.perf_counter() - start,
                        [{n: list(t.shape) for n, t in zip(signature.names, b)} for b in batches])


def _dynamic_shapes(signature: _Signature, dim=None) -> tuple:
    """torch.export's ``dynamic_shapes`` for the wrapper's ``*inputs``: each input's dynamic axes, named (ONNX's
    axis names) or, with ``dim``, all given that ``torch.export.Dim``."""
    axes = _dynamic_axes(signature)
    return (tuple({axis: name if dim is None else dim for axis, name in axes.get(n, {}).items()}
                  for n in signature.names),)


def _write_pt2(wrapper: nn.Module, example: tuple, signature: _Signature, path: Path):
    program = torch.export.export(wrapper, example, dynamic_shapes=_dynamic_shapes(signature, torch.export.Dim.DYNAMIC),
                                  strict=False)
    torch.export.save(program, str(path))
    module = torch.export.load(str(path)).module()
    return lambda batch: module(*batch)


def _write_onnx(wrapper: nn.Module, example: tuple, signature: _Signature, path: Path):
    try:
        import onnxruntime
        import onnxscript  # noqa: F401 - the exporter needs it; a clear message here beats its ImportError
    except ImportError as e:
        raise LunaConvertError(f"ONNX export needs onnx, onnxscript and onnxruntime ({e.name} is missing): "
                               f"{EXPORT_EXTRA}") from None
    with contextlib.redirect_stdout(io.StringIO()):  # the exporter prints its progress
        program = torch.onnx.export(wrapper, example, dynamo=True, opset_version=ONNX_OPSET,
                                    input_names=signature.names, output_names=["output"],
                                    dynamic_shapes=_dynamic_shapes(signature),
                                    verbose=False)
    program.save(str(path))
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return lambda batch: torch.from_numpy(session.run(None, {n: t.numpy() for n, t in zip(signature.names, batch)})[0])
