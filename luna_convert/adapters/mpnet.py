"""transformers MPNet: refused. Every layer adds a learned relative-position bias (``position_bias``, from
``relative_attention_bias``) to the N x N scores; linear attention never forms those scores, so the bias
cannot be kept, and dropping it would change what the finetuned model computes."""

from __future__ import annotations

from .registry import Refusal, register_refusal


def _reason(module) -> str | None:
    if not type(module).__name__.startswith("MPNet") or "Attention" not in type(module).__name__:
        return None
    return ("its attention adds a learned relative-position bias to the N x N scores (relative_attention_bias), "
            "which linear attention never forms; dropping the bias would change the finetuned model")


register_refusal(Refusal("MPNet", _reason))
