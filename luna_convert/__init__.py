"""luna-convert: post-hoc conversion of finetuned softmax Transformers to linear attention.

    import luna_convert
    report = luna_convert.convert(model, method="luna")   # in place, weights kept
    luna_convert.save(model, "outputs/my-model", tokenizer=tok)
    model = luna_convert.load("outputs/my-model")

Names are imported on first use so that the command line starts fast.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "convert": "conversion", "is_converted": "conversion", "ConversionConfig": "conversion",
    "ConversionReport": "conversion",
    "methods": "linear_methods", "METHODS": "linear_methods", "FEATURE_MAPS": "linear_methods",
    "save": "serialization", "load": "serialization", "export_model": "export", "create_timm_model": "model_building",
    "LunaConvertError": "errors", "ConversionError": "errors", "UnknownNameError": "errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
