"""The native products as registered PyTorch operators (``ops.products``): their registration (schema,
fake implementation, autograd) checked by ``torch.library.opcheck``, their gradients against float64
torch.bmm, and the operators called inside compiled graphs and shown by torch.export."""

from __future__ import annotations

import copy

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
    for name in ("_native_transposed_product", "_native_product", "_native_produced_transposed_product",
                 "_native_produced_product"):
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


@pytest.mark.parametrize("method, operators", [
    ("t2r", {"produced_transposed_product", "produced_product"}),  # its features made inside the products
    ("ela", {"transposed_product", "product"})])  # its features stored
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
    from luna_convert.ops import dwc, exp_rows

    x, y, w, bias = _operands(4)
    _, dwc_args = _dwc_operands(False, True)
    grad = torch.randn(dwc_args[0].shape)
    cases = [(products.transposed_product_op, (x, y, True)), (products.product_op, (x, w, bias.contiguous())),
             (dwc.dwc_tokens_plus_op, dwc_args),
             (dwc.dwc_tokens_backward_op, (grad, dwc_args[0], dwc_args[1], dwc_args[4], dwc_args[5]))]
    if exp_rows.lanes():
        z = torch.randn(2, 3, 5, 16)
        cases += [(exp_rows.softmax_pair_op, (z,)), (exp_rows.softmax_pair_backward_op, (torch.cat([z, z], -1), z.repeat(1, 1, 1, 2)))]
    _assert_fake_layouts(cases)


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


# The softmax pair (Hedgehog's map) and the products of made rows (every map's fused makers at inference).
def test_softmax_pair_operators_registration_values_and_gradients():
    from luna_convert.ops import exp_rows

    if exp_rows.lanes() == 0:
        pytest.skip(exp_rows.status())
    z = torch.randn(2, 3, 37, 16, generator=torch.Generator().manual_seed(5))
    torch.library.opcheck(exp_rows.softmax_pair_op, (z.clone().requires_grad_(),))
    features = exp_rows.softmax_pair_op(z)
    torch.library.opcheck(exp_rows.softmax_pair_backward_op, (features, torch.randn_like(features)))
    leaf, leaf64 = z.clone().requires_grad_(), z.double().requires_grad_()
    got, want = exp_rows.softmax_pair_op(leaf), exp_rows.softmax_pair_reference(leaf64)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
    weights = torch.linspace(-1, 1, got.numel(), dtype=torch.float64).view_as(want)
    (grad,) = torch.autograd.grad((got * weights.float()).sum(), leaf)
    (want_grad,) = torch.autograd.grad((want * weights).sum(), leaf64)
    torch.testing.assert_close(grad.double(), want_grad, rtol=0, atol=1e-6)


# Forms whose rows cover every maker: affine (T2R), affine + softmax pair (Hedgehog), pointwise (ReLU, ELU,
# cosFormer with its trig table), pairs of x (Taylor), affine + factor product + pairs (LLoPS), affine + the
# stabilised exps of queries and keys (Performer, keys made at any size, with a key mask).
MADE_FORMS = {"t2r": {}, "hedgehog": {}, "relu": {}, "elu": {}, "cosformer": {}, "taylor": {}, "llops": {"rank": 6},
              "performer": {}}


def _made_rows(method: str, monkeypatch):
    """(layer, q, k, mask, query rows, key rows) of a 16-wide, 3-head layer over 2 x 37 tokens, one padded."""
    from luna_convert.linear_methods import performer
    from luna_convert.ops.context import AttentionContext

    monkeypatch.setattr(performer, "MADE_KEYS_MIN_BYTES", 0)
    torch.manual_seed(0)
    layer = LinearAttention(method, 16, 3, 0.25, **MADE_FORMS[method]).eval()
    with torch.no_grad():
        for parameter in layer.method_parameters():  # Hedgehog's W = I, b = 0 would hide a head mixed up
            parameter.add_(0.3 * torch.randn_like(parameter))
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
    makers, tensors, ints, floats = rows.arguments()
    return makers, [None if t is None else t.detach() for t in tensors], ints, floats


@pytest.mark.parametrize("method", MADE_FORMS)
def test_made_rows_operators_registration_and_values(method, monkeypatch):
    """Each made-rows operator checked by opcheck, and against float64 products of the map's float64 features."""
    from luna_convert.ops.context import AttentionContext

    layer, q, k, mask, q_rows, k_rows = _made_rows(method, monkeypatch)
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


