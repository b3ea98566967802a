"""transformers BERT-family ``*SelfAttention`` with separate query/key/value (BERT, RoBERTa, XLM-RoBERTa,
CamemBERT, ELECTRA, ...; v4 eager and SDPA; ViT up to 5.7 and v4 ``ViTSelfAttention``).
The output projection lives in the parent module and is left as it is."""

from __future__ import annotations

from .base import (LinearizedAttention, check_self_attention, config_position_embedding_type, has_linears,
                   is_self_attention, plain_hf_forward, split_heads)
from .registry import Adapter, Refusal, register, register_refusal


class HFSeparateQKV(LinearizedAttention):
    """Returns (context, attention weights or None) like the original on both v4 and v5."""

    def forward(self, hidden_states, *args, **kwargs):
        call = self._call_arguments(args, kwargs)
        check_self_attention(call)
        d = self.attention_head_size
        q, k, v = (split_heads(proj(hidden_states), d) for proj in (self.query, self.key, self.value))
        return self._attend(q, k, v, call.get("attention_mask"), call.get("head_mask"),
                            bool(call.get("output_attentions")))


def _bert_style(module) -> bool:
    return (type(module).__name__.endswith("SelfAttention") and has_linears(module, "query", "key", "value")
            and hasattr(module, "attention_head_size"))


def _relative_positions(module) -> str | None:
    kind = config_position_embedding_type(module) if _bert_style(module) else "absolute"
    if kind == "absolute":
        return None
    return (f"position_embedding_type={kind!r} adds learned relative-position scores to the N x N attention "
            "scores, which linear attention never forms (transformers 5 no longer implements them either); "
            "only absolute position embeddings can be converted")


register_refusal(Refusal("BERT family with relative position embeddings", _relative_positions))

register(Adapter(
    "hf-separate",
    HFSeparateQKV,
    lambda m: _bert_style(m) and is_self_attention(m) and plain_hf_forward(m),
    lambda m: (m.num_attention_heads, m.attention_head_size, m.attention_head_size**-0.5),
    frozenset({"query", "key", "value"}),
))
