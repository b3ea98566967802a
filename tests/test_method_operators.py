"""LUNA's channel passes and the sorting kernel's passes as registered PyTorch operators (``luna_native``,
``luna_kernel.knot_grid_op``, ``sorting_native``): their registration checked by ``torch.library.opcheck``,
their values and gradients against float64 references (LUNA's MLP bank, the sorting kernel's explicit
N x N weights), the operators called inside compiled forward and backward graphs, and shown by torch.export."""

from __future__ import annotations

import shutil

import pytest
import torch

import luna_convert
from conftest import example_inputs, make_bert
from luna_convert.layers.attention import LinearAttention
from luna_convert.linear_methods import luna_kernel, luna_native, sorting_native
from luna_convert.linear_methods.luna import FEATURE_NORM_EPS, PAPER_OPTIONS, ScalarChannels
from luna_convert.ops import native

pytestmark = pytest.mark.skipif(luna_native.library() is None or sorting_native.library() is None,
                                reason="needs a C compiler")


def bank(seed: int, channels: int, init: str) -> ScalarChannels:
    torch.manual_seed(seed)
    return ScalarChannels(channels, 16, init=init)


def mlp_features(psi, u, scale, norm_eps):
    """The bank's MLP times scale, each channel divided by its sum over the projections + eps: the reference."""
    feats = psi(u) * scale
    return feats if norm_eps is None else feats / (feats.sum(-2, keepdim=True) + norm_eps)


def test_the_operators_grid_is_the_eager_grid():
    psi = bank(0, 8, "random")
    knots, _ = luna_kernel.piecewise_table(psi)
    rows, (mapping, low, scale, cells, start, kpad) = luna_kernel.operator_grid(knots.float())
    assert (mapping, low, scale, cells) == luna_kernel.knot_locator(psi).grid[:4]
    eager = luna_kernel.knot_locator(psi).grid
    assert torch.equal(start, eager[4]) and torch.equal(kpad, eager[5])
    assert rows.shape == (kpad.isfinite().sum() + 1,)
    assert luna_kernel.operator_grid(knots.float().clone())[1] is luna_kernel.operator_grid(knots.float())[1]


def test_crowded_knots_get_a_one_cell_grid():
    knots = torch.cat([torch.linspace(0, 1e-6, 40), torch.linspace(1, 2, 4)]).float()  # crowd every grid
    rows, grid = luna_kernel.operator_grid(knots)
    assert grid[3] == 1 and grid[5].shape == (44, 1)
    u = torch.linspace(-1, 3, 101)
    slope, intercept = torch.randn(45, 2), torch.randn(45, 2)
    got = luna_kernel.channel_features_op(u[:, None], slope, intercept, knots, -1.0)[:, 0]
    index = torch.searchsorted(knots, u)
    assert torch.equal(got, torch.relu(slope[index] * u[:, None] + intercept[index]))


@pytest.mark.parametrize("init, channels, norm_eps", [("exp", 2, FEATURE_NORM_EPS), ("random", 8, None)])
def test_channel_operators_registration_values_and_gradients(init, channels, norm_eps):
    psi, psi64 = bank(1, channels, init), bank(1, channels, init).double()
    eps = -1.0 if norm_eps is None else norm_eps
    g = torch.Generator().manual_seed(2)
    u = (torch.randn(2, 3, 11, 5, generator=g) * 3).requires_grad_()
    x, weight, bias = torch.randn(2, 3, 11, 4, generator=g), torch.randn(5, 4, generator=g), torch.randn(5, generator=g)
    tables = luna_kernel.graph_tables(psi, 0.3)
    detached = [t.detach().requires_grad_() for t in tables[:2]] + [tables[2]]
    torch.library.opcheck(luna_kernel.channel_features_op, (u, *detached, eps))
    leaves = [t.requires_grad_() for t in (x, weight, bias)]
    torch.library.opcheck(luna_kernel.projected_channel_features_op, (x, weight.t(), bias, *detached, eps))
    grad = torch.randn(2, 3, 11, 5, channels, generator=g, dtype=torch.float64)
    for name, got_fn, want_fn, inputs in (
            ("channels", lambda: luna_kernel.channel_features_op(u, *luna_kernel.graph_tables(psi, 0.3), eps),
             lambda u64: mlp_features(psi64, u64, 0.3, norm_eps), [u]),
            ("projected", lambda: luna_kernel.projected_channel_features_op(
                x, weight.t(), bias, *luna_kernel.graph_tables(psi, 0.3), eps),
             lambda x64, w64, b64: mlp_features(psi64, x64 @ w64.t() + b64, 0.3, norm_eps), leaves)):
        got = got_fn()
        got_grads = torch.autograd.grad(got, [*inputs, *psi.parameters()], grad.float())
        inputs64 = [t.detach().double().requires_grad_() for t in inputs]
        want = want_fn(*inputs64)
        want_grads = torch.autograd.grad(want, [*inputs64, *psi64.parameters()], grad)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5 * max(1.0, want.abs().max().item()), msg=name)
        for a, b in zip(got_grads, want_grads):
            torch.testing.assert_close(a.double(), b, rtol=0, atol=2e-5 * max(1.0, b.abs().max().item()), msg=name)