def test_made_rows_operators_refuse_gradients_and_read_the_run_tensors(monkeypatch):
    _, q, _, _, q_rows, _ = _made_rows("t2r", monkeypatch)
    w = torch.randn(2, 3, q_rows.shape[-1], 5)
    makers, tensors, ints, floats = _arguments(q_rows)
    with pytest.raises(RuntimeError, match="inference"):
        products.produced_product_op(w.clone().requires_grad_(), list(q_rows.shape), makers, tensors, ints, floats)
    # the operator builds its maker from the tensors it is handed, at their strides: a contiguous copy of x, or
    # another x, gives that x's product
    other = torch.randn(q.shape)
    for x in (tensors[0].contiguous(), other):
        got = products.produced_product_op(w, list(q_rows.shape), makers, [x, *tensors[1:]], ints, floats)
        with torch.no_grad():
            want = products.product_reference(torch.relu(products.product_reference(
                x, tensors[1].expand(2, 3, *tensors[1].shape), tensors[2].expand(2, 3, 1, -1))), w)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


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
    layer, q, k, mask, _, _ = _made_rows(method, monkeypatch)
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
        keys_made = method != "performer"  # graphs store the random features' keys at every size
        assert calls.count("_native_produced_product") == 1
        assert calls.count("_native_produced_transposed_product") == keys_made
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    made = _graph_operators(graphs)
    assert made.count("luna_convert.produced_product.default") == 2, made
    assert made.count("luna_convert.produced_transposed_product.default") == 2 * keys_made, made
    assert made.count("luna_convert.transposed_product.default") == 2 * (not keys_made), made


def test_compiled_hedgehog_training_calls_the_softmax_pair_operators():
    layer = LinearAttention("hedgehog", 16, 2, 0.25)
    with torch.no_grad():
        for parameter in layer.method_parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 2, 40, 16, generator=g) for _ in range(3))
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 30:] = False
    forward_graphs, backward_graphs = [], []
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=_recording_backend(forward_graphs, backward_graphs), fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled(*leaves, mask).square().sum().backward()
    forward_ops, backward_ops = _graph_operators(forward_graphs), _graph_operators(backward_graphs)
    assert forward_ops.count("luna_convert.softmax_pair.default") == 2, forward_ops  # queries and keys
    assert backward_ops.count("luna_convert.softmax_pair_backward.default") == 2, backward_ops
    got = [t.grad for t in leaves] + [p.grad.clone() for p in layer.method_parameters()]
    layer.zero_grad()
    reference = [t.double().requires_grad_() for t in (q, k, v)]
    with native.reference_kernels():
        layer.double()(*reference, mask).square().sum().backward()
    want = [t.grad for t in reference] + [p.grad for p in layer.method_parameters()]
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-4 * max(1.0, b.abs().max().item()))



def test_stabilised_exp_operator_registration_values_and_gradients():
    from luna_convert.ops import exp_rows

    if not exp_rows.available():
        pytest.skip(exp_rows.status())
    g = torch.Generator().manual_seed(11)
    x = 3 * torch.randn(6, 9, 20, generator=g)
    shift = x.amax(dim=(1, 2)) + 1.5  # keys: one stabiliser per group
    for case in ((x, None, 1.5), (x, shift, 0.0)):
        torch.library.opcheck(exp_rows.stabilised_exp_op, (case[0].clone().requires_grad_(), *case[1:]))
        leaf, leaf64 = case[0].clone().requires_grad_(), case[0].double().requires_grad_()
        got = exp_rows.stabilised_exp_op(leaf, case[1], case[2])
        want = exp_rows.stabilised_exp_reference(leaf64, None if case[1] is None else case[1].double(), case[2])
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
        weights = torch.linspace(-1, 1, got.numel(), dtype=torch.float64).view_as(want)
        (grad,) = torch.autograd.grad((got * weights.float()).sum(), leaf)
        (want_grad,) = torch.autograd.grad((want * weights).sum(), leaf64)  # the shift held fixed: no gradient
        torch.testing.assert_close(grad.double(), want_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("method", ["performer", "flexformer"])
def test_compiled_random_features_training_calls_the_stabilised_exp(method):
    layer = LinearAttention(method, 16, 2, 0.25)
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(2, 2, 40, 16, generator=g) for _ in range(3))
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 31:] = False
    forward_graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=_recording_backend(forward_graphs, []), fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled(*leaves, mask).square().sum().backward()
    forward_ops = _graph_operators(forward_graphs)
    assert forward_ops.count("luna_convert.stabilised_exp.default") == 2, forward_ops  # queries and keys
    got = [t.grad for t in leaves]
    reference = [t.double().requires_grad_() for t in (q, k, v)]
    with native.reference_kernels():
        layer.double()(*reference, mask).square().sum().backward()
    for a, b in zip(got, [t.grad for t in reference]):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-4 * max(1.0, b.abs().max().item()))
