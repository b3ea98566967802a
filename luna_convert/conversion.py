"""``convert(model, method, **options)``: swap every supported softmax self-attention
for linear attention in place, keeping the pretrained weights."""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, field
from typing import Callable

from torch import nn

from .adapters import (attention_like_classes, check_supported, find_adapter, linearize, patch_grid,
                       LinearizedAttention)
from .attention import LinearAttention
from .errors import ConversionError
from .method_specs import ATTENTION_OPTIONS, get_method

CONFIG_ATTR = "linear_attention_config"  # set on a converted model; read by save() and the pipeline


@dataclass
class ConversionConfig:
    """What was converted and how; saved beside the weights so load() can rebuild it."""

    method: str
    options: dict
    targets: list[str] = field(default_factory=list)

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
    options: dict
    modules: list[ReplacedModule]

    @property
    def params_added(self) -> int:
        return sum(m.params_added for m in self.modules)

    def to_dict(self) -> dict:
        return {"method": self.method, "options": self.options, "params_added": self.params_added,
                "modules": [asdict(m) for m in self.modules]}

    def __str__(self) -> str:
        lines = [f"{self.method}: replaced {len(self.modules)} attention modules, +{self.params_added:,} parameters"]
        lines += [f"  {m.name}: {m.original_class} ({m.num_heads} heads x {m.head_dim}, D={m.feature_dim}, "
                  f"+{m.params_added:,})" for m in self.modules]
        return "\n".join(lines)


def is_converted(model: nn.Module) -> bool:
    return any(isinstance(m, LinearizedAttention) for m in model.modules())


def resolve_options(method: str, options: dict) -> dict:
    """The method's defaults updated with ``options``; unknown keys are an error."""
    spec = get_method(method)
    unknown = set(options) - set(spec.defaults) - set(ATTENTION_OPTIONS)
    if unknown:
        valid = sorted(set(spec.defaults) | set(ATTENTION_OPTIONS))
        close = sorted({c for name in unknown for c in difflib.get_close_matches(name, valid, n=2)})
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ConversionError(f"unknown option(s) {sorted(unknown)} for method {method!r}.{hint} Valid: {valid}")
    return {**spec.defaults, **options}


def convert(
    model: nn.Module,
    method: str = "luna",
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    **options,
) -> ConversionReport:
    """Convert ``model`` in place; returns what was replaced.

    ``filter_fn(module, name)`` restricts the targets (default: every supported
    self-attention). ``options`` override the method's defaults
    (see ``luna_convert.METHODS[method].defaults``).
    """
    if is_converted(model):
        raise ConversionError("this model is already converted to linear attention; convert the original checkpoint instead")
    spec = get_method(method)
    resolved = resolve_options(method, options)
    attn_opts = {k: resolved[k] for k in ATTENTION_OPTIONS if k in resolved}
    map_opts = {k: v for k, v in resolved.items() if k not in ATTENTION_OPTIONS}
    grid = patch_grid(model)
    check_supported(model)

    targets = [(name, module, adapter) for name, module in model.named_modules()
               if (adapter := find_adapter(module)) is not None and (filter_fn is None or filter_fn(module, name))]
    if not targets:
        found = attention_like_classes(model)
        raise ConversionError(
            f"no supported softmax self-attention in {type(model).__name__} (attention classes found: "
            f"{', '.join(found) or 'none'}); supported: bidirectional softmax self-attention with absolute "
            "positions in transformers BERT-family (DistilBERT, ALBERT too), ViT/DeiT/DINOv2 and CLIP/SigLIP vision "
            "models and timm VisionTransformer (causal/decoder, cross-attention, rotary and relative-position "
            "attention are not; see docs/architectures.md)"
        )

    # Build every replacement before touching the model, so that bad option values
    # (e.g. an odd channel count for the fourier bank) leave the model unconverted.
    built = []
    for name, module, adapter in targets:
        num_heads, head_dim, scale = adapter.heads(module)
        ref = next(module.parameters())
        try:
            linear_attn = LinearAttention(spec.feature_map, head_dim, num_heads, scale, spatial=grid is not None,
                                          **attn_opts, **map_opts).to(device=ref.device, dtype=ref.dtype)
        except (ValueError, TypeError, RuntimeError) as e:  # RuntimeError: torch refusing e.g. a negative size
            raise ConversionError(f"invalid options for method {method!r} ({e}); see luna_convert.METHODS"
                                  f"[{method!r}].defaults") from None
        built.append((name, module, adapter, linear_attn, num_heads, head_dim))

    replaced = []
    for name, module, adapter, linear_attn, num_heads, head_dim in built:
        original_class = type(module).__name__
        linearize(module, adapter, linear_attn, patch_grid=grid)
        replaced.append(ReplacedModule(name, original_class, adapter.name, num_heads, head_dim,
                                       linear_attn.feature_dim, sum(p.numel() for p in linear_attn.parameters())))

    setattr(model, CONFIG_ATTR, ConversionConfig(method, resolved, [r.name for r in replaced]))
    return ConversionReport(method, resolved, replaced)


def linear_attention_modules(model: nn.Module) -> list[LinearAttention]:
    return [m for m in model.modules() if isinstance(m, LinearAttention)]


def feature_map_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The feature maps' parameters: what attention distillation trains (DWC gets no gradient there)."""
    return [p for m in linear_attention_modules(model) for fm in (m.phi_q, m.phi_k) if fm is not None
            for p in fm.parameters()]
