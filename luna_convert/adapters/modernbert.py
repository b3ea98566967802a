"""transformers ModernBERT: refused for now. Its attention (fused ``Wqkv``) applies rotary position embeddings
to q and k, which linear attention could take before the feature map, but two thirds of its layers are
sliding-window (local) attention whose banded mask linear attention cannot apply, and transformers v4 runs an
unpadded (packed, ``cu_seqlens``) path under flash attention. Converting it faithfully (global layers, local
layers only on request, the packed path switched off) is left for a later change."""

from __future__ import annotations

from .registry import Refusal, register_refusal


def _reason(module) -> str | None:
    if not type(module).__name__.startswith("ModernBert") or not type(module).__name__.endswith("Attention"):
        return None
    return ("rotary q/k, alternating global and sliding-window (banded mask) layers and a packed unpadded input "
            "path; no adapter converts it yet")


register_refusal(Refusal("ModernBERT", _reason))
