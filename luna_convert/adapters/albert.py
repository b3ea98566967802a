"""transformers ALBERT ``AlbertAttention``: query/key/value, and the output projection ``dense``, dropout and
the residual ``LayerNorm`` in the same module. ALBERT shares one layer group across its depth, so the one
shared attention module is converted once and stays shared (``named_modules`` lists it once)."""

from __future__ import annotations

from .base import (LinearizedAttention, check_self_attention, config_position_embedding_type, has_linears,
                   is_self_attention, plain_hf_forward, split_heads)
from .registry import Adapter, Refusal, register, register_refusal


class HFAlbertAttention(LinearizedAttention):
    """v5: ``(hidden_states, attention_mask)`` -> (output, weights or None); v4: ``(hidden_states,
    attention_mask, head_mask, output_attentions)`` -> ``(output,)`` or ``(output, weights)``."""

    def forward(self, hidden_states, *args, **kwargs):
        call = self._call_arguments(args, kwargs)
        check_self_attention(call)
        d = self.attention_head_size
        q, k, v = (split_heads(proj(hidden_states), d) for proj in (self.query, self.key, self.value))
        output_attentions = bool(call.get("output_attentions"))
        context, weights = self._attend(q, k, v, call.get("attention_mask"), call.get("head_mask"), output_attentions)
        out = self.LayerNorm(hidden_states + self.output_dropout(self.dense(context)))
        if "head_mask" in self._original_forward_params:  # v4 tuple convention
            return (out, weights) if output_attentions else (out,)
        return out, weights


def _is_albert(module) -> bool:
    return type(module).__name__.startswith("Albert") and type(module).__name__.endswith("Attention")


def _relative_positions(module) -> str | None:
    kind = config_position_embedding_type(module) if _is_albert(module) else "absolute"
    if kind == "absolute":
        return None
    return (f"position_embedding_type={kind!r} adds learned relative-position scores to the N x N attention "
            "scores, which linear attention never forms; only absolute position embeddings can be converted")


register_refusal(Refusal("ALBERT with relative position embeddings", _relative_positions))

register(Adapter(
    "hf-albert",
    HFAlbertAttention,
    lambda m: _is_albert(m)
    and has_linears(m, "query", "key", "value", "dense")
    and hasattr(m, "attention_head_size")
    and is_self_attention(m)
    and plain_hf_forward(m),
    lambda m: (m.num_attention_heads, m.attention_head_size, m.attention_head_size**-0.5),
    frozenset({"query", "key", "value", "dense", "LayerNorm"}),
))
