"""Building models whose construction must be recorded to rebuild them later."""

from __future__ import annotations

from torch import nn

TIMM_ARGS_ATTR = "timm_create_args"


def create_timm_model(model_name: str, pretrained: bool = False, checkpoint_path: str = "", **kwargs) -> nn.Module:
    """``timm.create_model`` that remembers its arguments so ``luna_convert.save`` can rebuild the model.

    The weights source (``pretrained``/``checkpoint_path``) is not recorded: a
    saved model always reloads from its own safetensors file.
    """
    import timm

    model = timm.create_model(model_name, pretrained=pretrained, checkpoint_path=checkpoint_path, **kwargs)
    setattr(model, TIMM_ARGS_ATTR, {"model_name": model_name, **kwargs})
    return model
