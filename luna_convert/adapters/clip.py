"""transformers CLIP and SigLIP vision towers: ``CLIPAttention`` / ``SiglipAttention`` (q_proj/k_proj/v_proj/
out_proj, softmax scale ``scale`` = head_dim^-0.5). The vision towers attend bidirectionally without a
padding mask (CLIP: class token + patches; SigLIP: patches only). Text towers are left alone: CLIP's text
attention is causal. SigLIP's attention-pooling head (one probe query, ``nn.MultiheadAttention``) stays softmax:
it costs O(N) already."""

from __future__ import annotations

from ..errors import ConversionError
from .base import has_linears, plain_hf_forward
from .registry import Adapter, register
from .vit import HFProjQKVO


class HFVisionTowerAttention(HFProjQKVO):
    output_projection = "out_proj"

    def forward(self, hidden_states, *args, **kwargs):
        call = self._call_arguments(args, kwargs)
        if call.get("causal_attention_mask") is not None:  # v4 CLIP: only the text tower passes one
            raise ConversionError("linear attention is bidirectional; CLIP's causal (text) attention cannot be "
                                  "converted")
        call.pop("causal_attention_mask", None)
        return super().forward(hidden_states, **call)


def _is_vision_tower_attention(module) -> bool:
    name, config = type(module).__name__, type(getattr(module, "config", None)).__name__
    return (name in ("CLIPAttention", "SiglipAttention") and config.endswith("VisionConfig")
            and has_linears(module, "q_proj", "k_proj", "v_proj", "out_proj")
            and not getattr(module, "is_causal", False)
            and plain_hf_forward(module, also=frozenset({"causal_attention_mask"})))


register(Adapter(
    "hf-vision-tower",
    HFVisionTowerAttention,
    _is_vision_tower_attention,
    lambda m: (m.num_heads, m.head_dim, m.scale),
    frozenset({"q_proj", "k_proj", "v_proj", "out_proj"}),
))
