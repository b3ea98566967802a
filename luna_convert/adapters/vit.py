"""transformers ViT-style attention owning all four projections q_proj/k_proj/v_proj/o_proj
(ViT since 5.10, DeiT, DINOv2; up to 5.7 they use the BERT-style layout of ``bert.py``)."""

from __future__ import annotations

from .base import LinearizedAttention, check_self_attention, has_linears, plain_hf_forward, split_heads
from .registry import Adapter, register


class HFProjQKVO(LinearizedAttention):
    """Returns (output, weights or None); ``output_projection`` names the output linear."""

    output_projection = "o_proj"

    def forward(self, hidden_states, *args, **kwargs):
        call = self._call_arguments(args, kwargs)
        check_self_attention(call)
        d = self.head_dim
        q, k, v = (split_heads(proj(hidden_states), d) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out, weights = self._attend(q, k, v, call.get("attention_mask"), call.get("head_mask"),
                                    bool(call.get("output_attentions")))
        return getattr(self, self.output_projection)(out), weights


register(Adapter(
    "hf-proj",
    HFProjQKVO,
    lambda m: type(m).__name__.endswith("Attention")
    and has_linears(m, "q_proj", "k_proj", "v_proj", "o_proj")
    and hasattr(m, "num_attention_heads")
    and hasattr(m, "head_dim")
    and not getattr(m, "is_causal", True)
    and plain_hf_forward(m),
    lambda m: (m.num_attention_heads, m.head_dim, m.scaling),
    frozenset({"q_proj", "k_proj", "v_proj", "o_proj"}),
))
