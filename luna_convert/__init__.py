"""luna-convert: post-hoc conversion of finetuned softmax Transformers to linear attention.

    import luna_convert
    report = luna_convert.convert(model, method="luna")   # in place, weights kept
    luna_convert.save(model, "outputs/my-model", tokenizer=tok)
    model = luna_convert.load("outputs/my-model")
"""

from .convert import ConversionConfig, ConversionReport, convert, is_converted
from .errors import ConversionError, LunaConvertError
from .feature_maps import FEATURE_MAPS
from .methods import METHODS, methods
from .models import create_timm_model
from .serialization import load, save

__version__ = "0.1.0"

__all__ = [
    "convert", "is_converted", "ConversionConfig", "ConversionReport", "methods", "METHODS", "FEATURE_MAPS",
    "save", "load", "create_timm_model", "LunaConvertError", "ConversionError",
]
