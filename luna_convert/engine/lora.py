"""The parameter-efficient second stage: LoRA adapters (through peft) on the pretrained linear layers,
every pretrained weight frozen except the task head, and what conversion added (feature maps,
kernels, DWC) trained in full. After training the adapters are merged into the weights they adapt,
so the saved model is the plain converted architecture (``save``/``load`` unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..conversion import linear_attention_modules
from ..errors import LunaConvertError, check_peft_available


@dataclass
class LoraSummary:
    rank: int
    alpha: float
    adapted_layers: int
    trainable_params: int
    total_params: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def head_module_names(model: nn.Module) -> list[str]:
    """The task head: for a transformers model, the top-level children outside its base model
    (BERT: dropout, classifier); for timm, its classifier module."""
    prefix = getattr(model, "base_model_prefix", None)
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return [name for name, _ in model.named_children() if name != prefix]
    if hasattr(model, "get_classifier"):
        head = model.get_classifier()
        names = [name for name, module in model.named_modules() if module is head and name]
        if names:
            return names[:1]
    raise LunaConvertError(f"cannot tell the task head of {type(model).__name__} apart from its encoder, so LoRA "
                           "cannot choose what to adapt; train it without lora.rank")


def add_lora(model: nn.Module, rank: int, alpha: float | None = None, dropout: float = 0.0) -> LoraSummary:
    """Put rank-``rank`` LoRA adapters (scale ``alpha / rank``; alpha None: 2 x rank) on every
    pretrained ``nn.Linear`` outside the task head and the converted attention's own modules, and
    leave trainable only the adapters, the head and what conversion added."""
    check_peft_available()
    from peft import LoraConfig, inject_adapter_in_model

    heads = head_module_names(model)
    added = {id(m) for layer in linear_attention_modules(model) for m in layer.modules()}

    def in_head(name: str) -> bool:
        return any(name == h or name.startswith(h + ".") for h in heads)

    targets = [name for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and id(module) not in added and not in_head(name)]
    if not targets:
        raise LunaConvertError(f"{type(model).__name__} has no linear layers outside its head for LoRA to adapt")
    alpha = 2.0 * rank if alpha is None else float(alpha)
    # peft matches each target by the end of a module's dotted name; full names match one module each.
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                                       bias="none"), model)
    trainable_modules = [module for name, module in model.named_modules() if in_head(name)]
    trainable_modules += linear_attention_modules(model)
    for module in trainable_modules:
        for p in module.parameters():
            p.requires_grad_(True)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return LoraSummary(rank, alpha, len(targets), trainable, sum(p.numel() for p in model.parameters()))


def merge_lora(model: nn.Module) -> int:
    """Fold every LoRA adapter into the weight it adapts and put the plain layer back; returns how
    many layers were merged. Every parameter is trainable again afterwards, as in a model never adapted."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapted = [(name, module) for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)]
    for name, module in adapted:
        module.merge()
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, module.get_base_layer())
    for p in model.parameters():
        p.requires_grad_(True)
    return len(adapted)
