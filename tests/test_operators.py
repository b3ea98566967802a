"""The products of made rows (Taylor's features) and the DWC pass as registered PyTorch operators
(``ops.products``): their registration (schema, fake implementation, autograd) checked by
``torch.library.opcheck``, their values against float64 references, and the operators called inside compiled
graphs and shown by torch.export."""

from __future__ import annotations

import copy

import pytest
import torch

import luna_convert
from conftest import example_inputs, make_bert
from luna_convert.layers.attention import LinearAttention
from luna_convert.ops import native, pair_rows, products

pytestmark = pytest.mark.skipif(products.native_library() is None or pair_rows.library() is None,
                                reason="needs an x86 CPU and a C compiler")


def _operators_in(program) -> set[str]:
    """The luna_convert operators the exported program calls (in its graph or its submodules')."""
    return {str(node.target) for module in program.graph_module.modules() if hasattr(module, "graph")
            for node in module.graph.nodes if str(node.target).startswith("luna_convert.")}


@pytest.mark.parametrize("method, operators", [
    ("taylor", {"produced_transposed_product", "produced_product"}),  # its features made inside the products
    ("ela", set())])  # its features stored, the products torch.bmm
def test_torch_export_shows_the_operators_and_runs(method, operators):
    model = make_bert(layers=1)
    luna_convert.convert(model, method=method)
    inputs = example_inputs("hf-bert")
    with torch.no_grad():
        program = torch.export.export(model, (), dict(inputs), strict=False)
        assert _operators_in(program) == {f"luna_convert.{name}.default" for name in operators}
        assert torch.allclose(program.module()(**inputs).logits, model(**inputs).logits, atol=1e-5)
        with native.reference_kernels():  # what export_model traces: no native operator in the graph
            plain = torch.export.export(model, (), dict(inputs), strict=False)
    assert _operators_in(plain) == set()


