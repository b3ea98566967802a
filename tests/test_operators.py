"""The native products as registered PyTorch operators (``ops.products``): their registration (schema,
fake implementation, autograd) checked by ``torch.library.opcheck``, their gradients against float64
torch.bmm, and the operators called inside compiled graphs and shown by torch.export."""

from __future__ import annotations

import pytest
import torch

import luna_convert
from conftest import example_inputs, make_bert
from luna_convert.layers.attention import LinearAttention
from luna_convert.ops import native, products

pytestmark = pytest.mark.skipif(products.native_library() is None, reason="needs an x86 CPU and a C compiler")


def _operands(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 37, 5, generator=g)
    y = torch.randn(2, 3, 37, 4, generator=g)
    w = torch.randn(2, 3, 5, 4, generator=g)
    bias = torch.randn(1, 3, 1, 4, generator=g).expand(2, 3, 1, 4)  # an operand expanded over the batch
    return x, y, w, bias


@pytest.mark.parametrize("with_sum", [False, True])
def test_transposed_product_operator_registration(with_sum):
    x, y, _, _ = _operands()
    torch.library.opcheck(products.transposed_product_op, (x.requires_grad_(), y.requires_grad_(), with_sum))


@pytest.mark.parametrize("with_bias", [False, True])
def test_product_operator_registration(with_bias):
    x, _, w, bias = _operands()
    torch.library.opcheck(products.product_op, (x.requires_grad_(), w.requires_grad_(),
                                                bias.contiguous().requires_grad_() if with_bias else None))


def test_operator_values_and_gradients_match_float64_bmm():
    x, y, w, bias = (t.contiguous() for t in _operands(1))
    grads = {}
    for name, dtype, tp, p in (("op", torch.float32, products.transposed_product_op, products.product_op),
                               ("ref", torch.float64, products.transposed_product_reference,
                                products.product_reference)):
        leaves = [t.to(dtype).requires_grad_() for t in (x, y, w, bias)]
        xx, yy, ww, bb = leaves
        out = tp(xx, yy, True)
        out2 = p(xx, ww, bb)
        loss = (out * torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)).sum() + (out2 ** 2).sum()
        grads[name] = (out.detach(), out2.detach(), *torch.autograd.grad(loss, leaves))
    for got, want in zip(grads["op"], grads["ref"]):
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


def _counting(monkeypatch):
    calls = []
    for name in ("_native_transposed_product", "_native_product"):
        real = getattr(products, name)
        monkeypatch.setattr(products, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    return calls


@pytest.mark.parametrize("method", ["luna", "hedgehog", "t2r"])
def test_compiled_layer_calls_the_native_operators(method, monkeypatch):
    calls = _counting(monkeypatch)
    layer = LinearAttention(method, 16, 2, 0.25)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 40, 16, generator=g) for _ in range(3))
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 30:] = False
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        expected = layer(q, k, v, mask)
        del calls[:]
        got = compiled(q, k, v, mask)
    assert calls, "the compiled graph ran no native product"
    assert torch.allclose(got, expected, atol=1e-5)
    # training: the core's forward and hand-written backward call them too
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    del calls[:]
    compiled(*leaves, mask).square().sum().backward()
    assert "_native_product" in calls and "_native_transposed_product" in calls
    reference = [t.clone().requires_grad_() for t in (q, k, v)]
    with native.reference_kernels():
        layer(*reference, mask).square().sum().backward()
    for a, b in zip(leaves, reference):
        assert torch.allclose(a.grad, b.grad, atol=1e-4)


def _operators_in(program) -> set[str]:
    """The luna_convert operators the exported program calls (in its graph or its submodules')."""
    return {str(node.target) for module in program.graph_module.modules() if hasattr(module, "graph")
            for node in module.graph.nodes if str(node.target).startswith("luna_convert.")}


def test_torch_export_shows_the_operators_and_runs():
    model = make_bert(layers=1)
    luna_convert.convert(model, method="t2r")
    inputs = example_inputs("hf-bert")
    with torch.no_grad():
        program = torch.export.export(model, (), dict(inputs), strict=False)
        assert _operators_in(program) == {"luna_convert.transposed_product.default", "luna_convert.product.default"}
        assert torch.allclose(program.module()(**inputs).logits, model(**inputs).logits, atol=1e-5)
        with native.reference_kernels():  # what export_model traces: no native operator in the graph
            plain = torch.export.export(model, (), dict(inputs), strict=False)
    assert _operators_in(plain) == set()


def _dwc_operands(divided: bool, masked: bool):
    from luna_convert.ops import dwc

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 11, 8, generator=g)
    weight, bias = torch.randn(8, 1, 3, generator=g), torch.randn(8, generator=g)
    addend = torch.randn(2, 3, 11, 8 + divided, generator=g)
    if divided:
        addend[..., -1] = addend[..., -1].abs() + 1
    keep = (torch.arange(11) < torch.tensor([[11], [7]])).to(torch.uint8) if masked else None
    return dwc, (x, weight, bias, addend, keep, [0, 1, 11, 1, 3], divided, 1e-6, False)


@pytest.mark.parametrize("masked", [False, True])
def test_dwc_operator_registration_and_reference(masked):
    dwc, args = _dwc_operands(False, masked)
    x, weight, bias, addend, keep = args[:5]
    torch.library.opcheck(dwc.dwc_tokens_plus_op, (x.requires_grad_(), weight.requires_grad_(),
                                                   bias.requires_grad_(), addend.requires_grad_(), *args[4:]))
    got = dwc.dwc_tokens_plus_op(*args)
    leaves = [t.detach().double().requires_grad_() for t in (x, weight, bias, addend)]
    want = dwc.depthwise_conv_tokens_plus(*leaves, None if keep is None else keep.bool())
    assert torch.allclose(got.double(), want, atol=1e-5)
    grads = torch.autograd.grad((got * want.detach().float()).sum(), (x, weight, bias, addend))
    want_grads = torch.autograd.grad((want * want.detach()).sum(), leaves)
    for a, b in zip(grads, want_grads):
        assert torch.allclose(a.double(), b, atol=1e-4)


def test_compiled_luna_layer_calls_the_native_dwc(monkeypatch):
    from luna_convert.ops import dwc

    calls = []
    real = dwc._native_pass
    monkeypatch.setattr(dwc, "_native_pass", lambda *a: calls.append(1) or real(*a))
    layer = LinearAttention("luna", 16, 2, 0.25, dwc=True)
    torch.nn.init.normal_(layer.dwc.conv.weight)
    q, k, v = (torch.randn(2, 2, 24, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        expected = layer(q, k, v)
        del calls[:]
        assert torch.allclose(compiled(q, k, v), expected, atol=1e-5)
    assert calls


def test_fake_outputs_promise_the_real_layouts():
    """Inductor checks a custom operator's outputs against its fake implementation's sizes and strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from luna_convert.ops import dwc

    x, y, w, bias = _operands(4)
    _, dwc_args = _dwc_operands(False, True)
    grad = torch.randn(dwc_args[0].shape)
    cases = [(products.transposed_product_op, (x, y, True)), (products.product_op, (x, w, bias.contiguous())),
             (dwc.dwc_tokens_plus_op, dwc_args),
             (dwc.dwc_tokens_backward_op, (grad, dwc_args[0], dwc_args[1], dwc_args[4], dwc_args[5]))]
    for op, args in cases:
        real = op(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        for r, f in zip(real if isinstance(real, tuple) else (real,), fake if isinstance(fake, tuple) else (fake,)):
            assert (r.shape, r.stride()) == (f.shape, f.stride()), op
