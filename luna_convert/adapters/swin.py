"""transformers Swin (v1/v2, Donut-Swin): refused. Decision: Swin attends inside local windows, adds a learned
relative-position bias (relative_position_bias_table) within each window and masks shifted windows with
-100 scores. Linear attention inside each window saves nothing (windows are small), and replacing the windows
by global linear attention, without the bias and masks, is a different model, not a post-hoc conversion."""

from __future__ import annotations

from .registry import Refusal, register_refusal


def _reason(module) -> str | None:
    name = type(module).__name__
    if not name.startswith(("Swin", "Swinv2", "DonutSwin", "MaskFormerSwin")) or "Attention" not in name:
        return None
    return ("window attention with a relative-position bias (relative_position_bias_table) and shifted-window "
            "masks; linear attention inside small windows saves nothing, and global linear attention without "
            "the bias and masks would be a different model")


register_refusal(Refusal("Swin", _reason))
