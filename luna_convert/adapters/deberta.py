"""transformers DeBERTa and DeBERTa-v2/v3: refused. Disentangled attention adds content-to-position and
position-to-content scores (from relative position embeddings) to the N x N content scores; linear attention
never forms those scores, and dropping the position terms would remove the model's only position signal."""

from __future__ import annotations

from .registry import Refusal, register_refusal


def _reason(module) -> str | None:
    name = type(module).__name__
    if name != "DisentangledSelfAttention" and not (name.startswith("Deberta") and name.endswith("Attention")):
        return None
    return ("disentangled attention adds content-to-position and position-to-content scores to the N x N "
            "attention scores, which linear attention never forms; without them the model has no position "
            "information")


register_refusal(Refusal("DeBERTa / DeBERTa-v2/v3", _reason))
