"""transformers DistilBERT attention (q_lin/k_lin/v_lin/out_lin), v5 and v4."""

from __future__ import annotations

from ..errors import ConversionError
from .base import LinearizedAttention, has_linears, is_self_attention, plain_hf_forward, split_heads
from .registry import Adapter, register


class HFLinQKVO(LinearizedAttention):
    """transformers DistilBERT attention (q_lin/k_lin/v_lin/out_lin). v5 ``DistilBertSelfAttention``:
    ``(hidden_states, attention_mask)`` -> (output, weights or None); v4 ``MultiHeadSelfAttention``
    and its SDPA/flash subclasses: ``(query, key, value, mask, head_mask, output_attentions)`` ->
    ``(output,)`` or ``(output, weights)``."""

    def forward(self, *args, **kwargs):
        v4 = "mask" in self._original_forward_params
        first = "query" if v4 else "hidden_states"
        call = {**dict(zip((first, *self._original_forward_params), args)), **kwargs}
        hidden_states = call[first]
        if v4 and any(call.get(name, hidden_states) is not hidden_states for name in ("key", "value")):
            raise ConversionError("linear attention replaces self-attention only; different key/value inputs were given")
        d = self.attention_head_size
        q, k, v = (split_heads(proj(hidden_states), d) for proj in (self.q_lin, self.k_lin, self.v_lin))
        output_attentions = bool(call.get("output_attentions"))
        out, weights = self._attend(q, k, v, call.get("mask" if v4 else "attention_mask"), call.get("head_mask"),
                                    output_attentions)
        out = self.out_lin(out)
        if v4:
            return (out, weights) if output_attentions else (out,)
        return out, weights


register(Adapter(
    "hf-lin",
    HFLinQKVO,
    lambda m: has_linears(m, "q_lin", "k_lin", "v_lin", "out_lin")
    and hasattr(m, "n_heads")
    and hasattr(m, "attention_head_size")
    and is_self_attention(m)
    and plain_hf_forward(m, also=frozenset({"key", "value", "mask"})),
    lambda m: (m.n_heads, m.attention_head_size, m.attention_head_size**-0.5),
    frozenset({"q_lin", "k_lin", "v_lin", "out_lin"}),
))
