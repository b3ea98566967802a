"""What a LinearAttention layer computes is set through its own API (``set_mode``, ``attention_mode``),
never by writing its attributes from outside."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from luna_convert.layers.attention import AttentionMode, LinearAttention, attention_mode
from luna_convert.ops.reference import softmax_attention

PACKAGE = Path(__file__).resolve().parents[1] / "luna_convert"


def _inputs():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 5, 8, generator=g) for _ in range(3))
    return q, k, v, torch.tensor([[True] * 5, [True] * 3 + [False] * 2])


def test_a_mode_block_sets_every_layer_gives_their_mean_loss_and_restores_what_they_had():
    torch.manual_seed(0)
    layers = [LinearAttention("hedgehog", 8, 2, 8**-0.5) for _ in range(3)]
    layers[2].set_mode(AttentionMode.SOFTMAX)
    q, k, v, mask = _inputs()
    with attention_mode(layers, AttentionMode.DISTILL_ATTENTION) as modes:
        assert all(layer.mode is AttentionMode.DISTILL_ATTENTION for layer in layers)
        outs = [layer(q, k, v, mask) for layer in layers]
        each = [layer.distill_loss.detach() for layer in layers]
        loss = modes.distillation_loss()
        assert all(layer.distill_loss is None for layer in layers)  # taken: each loss is used once
        with pytest.raises(RuntimeError, match="no distillation loss"):
            modes.distillation_loss()
    torch.testing.assert_close(loss.detach(), torch.stack(each).mean(), rtol=0, atol=0)
    for out in outs:  # distilling layers return the teacher's output
        torch.testing.assert_close(out, softmax_attention(q, k, v, 8**-0.5, mask), rtol=0, atol=1e-6)
    assert [layer.mode for layer in layers] == [AttentionMode.LINEAR, AttentionMode.LINEAR, AttentionMode.SOFTMAX]


def test_a_mode_block_restores_the_modes_when_its_body_raises_and_keeps_no_loss():
    layer = LinearAttention("hedgehog", 8, 2, 8**-0.5)
    q, k, v, mask = _inputs()
    with pytest.raises(ValueError), attention_mode(torch.nn.ModuleList([layer]), AttentionMode.DISTILL_OUTPUT):
        layer(q, k, v, mask)
        assert layer.distill_loss is not None
        raise ValueError
    assert layer.mode is AttentionMode.LINEAR and layer.distill_loss is None
    with pytest.raises(TypeError, match="AttentionMode"):
        layer.set_mode("softmax")


def _layer_attributes() -> set[str]:
    """Every attribute LinearAttention.__init__ assigns on self."""
    tree = ast.parse((PACKAGE / "layers" / "attention.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LinearAttention")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {t.attr for n in ast.walk(init) if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            for t in (t.elts if isinstance(t, ast.Tuple) else [t])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def test_no_module_writes_a_layers_mode_or_loss_from_outside():
    guarded = {name for name in _layer_attributes() if name.startswith("_")} | {"mode", "distill_loss"}
    assert {"_mode", "_distill_loss"} <= guarded
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in (e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])):
                if isinstance(t, ast.Attribute) and t.attr in guarded and not (
                        isinstance(t.value, ast.Name) and t.value.id == "self"):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} writes .{t.attr}")
    assert not found