def _assert_fake_layouts(cases) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    def faked(mode, a):
        if isinstance(a, list):
            return [faked(mode, b) for b in a]
        return mode.from_tensor(a) if isinstance(a, torch.Tensor) else a

    for op, args in cases:
        real = op(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = op(*(faked(mode, a) for a in args))
        for r, f in zip(real if isinstance(real, tuple) else (real,), fake if isinstance(fake, tuple) else (fake,)):
            assert (r.shape, r.stride()) == (f.shape, f.stride()), op


# Taylor's made rows, without and with its projection (stored inputs of the maker, read at their strides).
MADE_FORMS = {"taylor": {}, "taylor, projected": {"project_dim": 5}}


def _made_rows(form: str):
    """(layer, q, k, mask, query rows, key rows) of a 16-wide, 3-head layer over 2 x 37 tokens, one padded."""
    from luna_convert.ops.context import AttentionContext

    torch.manual_seed(0)
    layer = LinearAttention("taylor", 16, 3, 0.25, **MADE_FORMS[form]).eval()
    g = torch.Generator().manual_seed(6)
    q, k = (torch.randn(2, 37, 3, 16, generator=g).transpose(1, 2) for _ in range(2))  # heads split in place
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[1, 25:] = False
    with torch.no_grad():
        q_rows, k_rows = layer.feature_rows(q, k, AttentionContext(mask, 37))
    return layer, q, k, mask, q_rows, k_rows


def _arguments(rows) -> tuple:
    """``rows.arguments()``, their tensors detached (the map's parameters require a gradient, which the
    operators refuse where grad mode is on, as opcheck runs them)."""
    maker, tensors, ints, floats = rows.arguments()
    return maker, [t.detach() for t in tensors], ints, floats


@pytest.mark.parametrize("method", MADE_FORMS)
def test_made_rows_operators_registration_and_values(method):
    """Each made-rows operator checked by opcheck, and against float64 products of the map's float64 features."""
    from luna_convert.ops.context import AttentionContext

    layer, q, k, mask, q_rows, k_rows = _made_rows(method)
    width = q_rows.shape[-1]
    g = torch.Generator().manual_seed(7)
    y, w = torch.randn(2, 3, 37, 9, generator=g), torch.randn(2, 3, width, 9, generator=g)
    torch.library.opcheck(products.produced_transposed_product_op, (y, True, list(k_rows.shape), *_arguments(k_rows)))
    torch.library.opcheck(products.produced_product_op, (w, list(q_rows.shape), *_arguments(q_rows)))
    with torch.no_grad():
        phi_q, phi_k = copy.deepcopy(layer).double().features(q.double(), k.double(), AttentionContext(mask, 37))
    for with_sum in (False, True):
        got = products.produced_transposed_product_op(y, with_sum, list(k_rows.shape), *_arguments(k_rows))
        want = phi_k.transpose(-1, -2) @ y.double()
        magnitude = phi_k.abs().transpose(-1, -2) @ y.double().abs()
        if with_sum:
            want = torch.cat([want, phi_k.sum(-2, keepdim=True).transpose(-1, -2)], -1)
            magnitude = torch.cat([magnitude, phi_k.abs().sum(-2, keepdim=True).transpose(-1, -2)], -1)
        assert ((got.double() - want).abs() <= 1e-5 * magnitude + 1e-6).all(), method
    got = products.produced_product_op(w, list(q_rows.shape), *_arguments(q_rows))
    assert ((got.double() - phi_q @ w.double()).abs() <= 1e-5 * (phi_q.abs() @ w.double().abs()) + 1e-6).all()
    _assert_fake_layouts([(products.produced_product_op, (w, list(q_rows.shape), *_arguments(q_rows))),
                          (products.produced_transposed_product_op, (y, True, list(k_rows.shape), *_arguments(k_rows)))])


def test_made_rows_operators_refuse_gradients_and_read_the_run_tensors():
    _, q, _, _, q_rows, _ = _made_rows("taylor")
    w = torch.randn(2, 3, q_rows.shape[-1], 5)
    maker, tensors, ints, floats = _arguments(q_rows)
    with pytest.raises(RuntimeError, match="inference"):
        products.produced_product_op(w.clone().requires_grad_(), list(q_rows.shape), maker, tensors, ints, floats)
    # the operator builds its maker from the tensors it is handed, at their strides: a contiguous copy of x, or
    # another x, gives that x's product
    other = torch.randn(q.shape)
    for x in (tensors[0].contiguous(), other):
        got = products.produced_product_op(w, list(q_rows.shape), maker, [x], ints, floats)
        with torch.no_grad():
            want = products.product(pair_rows_reference(x, *floats, bool(ints[1])), w)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def pair_rows_reference(x: torch.Tensor, linear_scale: float, square_scale: float, pair_scale: float,
                        constant: bool) -> torch.Tensor:
    """``pair_rows.pair_feature_rows``' features in PyTorch (with its linear part)."""
    i, j = torch.triu_indices(x.shape[-1], x.shape[-1])
    pairs = (x[..., i] * torch.where(i == j, torch.tensor(square_scale), torch.tensor(pair_scale))) * x[..., j]
    return torch.cat([*([torch.ones(*x.shape[:-1], 1)] if constant else []), x * linear_scale, pairs], -1)


def _graph_operators(graphs: list) -> list[str]:
    return [str(node.target) for graph in graphs for node in graph.graph.nodes if "luna_convert" in str(node.target)]


def _recording_backend(forward_graphs: list, backward_graphs: list):
    """aot_eager that keeps the forward and backward graphs it compiles (ATen level: the operators as called)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keep(graphs):
        return lambda gm, inputs: graphs.append(gm) or make_boxed_func(gm)

    return aot_autograd(fw_compiler=keep(forward_graphs), bw_compiler=keep(backward_graphs))


@pytest.mark.parametrize("method", MADE_FORMS)
def test_compiled_inference_calls_the_made_rows_operators(method, monkeypatch):
    layer, q, k, mask, _, _ = _made_rows(method)
    v = torch.randn(2, 3, 37, 16, generator=torch.Generator().manual_seed(8))
    calls = []
    for name in ("_native_produced_product", "_native_produced_transposed_product"):
        real = getattr(products, name)
        monkeypatch.setattr(products, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=_recording_backend(graphs, []), fullgraph=True)
    for key_mask in (mask, None):  # the key sums without and with the sum column
        with torch.no_grad():
            expected = layer(q, k, v, key_mask)
            del calls[:]
            got = compiled(q, k, v, key_mask)
        assert calls.count("_native_produced_product") == 1
        assert calls.count("_native_produced_transposed_product") == 1
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    made = _graph_operators(graphs)
    assert made.count("luna_convert.produced_product.default") == 2, made
    assert made.count("luna_convert.produced_transposed_product.default") == 2, made
