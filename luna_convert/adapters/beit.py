"""transformers BEiT and data2vec-vision: refused. Their released checkpoints add a learned relative-position
bias (per layer or shared) to the N x N scores, which linear attention cannot apply; without a bias their
attention still takes the bias and resolution arguments no adapter reads."""

from __future__ import annotations

from .registry import Refusal, register_refusal


def _reason(module) -> str | None:
    name = type(module).__name__
    if not name.startswith(("Beit", "Data2VecVision")) or "Attention" not in name:
        return None
    config = getattr(module, "config", None)
    if getattr(config, "use_relative_position_bias", False) or getattr(config, "use_shared_relative_position_bias",
                                                                        False):
        return ("it adds a learned relative-position bias (relative_position_bias_table) to the N x N attention "
                "scores, which linear attention never forms")
    return ("its attention takes a relative-position bias and the input resolution as arguments, which no adapter "
            "reads (the bias-free configuration is not supported yet)")


register_refusal(Refusal("BEiT / data2vec-vision", _reason))
