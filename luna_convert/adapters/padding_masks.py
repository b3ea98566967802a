"""transformers' attention masks reduced to what converted layers read: the [B, N] key padding.

transformers (v5) builds, for each implementation it knows (sdpa, eager), a [B, 1, N, N] mask from the
user's [B, N] padding mask before the first layer; converted layers only read the padding back out of it
(``base.key_padding_mask``). An exported graph then still holds an N x N tensor and the reductions that read
it, quadratic in memory although no attention score is. ``padding_masks_only(model)`` switches a model whose
every attention module is converted to an attention implementation registered here whose "mask" is the
padding itself (and whose attention, should any module call it, expands that mask and runs SDPA).

A model with a softmax layer left in it keeps transformers' own masks: that layer computes N x N scores in
any case, and some (ModernBERT's local layers) need the window inside the mask.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from ..errors import ConversionError
from .base import LinearizedAttention
from .registry import find_adapter

IMPLEMENTATION = "luna_convert_padding"
_SWITCHED_FROM = ("sdpa", "eager")


def _padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                  mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """transformers' mask-interface signature: the [B, N] padding (True = real key) or None."""
    return None if attention_mask is None else attention_mask[:, -kv_length:].bool()


def _attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-interface signature: SDPA with the [B, N] padding broadcast over the rows."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None and attention_mask.dim() == 2:
        attention_mask = attention_mask[:, None, None, :]
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _registered() -> bool:
    """Register the implementation with transformers once; False where transformers has no mask interface
    (v4 builds its masks elsewhere)."""
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface
    except ImportError:
        return False
    if IMPLEMENTATION not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(IMPLEMENTATION, _padding_mask)
        AttentionInterface.register(IMPLEMENTATION, _attention)
    return True


def all_attention_converted(model: nn.Module) -> bool:
    """Whether the model holds converted attention and no softmax self-attention module an adapter knows."""
    modules = list(model.modules())
    try:
        softmax_left = any(find_adapter(m) is not None for m in modules)
    except ConversionError:  # attention no adapter converts: it keeps its own masks
        return False
    return any(isinstance(m, LinearizedAttention) for m in modules) and not softmax_left


@contextlib.contextmanager
def padding_masks_only(model: nn.Module) -> Iterator[bool]:
    """Within, a fully converted transformers model gets [B, N] padding masks instead of [B, 1, N, N] ones
    (yields True); any other model runs as it is (yields False)."""
    config = getattr(model, "config", None)
    previous = getattr(config, "_attn_implementation", None)
    if previous not in _SWITCHED_FROM or not all_attention_converted(model) or not _registered():
        yield False
        return
    config._attn_implementation = IMPLEMENTATION
    try:
        yield True
    finally:
        config._attn_implementation = previous