def sorting_case(seed: int = 3, profile: str = "laplace"):
    torch.manual_seed(seed)
    layer = LinearAttention("sorting", 8, 2, 8**-0.5, projections=3, profile=profile)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, 23, 8, generator=g) for _ in range(3))
    mask = torch.ones(2, 23, dtype=torch.bool)
    mask[1, 17:] = False
    return layer, q, k, v, mask


@pytest.mark.parametrize("profile, masked", [("laplace", True), ("matern32", False)])
def test_sorting_operator_registration_values_and_gradients(profile, masked):
    layer, q, k, v, mask = sorting_case(4, profile)
    mask = mask if masked else None
    kern, matern, eps = layer.kernel, profile == "matern32", layer.kernel.options.eps
    with torch.no_grad():
        x, y, w, c0 = kern.projected(q, k, torch.float32)
    leaves = [t.clone().requires_grad_() for t in (x, y, v, w, c0)]
    torch.library.opcheck(sorting_native.sorting_attention_op, (*leaves[:3], mask, *leaves[3:], matern, eps))
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    x, y, w, c0 = kern.projected(inputs[0], inputs[1], torch.float32)
    got = sorting_native.sorting_attention_op(x, y, inputs[2], mask, w, c0, matern, eps)[0]
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got_grads = torch.autograd.grad(got, [*inputs, *kern.parameters()], grad.float())
    kern64 = layer.double().kernel
    inputs64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = kern64.weights(*inputs64[:2], mask) @ inputs64[2]  # the explicit N x N weights
    want_grads = torch.autograd.grad(want, [*inputs64, *kern64.parameters()], grad)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=2e-5 * max(1.0, b.abs().max().item()))


PASSES = {"luna": (luna_native, ("forward_pass", "backward_pass", "native_projected_channel_features")),
          "sorting": (sorting_native, ("_forward", "_backward"))}


def _counting(method: str, monkeypatch) -> list:
    calls, (module, names) = [], PASSES[method.split("-")[0]]
    for name in names:
        real = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    return calls


def _layer(method: str) -> LinearAttention:
    torch.manual_seed(6)
    if method == "sorting":
        return LinearAttention("sorting", 16, 2, 0.25, projections=4)
    return LinearAttention("luna", 16, 2, 0.25, **(PAPER_OPTIONS if method == "luna-paper" else {}))


def _inductor_missing() -> bool:
    return not any(shutil.which(name) for name in ("c++", "g++", "clang++"))


@pytest.mark.parametrize("method, backend", [("luna", "aot_eager"), ("luna-paper", "aot_eager"),
                                             ("sorting", "aot_eager"), ("luna", "inductor")])
def test_compiled_layers_call_the_operators_forward_and_backward(method, backend, monkeypatch):
    if backend == "inductor" and _inductor_missing():
        pytest.skip("Inductor needs a C++ compiler")
    calls, layer = _counting(method, monkeypatch), _layer(method)
    _, q, k, v, mask = sorting_case(7)
    q, k, v = (torch.cat([t, t], -1) for t in (q, k, v))  # 16 features a head
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    with torch.no_grad():
        expected = layer(q, k, v, mask)
        del calls[:]
        got = compiled(q, k, v, mask)
    # LUNA's inference: the channel pass for queries and keys (the paper form's with its projection inside)
    inference_pass = {"sorting": "_forward", "luna": "forward_pass", "luna-paper": "native_projected_channel_features"}[
        method]
    assert calls == [inference_pass] * (1 if method == "sorting" else 2), "the compiled graph ran no native pass"
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    del calls[:]
    compiled(*leaves, mask).square().sum().backward()
    if method != "sorting":  # with a gradient recorded, the channel pass of the projected u
        assert calls.count("forward_pass") == 2, calls
    backward_pass = "_backward" if method == "sorting" else "backward_pass"
    assert calls.count(backward_pass) == (1 if method == "sorting" else 2), calls
    got_grads = [t.grad for t in leaves] + [p.grad for p in layer.parameters()]
    layer.zero_grad()
    reference = [t.clone().double().requires_grad_() for t in (q, k, v)]
    with native.reference_kernels():  # float64 through the PyTorch path
        layer.double()(*reference, mask).square().sum().backward()
    for a, b in zip(got_grads, [t.grad for t in reference] + [p.grad for p in layer.parameters()]):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-4 * max(1.0, b.abs().max().item()))


