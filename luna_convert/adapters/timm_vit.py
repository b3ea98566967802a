"""timm ``Attention`` (VisionTransformer and its register / class-token-free variants): fused qkv,
q_norm/k_norm, optional gate and scale-norm."""

from __future__ import annotations

import sys

from torch import nn

from ..errors import ConversionError
from .base import LinearizedAttention, has_linears
from .registry import Adapter, register


class TimmFusedQKV(LinearizedAttention):
    """timm ``Attention``'s computation with linear attention in place of softmax."""

    def forward(self, x, attn_mask=None, is_causal: bool = False, **kwargs):
        if is_causal:
            raise ConversionError("causal attention is not supported by bidirectional linear attention")
        b, n, _ = x.shape
        gate = self.gate(x).sigmoid() if getattr(self, "gate", None) is not None else None
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        out, _ = self._attend(q, k, v, attn_mask)
        out = self.norm(out)
        if gate is not None:
            out = out * gate
        return self.proj_drop(self.proj(out))


def is_plain_timm_attention(module: nn.Module) -> bool:
    """Exactly timm's ``Attention`` computation (subclasses that keep its forward included).

    Other timm attention classes with the same attributes add rotary embeddings (EVA,
    ``AttentionRope``) or relative-position biases (SAM, relpos ViT) inside forward.
    """
    attention_module = sys.modules.get("timm.layers.attention")
    timm_attention = getattr(attention_module, "Attention", None)
    return (timm_attention is not None and isinstance(module, timm_attention)
            and type(module).forward is timm_attention.forward)


register(Adapter(
    "timm",
    TimmFusedQKV,
    lambda m: is_plain_timm_attention(m) and has_linears(m, "qkv", "proj"),
    lambda m: (m.num_heads, m.head_dim, m.scale),
    frozenset({"qkv", "q_norm", "k_norm", "norm", "proj", "gate"}),
))
