"""What building a model needs below the run layer: the ``LoadedModel`` bundle (a model with its
preprocessing) and timm models that remember their constructor arguments, so that ``save`` can rebuild them
(serialization and the built-in teachers use these; loading from any source is ``run.models``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .errors import LunaConvertError
from .layers.attention import LinearAttention

TIMM_ARGS_ATTR = "timm_create_args"


@dataclass
class LoadedModel:
    model: nn.Module
    kind: str  # "text" | "image"
    tokenizer: object | None = None
    image_processor: object | None = None  # saved beside the model, transformers only
    image_config: dict = field(default_factory=dict)  # mean, std, size for image models
    source: str = ""
    note: str = ""  # what loading chose that the run should say (e.g. an embedding model's pooling)

    @property
    def num_labels(self) -> int:
        config = getattr(self.model, "config", None)
        if config is not None and hasattr(config, "num_labels"):
            return config.num_labels
        return self.model.num_classes

    @property
    def id2label(self) -> dict[int, str] | None:
        config = getattr(self.model, "config", None)
        return {int(k): v for k, v in config.id2label.items()} if config is not None else None


def create_timm_model(model_name: str, pretrained: bool = False, checkpoint_path: str = "", **kwargs) -> nn.Module:
    """``timm.create_model`` that remembers its arguments so ``luna_convert.save`` can rebuild the model.

    The weights source (``pretrained``/``checkpoint_path``) is not recorded: a
    saved model always reloads from its own safetensors file.
    """
    import timm

    model = timm.create_model(model_name, pretrained=pretrained, checkpoint_path=checkpoint_path, **kwargs)
    setattr(model, TIMM_ARGS_ATTR, {"model_name": model_name, **kwargs})
    return model


def timm_create_args(model: nn.Module) -> dict:
    """``model_name`` and the constructor arguments that rebuild a timm ViT with the same tensors.

    Models made by :func:`create_timm_model` carry them; for a plain ``timm.create_model(...)``
    they are read back from the model (its architecture name from ``pretrained_cfg``) and
    checked by building that architecture on the meta device and comparing every tensor shape.
    """
    recorded = getattr(model, TIMM_ARGS_ATTR, None)
    if recorded is not None:
        return dict(recorded)
    name = (getattr(model, "pretrained_cfg", None) or {}).get("architecture")
    if not name:
        raise LunaConvertError(f"cannot tell which timm architecture {type(model).__name__} is (no "
                               "pretrained_cfg['architecture']); create it with luna_convert.create_timm_model(...)")
    import timm  # heavy: imported when a timm model is built

    def build(**kwargs) -> nn.Module:
        with torch.device("meta"):  # shapes only: no memory, no initialisation cost
            return timm.create_model(name, pretrained=False, **kwargs)

    read = _vit_constructor_args(model)
    if read is None:
        raise LunaConvertError(f"cannot read the constructor arguments of timm {name} ({type(model).__name__}, not a "
                               "VisionTransformer); create it with luna_convert.create_timm_model(...) so they are recorded")
    default = _vit_constructor_args(build())
    args = {k: v for k, v in read.items() if default is None or default.get(k) != v}  # only what the user changed
    added = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, LinearAttention))  # by conversion
    expected = {k: tuple(t.shape) for k, t in model.state_dict().items() if not k.startswith(added)}
    rebuilt = {k: tuple(t.shape) for k, t in build(**args).state_dict().items()}
    if rebuilt != expected:
        diff = sorted(set(expected) ^ set(rebuilt)) or [k for k in expected if expected[k] != rebuilt[k]]
        raise LunaConvertError(f"cannot rebuild this timm {name} from its attributes ({diff[0]} differs); create it "
                               "with luna_convert.create_timm_model(...) so its arguments are recorded")
    return {"model_name": name, **args}


def _vit_constructor_args(model: nn.Module) -> dict | None:
    """The shape-changing ``VisionTransformer`` arguments as the model's modules show them, or None."""
    from timm.models.vision_transformer import VisionTransformer

    if not isinstance(model, VisionTransformer) or not len(model.blocks):
        return None
    patch_embed, block = model.patch_embed, model.blocks[0]
    attn, mlp = block.attn, block.mlp
    has = lambda module: not isinstance(module, nn.Identity)  # noqa: E731
    fc1 = getattr(mlp, "fc1", None)
    return {
        "img_size": list(patch_embed.img_size) if patch_embed.img_size is not None else None,
        "patch_size": list(patch_embed.patch_size), "in_chans": model.in_chans, "num_classes": model.num_classes,
        "global_pool": model.global_pool, "embed_dim": model.embed_dim, "depth": len(model.blocks),
        "num_heads": attn.num_heads,
        "mlp_ratio": fc1.out_features / model.embed_dim if isinstance(fc1, nn.Linear) else None,
        "qkv_bias": attn.qkv.bias is not None, "qk_norm": has(attn.q_norm), "scale_attn_norm": has(attn.norm),
        "proj_bias": attn.proj.bias is not None,
        # a LayerScale's value is a saved tensor: any value recreates the parameter
        "init_values": 1e-5 if has(block.ls1) else None,
        "class_token": model.has_class_token, "pos_embed": "learn" if model.pos_embed is not None else "none",
        "no_embed_class": model.no_embed_class, "reg_tokens": model.num_reg_tokens, "pre_norm": has(model.norm_pre),
        "final_norm": has(model.norm) or has(model.fc_norm), "fc_norm": has(model.fc_norm), "dynamic_img_size": model.dynamic_img_size,
        "dynamic_img_pad": getattr(patch_embed, "dynamic_img_pad", False),
        "pool_include_prefix": getattr(model, "pool_include_prefix", False),
    }