def _operators_in(program) -> set[str]:
    return {str(node.target) for module in program.graph_module.modules() if hasattr(module, "graph")
            for node in module.graph.nodes if str(node.target).startswith("luna_convert.")}


@pytest.mark.parametrize("method, options, expected", [
    ("luna", {}, {"luna_channel_features"}),
    ("luna", dict(PAPER_OPTIONS), {"luna_projected_channel_features"}),
    ("sorting", {}, {"sorting_attention"})])
def test_torch_export_shows_the_operators_and_runs(method, options, expected):
    model = make_bert(layers=1)
    luna_convert.convert(model, method=method, **options)
    inputs = example_inputs("hf-bert")
    with torch.no_grad():
        program = torch.export.export(model, (), dict(inputs), strict=False)
        shown = {name.split(".")[1] for name in _operators_in(program)}
        assert expected <= shown, shown
        torch.testing.assert_close(program.module()(**inputs).logits, model(**inputs).logits, rtol=0, atol=1e-5)
        with native.reference_kernels():  # what export_model traces: no native operator in the graph
            plain = torch.export.export(model, (), dict(inputs), strict=False)
    assert _operators_in(plain) == set()


def test_fake_outputs_promise_the_real_layouts():
    """Inductor checks a custom operator's outputs against its fake implementation's sizes and strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    psi = bank(8, 2, "exp")
    tables = luna_kernel.graph_tables(psi, 1.0)
    u, x = torch.randn(2, 3, 11, 5), torch.randn(2, 11, 3, 4).transpose(1, 2)
    weight_t, bias = torch.randn(4, 5), torch.randn(5)
    layer, q, k, v, mask = sorting_case(9)
    with torch.no_grad():
        sx, sy, w, c0 = layer.kernel.projected(q, k, torch.float32)
    out, den = sorting_native.sorting_attention_op(sx, sy, v, mask, w, c0, False, 1e-6)
    cases = [(luna_kernel.channel_features_op, (u, *tables, 0.1)),
             (luna_kernel.channel_features_backward_op, (torch.randn(2, 3, 11, 5, 2), u, *tables, 0.1)),
             (luna_kernel.projected_channel_features_op, (x, weight_t, bias, *tables, -1.0)),
             (sorting_native.sorting_attention_op, (sx, sy, v, mask, w, c0, False, 1e-6)),
             (sorting_native.sorting_attention_backward_op, (torch.randn(out.shape), sx, sy, v, mask, w, c0, out, den,
                                                             False))]
    for op, args in cases:
        real = op(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        for r, f in zip(real if isinstance(real, tuple) else (real,), fake if isinstance(fake, tuple) else (fake,)):
            assert (r.shape, r.stride()) == (f.shape, f.stride()), op


@pytest.mark.parametrize("eps", [-1.0, FEATURE_NORM_EPS])
def test_channel_operators_equal_their_named_references(eps):
    """The operators against the table form beside them (``luna_kernel.luna_channel_features_reference``,
    searchsorted instead of the grid) in float64, on the same tables: values and every gradient."""
    psi = bank(4, 4, "random")
    slope, intercept, knots = (t.detach() for t in luna_kernel.graph_tables(psi, 0.5))
    g = torch.Generator().manual_seed(6)
    u, x = 3 * torch.randn(2, 3, 13, 5, generator=g), torch.randn(2, 3, 13, 4, generator=g)
    weight_t, bias = torch.randn(4, 5, generator=g), torch.randn(5, generator=g)
    grad = torch.randn(2, 3, 13, 5, 4, generator=g)
    for operator, reference, inputs in (
            (luna_kernel.channel_features_op, luna_kernel.luna_channel_features_reference, (u,)),
            (luna_kernel.projected_channel_features_op, luna_kernel.luna_projected_channel_features_reference,
             (x, weight_t, bias))):
        results = []
        for dtype, function in ((torch.float32, operator), (torch.float64, reference)):
            leaves = [t.to(dtype).requires_grad_() for t in (*inputs, slope, intercept)]
            out = function(*leaves, knots, eps)
            results.append([out, *torch.autograd.grad(out, leaves, grad.to(dtype))])
        for got, want in zip(*results):
            torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5 * max(1.0, want.abs().max().item()))
