"""``convert(model, method, options=None, **overrides)``: swap every supported softmax self-attention
for linear attention in place, keeping the pretrained weights. The method's options object, validated
once (given as one, e.g. by the run config, or made here from options by name), is what every layer holds
and what ``save`` writes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from torch import nn

from .adapters import (attention_like_classes, check_supported, find_adapter, is_transformers_config, linearize,
                       mark_converted, patch_grid, LinearizedAttention)
from .errors import ConversionError
from .layers.attention import LinearAttention
from .linear_methods.base import AttentionOptions
from .linear_methods.registry import get_method, resolve_options

CONFIG_ATTR = "linear_attention_config"  # set on a converted model; read by save() and the pipeline


@dataclass
class ConversionConfig:
    """What was converted and how; saved beside the weights so load() can rebuild it (``to_dict``: the options
    object written out field by field)."""

    method: str
    options: AttentionOptions
    targets: list[str] = field(default_factory=list)
    convert_local_layers: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ReplacedModule:
    name: str
    original_class: str
    adapter: str
    num_heads: int
    head_dim: int
    feature_dim: int
    params_added: int


@dataclass
class ConversionReport:
    method: str
    options: AttentionOptions
    modules: list[ReplacedModule]
    kept_local: list[str] = field(default_factory=list)  # sliding-window attention left softmax
    kept_softmax: list[str] = field(default_factory=list)  # attention modules left softmax on request

    @property
    def params_added(self) -> int:
        return sum(m.params_added for m in self.modules)

    def to_dict(self) -> dict:
        return {"method": self.method, "options": asdict(self.options), "params_added": self.params_added,
                "modules": [asdict(m) for m in self.modules], "kept_local": self.kept_local,
                "kept_softmax": self.kept_softmax}

    def __str__(self) -> str:
        lines = [f"{self.method}: replaced {len(self.modules)} attention modules, +{self.params_added:,} parameters"]
        lines += [f"  {m.name}: {m.original_class} ({m.num_heads} heads x {m.head_dim}, D={m.feature_dim}, "
                  f"+{m.params_added:,})" for m in self.modules]
        if self.kept_local:
            lines.append(f"  kept softmax: {len(self.kept_local)} sliding-window (local) attention modules "
                         "(convert_local_layers=True converts them too)")
        lines += [f"  {name}: kept softmax" for name in self.kept_softmax]
        return "\n".join(lines)


def is_converted(model: nn.Module) -> bool:
    return any(isinstance(m, LinearizedAttention) for m in model.modules())


def softmax_layer_names(names: list[str], layers: Sequence[int]) -> set[str]:
    """The attention modules that ``keep_softmax_layers`` names: indices into ``names`` (the supported
    self-attention modules in module order; negative from the end); out of range is a ConversionError."""
    bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not -len(names) <= i < len(names)]
    if bad:
        raise ConversionError(f"keep_softmax_layers {bad} out of range: the model has {len(names)} attention layers, "
                              f"numbered 0..{len(names) - 1} (negative counts from the end)")
    return {names[i] for i in layers}


def convert(
    model: nn.Module,
    method: str = "luna",
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    *,
    convert_local_layers: bool = False,
    keep_softmax_layers: Sequence[int] = (),
    options: AttentionOptions | None = None,
    **overrides,
) -> ConversionReport:
    """Convert ``model`` in place; returns what was replaced.

    ``filter_fn(module, name)`` restricts the targets (default: every supported
    self-attention). Sliding-window (local) attention, as in ModernBERT's local layers,
    stays softmax unless ``convert_local_layers``: linear attention attends to every key,
    so a converted local layer no longer sees only its window. ``keep_softmax_layers``:
    attention layers (0-based, in module order; negative from the end) left as softmax,
    a hybrid model. ``options``: the method's options object (e.g. ``LunaOptions(...)``; None: its
    defaults); ``overrides`` replace single options (see ``luna_convert.METHODS[method].defaults`` or
    ``luna-convert methods --details``). The one validated options object is what every layer gets and
    what ``save`` writes.
    """
    if is_converted(model):
        raise ConversionError("this model is already converted to linear attention; convert the original checkpoint instead")
    resolved = resolve_options(method, options if options is not None and not overrides else
                               {**(asdict(options) if options is not None else {}), **overrides})
    method = get_method(method).name  # an alias is recorded (and saved) under the method's name
    grid = patch_grid(model)
    check_supported(model)
    attention = [(name, module, adapter) for name, module in model.named_modules()
                 if (adapter := find_adapter(module)) is not None]
    kept = softmax_layer_names([name for name, _, _ in attention], keep_softmax_layers)
    supported = [(name, module, adapter) for name, module, adapter in attention
                 if name not in kept and (filter_fn is None or filter_fn(module, name))]
    kept_local = [] if convert_local_layers else [name for name, module, adapter in supported if adapter.local(module)]
    targets = [target for target in supported if target[0] not in kept_local]
    if kept and not targets:
        raise ConversionError(f"keep_softmax_layers keeps all {len(kept)} attention layers as softmax; leave at least "
                              "one to convert")
    if kept_local and not targets:
        raise ConversionError(f"every attention module chosen in {type(model).__name__} is sliding-window (local) "
                              "attention, which stays softmax by default; pass convert_local_layers=True to convert it")
    if not targets:
        found = attention_like_classes(model)
        raise ConversionError(
            f"no supported softmax self-attention in {type(model).__name__} (attention classes found: "
            f"{', '.join(found) or 'none'}); supported: bidirectional softmax self-attention with absolute "
            "positions in transformers BERT-family (DistilBERT, ALBERT too), ModernBERT (rotary), ViT/DeiT/DINOv2 and "
            "CLIP/SigLIP vision models and timm VisionTransformer (causal/decoder, cross-attention, other rotary and "
            "relative-position attention are not; see docs/architectures.md)"
        )

    # Build every replacement before touching the model, so that bad option values
    # (e.g. an odd channel count for the fourier bank) leave the model unconverted.
    built = []
    for name, module, adapter in targets:
        num_heads, head_dim, scale = adapter.heads(module)
        ref = next(module.parameters())
        try:
            linear_attn = LinearAttention(method, head_dim, num_heads, scale, spatial=grid is not None,
                                          options=resolved).to(device=ref.device, dtype=ref.dtype)
        except (ValueError, TypeError, RuntimeError) as e:  # RuntimeError: torch refusing e.g. a negative size
            raise ConversionError(f"invalid options for method {method!r} ({e}); see `luna-convert methods "
                                  "--details`") from None
        built.append((name, module, adapter, linear_attn, num_heads, head_dim))

    replaced = []
    for name, module, adapter, linear_attn, num_heads, head_dim in built:
        original_class = type(module).__name__
        linearize(module, adapter, linear_attn, patch_grid=grid)
        replaced.append(ReplacedModule(name, original_class, adapter.name, num_heads, head_dim,
                                       linear_attn.feature_dim, sum(p.numel() for p in linear_attn.parameters())))

    conversion = ConversionConfig(method, resolved, [r.name for r in replaced], convert_local_layers)
    setattr(model, CONFIG_ATTR, conversion)
    config = getattr(model, "config", None)
    if is_transformers_config(config):  # save_pretrained then writes a folder only luna-convert loads
        mark_converted(config, conversion.to_dict())
    return ConversionReport(method, resolved, replaced, kept_local, sorted(kept))


def convert_as_recorded(model: nn.Module, record: dict) -> ConversionReport:
    """Convert ``model`` as a saved conversion record (``ConversionConfig.to_dict()``) says: the same method,
    options and modules. The record may name a former method name (an alias); options it lacks take the values
    of the version that wrote it. Module names are compared without the base model's prefix (``bert.``), so a
    record made on a model with a task head converts the bare encoder too, and the other way round."""
    spec = get_method(record["method"])
    options = resolve_options(spec.name, spec.options.with_saved_defaults(record["options"]))
    prefix = getattr(model, "base_model_prefix", "") or ""
    bare = lambda name: name.removeprefix(f"{prefix}.") if prefix else name  # noqa: E731
    targets = {bare(name) for name in record["targets"]}
    report = convert(model, spec.name, filter_fn=lambda _m, name: bare(name) in targets,
                     convert_local_layers=record.get("convert_local_layers", False), options=options)
    if len(report.modules) != len(targets):
        raise ConversionError(f"the saved conversion names {len(targets)} attention modules; this "
                              f"{type(model).__name__} has {len(report.modules)} of them")
    return report


def linear_attention_modules(model: nn.Module) -> list[LinearAttention]:
    return [m for m in model.modules() if isinstance(m, LinearAttention)]


def feature_map_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The methods' parameters (feature maps or kernels): what attention distillation trains (DWC gets no
    gradient there)."""
    return [p for m in linear_attention_modules(model) for p in m.method_parameters()]
