"""Architecture adapters: find softmax self-attention modules and linearise them in place.

A supported attention module keeps its class's identity: it is re-classed to
a subclass of its own class (``Linear<Original>``) whose ``forward`` reads
the original Q/K/V (and output) projections and calls the ``linear_attn``
submodule added next to them. Weights are the very same tensors; state-dict
keys of the original parameters do not change; ``isinstance`` checks in the
host library (e.g. transformers' attention-output hooks) still hold.

Adapters, chosen by class name and attributes (never by module path):
  hf-separate  transformers BERT-family ``*SelfAttention`` and ViT up to 5.7
               (query/key/value; output projection lives in the parent)
  hf-proj      transformers ViT since 5.10 (q_proj/k_proj/v_proj/o_proj)
  timm         timm ``Attention`` (fused qkv, q_norm/k_norm, norm, proj)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .attention import LinearAttention
from .errors import ConversionError


def key_padding_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Normalise any attention mask reaching self-attention to bool [B, N] (True = real key).

    Accepts [B, N] 0/1 or bool masks, and [B, 1, 1|N, N] bool (True = keep)
    or additive float masks (0 = keep, very negative = drop), as built by
    transformers v4 (eager) and v5 (eager/sdpa). An all-real mask becomes None.
    """
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        keep = mask
    elif mask.dim() == 2:
        keep = mask > 0
    else:  # additive
        keep = mask > torch.finfo(mask.dtype).min / 2
    if keep.dim() == 4:
        # Bidirectional masks repeat the key-padding pattern on every query row.
        keep = keep[:, 0].any(dim=1)
    elif keep.dim() == 3:
        keep = keep.any(dim=1)
    return None if bool(keep.all()) else keep


def _square_grid(num_tokens: int, grid: tuple[int, int] | None) -> tuple[tuple[int, int], int]:
    """The patch grid and prefix count for a token sequence: the configured grid
    if it fits, else the largest square grid (a different image size)."""
    if grid is not None and grid[0] * grid[1] <= num_tokens and num_tokens - grid[0] * grid[1] <= 16:
        return grid, num_tokens - grid[0] * grid[1]
    side = math.isqrt(num_tokens)
    return (side, side), num_tokens - side * side


class LinearizedAttention:
    """Marker mixin shared by every converted attention class."""

    linear_attn: LinearAttention
    patch_grid: tuple[int, int] | None = None

    def _attend(self, q, k, v, mask) -> torch.Tensor:
        """q, k, v: [B, H, N, d] -> [B, N, H*d]"""
        b, _, n, _ = q.shape
        key_mask = key_padding_mask(mask)
        if self.linear_attn.dwc is not None and self.linear_attn.dwc.spatial:
            grid, prefix = _square_grid(n, self.patch_grid)
            out = self.linear_attn(q, k, v, key_mask, grid, prefix)
        else:
            out = self.linear_attn(q, k, v, key_mask)
        return out.transpose(1, 2).reshape(b, n, -1)


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    b, n, _ = x.shape
    return x.view(b, n, -1, head_dim).transpose(1, 2)


class HFSeparateQKV(LinearizedAttention):
    """transformers ``BertSelfAttention``-style (query/key/value); returns (context, None)."""

    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        if kwargs.get("encoder_hidden_states") is not None:
            raise ConversionError("linear attention replaces self-attention only; cross-attention inputs were given")
        d = self.attention_head_size
        q, k, v = (_heads(proj(hidden_states), d) for proj in (self.query, self.key, self.value))
        return self._attend(q, k, v, attention_mask), None


