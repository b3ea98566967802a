"""Architecture adapters: find softmax self-attention modules and linearise them in place.

A supported attention module keeps its class's identity: it is re-classed to a subclass of its own class
(``Linear<Original>``) whose ``forward`` reads the original Q/K/V (and output) projections and calls the
``linear_attn`` submodule added next to them. Weights are the very same tensors; state-dict keys of the
original parameters do not change; ``isinstance`` checks in the host library still hold.

One file per architecture family, each registering its adapter (chosen by class name and attributes, never
by module path) or its refusal with the reason (see docs/architectures.md). Adding an architecture = one
new file here, imported below. Registration order is matching order.
"""

from __future__ import annotations

from . import bert, distilbert, vit, timm_vit, albert, clip, modernbert  # noqa: F401  (converting families)
from . import mpnet, deberta, beit, swin  # noqa: F401  (refused families)
from .base import LinearizedAttention, key_padding_mask, sliding_window_key_padding_mask
from .grid import PatchGrid, patch_grid, vision_grid
from .hf_config import (BASE_TYPE_KEY, MODEL_TYPE, RECORD_KEY, LinearizedConfig, is_transformers_config,
                        linearized_config_class, mark_converted)
from .registry import (ADAPTERS, REFUSALS, Adapter, Refusal, attention_like_classes, check_no_position_biases,
                       check_supported, find_adapter, linearize, linearized_class,
                       unknown_members)

__all__ = [
    "ADAPTERS", "BASE_TYPE_KEY", "MODEL_TYPE", "RECORD_KEY", "REFUSALS", "Adapter", "LinearizedAttention",
    "LinearizedConfig", "PatchGrid", "Refusal", "attention_like_classes", "check_no_position_biases",
    "check_supported", "find_adapter", "is_transformers_config", "key_padding_mask", "linearize", "linearized_class",
    "linearized_config_class", "mark_converted", "patch_grid", "sliding_window_key_padding_mask", "unknown_members",
    "vision_grid",
]
