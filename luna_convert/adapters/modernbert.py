"""transformers ModernBERT ``ModernBertAttention`` (v4.57 and v5): fused ``Wqkv``, rotary q/k, ``Wo``.

The converted forward splits ``Wqkv`` as the original does, rotates q and k with the layer's own rotary
cos/sin (v5: handed in by the model per layer type; v4: the module's ``rotary_emb``) through the original
module's ``apply_rotary_pos_emb``, so positions reach linear attention before the feature map, then attends
over the real keys and applies ``Wo`` and its dropout. Global layers are converted. Local layers
(sliding-window attention, two in three by default) keep softmax unless ``convert(...,
convert_local_layers=True)``: linear attention attends to every key, so a converted local layer sees the
whole sequence instead of its window (distillation's teacher is then full softmax too).

Refused: transformers v4 under flash attention, which runs the model on packed, unpadded tokens
(``cu_seqlens``) with a flash-only rotary embedding; packed inputs reaching a converted layer (v4
``cu_seqlens``, v5 ``cu_seq_lens_q``/``cu_seq_lens_k``) raise instead of attending across sequences.
"""

from __future__ import annotations

import sys

from ..errors import ConversionError
from .base import (LinearizedAttention, forward_params, has_linears, is_self_attention, plain_hf_forward,
                   sliding_window_key_padding_mask)
from .registry import Adapter, Refusal, register, register_refusal

# Arguments that carry a packed batch (sequences concatenated without padding).
PACKED_ARGS = ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k")
LOAD_PADDED = "load the model with attn_implementation='sdpa' (or 'eager')"


def _is_v5(attention_class: type) -> bool:
    """v5 hands the layer its rotary cos/sin (``position_embeddings``); v4 modules own ``rotary_emb``."""
    return "position_embeddings" in forward_params(attention_class)


def _is_local(module) -> bool:
    """A sliding-window layer: v5 ``sliding_window`` set, v4 ``local_attention`` other than (-1, -1)."""
    return getattr(module, "sliding_window", None) is not None or getattr(module, "local_attention", (-1, -1)) != (-1, -1)


class HFModernBertAttention(LinearizedAttention):
    """v5: ``(hidden_states, position_embeddings, attention_mask)`` -> (output, weights or None);
    v4: ``(hidden_states, output_attentions, attention_mask=, sliding_window_mask=, position_ids=, ...)``
    -> ``(output,)`` or ``(output, weights)``."""

    def forward(self, hidden_states, *args, **kwargs):
        call = self._call_arguments(args, kwargs)
        if hidden_states.dim() != 3 or any(call.get(name) is not None for name in PACKED_ARGS):
            raise ConversionError("converted ModernBERT attention got packed, unpadded tokens (cu_seqlens, as "
                                  f"transformers v4 runs flash attention); {LOAD_PADDED}")
        b, n, _ = hidden_states.shape
        q, k, v = self.Wqkv(hidden_states).view(b, n, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        v5 = _is_v5(self._original_class)
        cos, sin = call["position_embeddings"] if v5 else self.rotary_emb(v, position_ids=call.get("position_ids"))
        q, k = sys.modules[self._original_class.__module__].apply_rotary_pos_emb(q, k, cos, sin)
        mask = call.get("attention_mask")  # v4 passes every layer the global mask (and local ones the banded)
        if v5 and _is_local(self):  # v5 passes a local layer only its banded mask: its padding is what we need
            mask = sliding_window_key_padding_mask(mask, self.config.local_attention // 2)
        output_attentions = bool(call.get("output_attentions"))
        out, weights = self._attend(q, k, v, mask, output_attentions=output_attentions)
        out = self.out_drop(self.Wo(out))
        if v5:
            return out, weights
        return (out, weights) if output_attentions else (out,)


def _packed_v4(module) -> str | None:
    if type(module).__name__ != "ModernBertAttention" or _is_v5(type(module)):
        return None
    if getattr(getattr(module, "config", None), "_attn_implementation", None) != "flash_attention_2":
        return None
    return ("transformers v4 runs it under flash attention on packed, unpadded tokens (cu_seqlens) with a "
            f"flash-only rotary embedding; {LOAD_PADDED} and convert that")


register_refusal(Refusal("ModernBERT under flash attention", _packed_v4))

register(Adapter(
    "hf-modernbert",
    HFModernBertAttention,
    lambda m: type(m).__name__ == "ModernBertAttention"
    and has_linears(m, "Wqkv", "Wo")
    and hasattr(m, "head_dim")
    and callable(getattr(sys.modules.get(type(m).__module__), "apply_rotary_pos_emb", None))
    and is_self_attention(m)
    and plain_hf_forward(m, also=frozenset({"position_embeddings"})),
    lambda m: (m.config.num_attention_heads, m.head_dim, m.head_dim**-0.5),
    frozenset({"Wqkv", "Wo", "rotary_emb"}),
    local=_is_local,
))