class HFProjQKVO(LinearizedAttention):
    """transformers ViT >= 5.10 ``ViTAttention`` (q_proj/k_proj/v_proj/o_proj); returns (output, None)."""

    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        d = self.head_dim
        q, k, v = (_heads(proj(hidden_states), d) for proj in (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(self._attend(q, k, v, attention_mask)), None


class TimmFusedQKV(LinearizedAttention):
    """timm ``Attention``: fused qkv, q_norm/k_norm, optional gate and scale-norm."""

    def forward(self, x, attn_mask=None, is_causal: bool = False, **kwargs):
        if is_causal:
            raise ConversionError("causal attention is not supported by bidirectional linear attention")
        b, n, _ = x.shape
        gate = self.gate(x).sigmoid() if getattr(self, "gate", None) is not None else None
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        out = self.norm(self._attend(q, k, v, attn_mask))
        if gate is not None:
            out = out * gate
        return self.proj_drop(self.proj(out))


@dataclass(frozen=True)
class Adapter:
    name: str
    mixin: type
    matches: Callable[[nn.Module], bool]
    heads: Callable[[nn.Module], tuple[int, int, float]]  # (num_heads, head_dim, softmax scale)


def _has_linears(module: nn.Module, *names: str) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in names)


def _is_self_attention(module: nn.Module) -> bool:
    return not getattr(module, "is_causal", False) and not getattr(module, "is_decoder", False)


ADAPTERS = [
    Adapter(
        "hf-separate",
        HFSeparateQKV,
        lambda m: type(m).__name__.endswith("SelfAttention")
        and _has_linears(m, "query", "key", "value")
        and hasattr(m, "attention_head_size")
        and _is_self_attention(m),
        lambda m: (m.num_attention_heads, m.attention_head_size, m.attention_head_size**-0.5),
    ),
    Adapter(
        "hf-proj",
        HFProjQKVO,
        lambda m: type(m).__name__.endswith("Attention")
        and _has_linears(m, "q_proj", "k_proj", "v_proj", "o_proj")
        and hasattr(m, "num_attention_heads")
        and hasattr(m, "head_dim")
        and not getattr(m, "is_causal", True),
        lambda m: (m.num_attention_heads, m.head_dim, m.scaling),
    ),
    Adapter(
        "timm",
        TimmFusedQKV,
        lambda m: _has_linears(m, "qkv", "proj") and hasattr(m, "num_heads") and hasattr(m, "head_dim")
        and hasattr(m, "q_norm") and hasattr(m, "k_norm"),
        lambda m: (m.num_heads, m.head_dim, m.scale),
    ),
]

_LINEAR_CLASSES: dict[tuple[type, type], type] = {}


def find_adapter(module: nn.Module) -> Adapter | None:
    if isinstance(module, LinearizedAttention):
        return None
    return next((a for a in ADAPTERS if a.matches(module)), None)


def linearized_class(base: type, mixin: type) -> type:
    """``Linear<Base>``: the mixin's forward over the original class (cached)."""
    key = (base, mixin)
    if key not in _LINEAR_CLASSES:
        _LINEAR_CLASSES[key] = type(f"Linear{base.__name__}", (mixin, base), {"__module__": __name__})
    return _LINEAR_CLASSES[key]


def linearize(module: nn.Module, adapter: Adapter, linear_attn: LinearAttention, patch_grid=None) -> None:
    """Re-class ``module`` in place and attach ``linear_attn``; parameters are untouched."""
    module.__class__ = linearized_class(type(module), adapter.mixin)
    module.linear_attn = linear_attn
    module.patch_grid = patch_grid


def vision_grid(model: nn.Module) -> tuple[int, int] | None:
    """The patch grid of a ViT (timm or transformers), or None for a text model."""
    patch_embed = getattr(model, "patch_embed", None)
    if patch_embed is not None and getattr(patch_embed, "grid_size", None) is not None:
        return tuple(patch_embed.grid_size)
    config = getattr(model, "config", None)
    image_size, patch_size = getattr(config, "image_size", None), getattr(config, "patch_size", None)
    if image_size is None or patch_size is None:
        return None
    pair = lambda x: tuple(x) if isinstance(x, (list, tuple)) else (x, x)  # noqa: E731
    (ih, iw), (ph, pw) = pair(image_size), pair(patch_size)
    return ih // ph, iw // pw


def attention_like_classes(model: nn.Module) -> list[str]:
    """Names of classes that look like attention but no adapter supports (for error messages)."""
    return sorted({type(m).__name__ for m in model.modules() if "attention" in type(m).__name__.lower()})
