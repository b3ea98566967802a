"""ops.piecewise: the standard-operator form of piecewise-linear functions (LUNA's channel bank) against
searchsorted and the explicit MLP, and what compiled and exported graphs run of it."""

from __future__ import annotations

import math

import pytest
import torch

from luna_convert.linear_methods.luna import LunaFeatureMap, ScalarChannels
from luna_convert.linear_methods.luna_kernel import channel_table, frozen_for_export, scalar_channels_of
from luna_convert.ops import native
from luna_convert.ops.piecewise import (CHUNK_VALUES, MAX_DEPTH, KnotGrid, binary_search, knot_intervals,
                                        piecewise_relu, piecewise_relu_features,
                                        piecewise_relu_features_reference, piecewise_relu_reference)


def _knot_sets():
    g = torch.Generator().manual_seed(0)
    heavy = torch.cat([torch.randn(300, generator=g), torch.randn(200, generator=g) * 100,
                       torch.tensor([-math.inf, math.inf, math.inf])])
    bounded = torch.linspace(-8, 8, 64) + torch.rand(64, generator=g) * 0.2
    tied = torch.linspace(-8, 8, 64).repeat(2)  # the exp init: every channel's knots at the same points
    return {"heavy tails": heavy.sort().values, "bounded": bounded.sort().values, "tied": tied.sort().values,
            "crowded": torch.cat([torch.tensor([-1e3]), torch.linspace(0, 1e-5, 64), torch.tensor([1e3])]),
            "equal": torch.zeros(64), "none finite": torch.full((5,), math.inf), "one": torch.tensor([0.5])}


def _inputs(knots: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    finite = knots[torch.isfinite(knots)]
    near = torch.cat([finite, finite.nextafter(torch.tensor(-1e30)), finite.nextafter(torch.tensor(1e30))])
    # u = -inf against a knot at -inf: searchsorted counts the knot as not below, the grid as below (moot:
    # the features of an infinite input are not finite either way)
    extremes = [math.inf, 1e30, -1e30, 0.0, -0.0] + ([] if (knots == -math.inf).any() else [-math.inf])
    return torch.cat([torch.randn(4000, generator=g) * 5, torch.randn(500, generator=g) * 300, near,
                      torch.tensor(extremes)])


@pytest.mark.parametrize("name", sorted(_knot_sets()))
def test_every_search_counts_the_knots_below_as_searchsorted_does(name):
    knots = _knot_sets()[name]
    u = _inputs(knots)
    want = torch.searchsorted(knots, u)
    assert torch.equal(binary_search(u, knots).long(), want)
    grid = KnotGrid.build(knots)
    if name == "crowded":
        assert grid is None  # 64 distinct knots in one cell at any size: the binary search serves
    else:
        assert grid is not None and grid.depth <= (MAX_DEPTH if name == "heavy tails" else 1)
        assert torch.equal(grid.rows.index_select(0, grid.index(u)).long(), want)
    strided = u[:u.numel() // 7 * 7].view(-1, 7)[:, :5]  # not contiguous
    assert torch.equal(knot_intervals(strided, knots).long(), torch.searchsorted(knots, strided.contiguous()))


def test_nan_takes_the_first_interval_so_its_features_stay_nan():
    knots = _knot_sets()["bounded"]
    u = torch.tensor([math.nan, 1.0])
    assert binary_search(u, knots)[0] == 0 and KnotGrid.build(knots).index(u)[0] == 0
    table = torch.randn(knots.numel() + 1, 4)
    assert piecewise_relu(u, table, knot_intervals(u, knots))[0].isnan().all()


def test_knot_intervals_is_a_well_formed_operator():
    knots = _knot_sets()["bounded"]
    torch.library.opcheck(knot_intervals, (torch.randn(3, 40) * 4, knots))
    assert knot_intervals(torch.randn(2, 3, 5), knots).dtype == torch.int32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["heavy tails", "tied", "crowded"])
def test_inference_features_equal_the_reference_across_chunks(name, dtype):
    """``piecewise_relu_features`` (inference: tokens in chunks, the grid or, for crowded knots, the binary
    search) against searchsorted's form, with and without the channel norm, over a chunk boundary."""
    knots = _knot_sets()[name].to(dtype)
    g = torch.Generator().manual_seed(3)
    table = torch.randn(knots.numel() + 1, 6, generator=g, dtype=dtype)
    u = (torch.randn(2, CHUNK_VALUES // 16 + 5, 16, generator=g) * 5).to(dtype)  # a partial second chunk
    ref = piecewise_relu_features_reference(u, knots, table, None)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-6  # float32: addcmul's fused rounding, 1.2e-7 relative
    torch.testing.assert_close(piecewise_relu_features(u, knots, table, None), ref, rtol=tolerance, atol=tolerance)
    normed = piecewise_relu_features_reference(u, knots, table, 1e-3)
    # float32: a value near its kink (slope u ~ -intercept) keeps the terms' absolute rounding, and a small sum
    # over M magnifies it; measured 1.3e-5
    torch.testing.assert_close(piecewise_relu_features(u, knots, table, 1e-3), normed, rtol=tolerance,
                               atol=tolerance if dtype == torch.float64 else 5e-5)


def test_inference_features_are_a_well_formed_operator_that_compiled_graphs_call():
    knots = _knot_sets()["bounded"]
    table = torch.randn(knots.numel() + 1, 4)
    torch.library.opcheck(torch.ops.luna_convert.piecewise_relu_features.default,
                          (torch.randn(3, 40, 8) * 4, knots, table, 1e-6))
    torch.manual_seed(0)
    fm = LunaFeatureMap(8, 2)
    x = torch.randn(1, 2, 30, 8) * 3
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with native.reference_kernels(), torch.no_grad():
        compiled = torch.compile(fm, fullgraph=True, backend=backend)(x)
        eager, reference = fm(x), LunaFeatureMap(8, 2, fast=False).requires_grad_(False)
    reference.load_state_dict(fm.state_dict())
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes]
    assert any("piecewise_relu_features" in t for t in targets) and not any("knot_intervals" in t for t in targets)
    assert torch.equal(compiled, eager)
    torch.testing.assert_close(compiled, reference(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["heavy tails", "tied"])
def test_piecewise_relu_values_and_gradients_equal_the_reference_in_float64(name):
    knots = _knot_sets()[name].double()
    g = torch.Generator().manual_seed(2)
    table = torch.randn(knots.numel() + 1, 6, generator=g, dtype=torch.float64, requires_grad=True)
    u = (torch.randn(3, 50, generator=g, dtype=torch.float64) * 5).requires_grad_()
    out = piecewise_relu(u, table, knot_intervals(u, knots))
    ref = piecewise_relu_reference(u, knots, table)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    grad = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (u, table), grad), torch.autograd.grad(ref, (u, table), grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x, t: piecewise_relu(x, t, knot_intervals(x, knots)), (u, table))


@pytest.mark.parametrize("init", ["exp", "random"])
def test_luna_channels_equal_the_mlp_in_float64_values_and_gradients(init):
    torch.manual_seed(0)
    psi = ScalarChannels(3, 16, init=init).double()
    u = (torch.randn(2, 3, 40, 5, dtype=torch.float64) * 4).requires_grad_()
    out = scalar_channels_of(psi, u, scale=0.5)[0]
    ref = psi(u) * 0.5
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    grad = torch.randn_like(ref)
    params = (u, *psi.parameters())
    for a, b in zip(torch.autograd.grad(out, params, grad), torch.autograd.grad(ref, params, grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_compiled_luna_map_runs_the_standard_form_and_equals_eager():
    torch.manual_seed(0)
    fm = LunaFeatureMap(8, 2)
    x = torch.randn(1, 2, 30, 8) * 3
    with native.reference_kernels():
        eager = fm(x)
        compiled = torch.compile(fm, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-6)


def _nodes(program) -> list:
    """Every node of an exported program, those of its nested graphs (autocast regions) included."""
    return [node for module in program.graph_module.modules() if isinstance(module, torch.fx.GraphModule)
            for node in module.graph.nodes]


def _largest_per_element(program, elements: int) -> float:
    """The largest tensor of an exported graph, in units of ``elements``."""
    sizes = [node.meta["val"].numel() for node in _nodes(program) if isinstance(node.meta.get("val"), torch.Tensor)]
    return max(sizes) / elements


def test_exported_luna_map_never_expands_the_hidden_units_and_uses_the_frozen_grid():
    """An export evaluates the channel bank from its knots: no [..., M, L, hidden] MLP expansion, and (frozen
    before the export) the grid's few gathers rather than the binary search's log2(K + 1)."""
    torch.manual_seed(0)
    fm = LunaFeatureMap(16, 2, hidden=64).eval()
    x = torch.randn(1, 2, 32, 16) * 3
    per_token = x.numel() * fm.channels  # the features: M L values per token and head (M = d here)
    with native.reference_kernels(), torch.no_grad():
        want = fm(x)
        searched = torch.export.export(fm, (x,), strict=False)
        with fm.frozen_for_export():
            frozen = torch.export.export(fm, (x,), strict=False)
    for program in (searched, frozen):
        assert _largest_per_element(program, per_token) <= 2  # the MLP form holds hidden (64) x per_token
        torch.testing.assert_close(program.module()(x), want, rtol=0, atol=1e-6)
        assert not any("knot_intervals" in str(node.target) for node in _nodes(program))
    def per_element(program, op):  # the nodes of op whose output has an entry per element of u
        return [node for node in _nodes(program) if op in str(node.target)
                and node.meta["val"].numel() == x.numel()]
    # every gather per element is torch.gather (ONNX GatherElements, 8x faster in ONNX Runtime than the Gather
    # that index_select becomes); index_select stays for the tables (their size, not the tokens')
    assert not any(per_element(p, "index_select") for p in (searched, frozen))
    gathers = [len(per_element(p, "aten.gather")) for p in (searched, frozen)]
    knots = channel_table(fm.psi, torch.float32, 1.0, x.device)[0].numel()
    assert gathers[0] >= knots.bit_length() + 2 * fm.channels  # the binary search
    assert gathers[1] <= 2 + 2 * fm.channels + 1  # cell knots (depth <= 2), the per-channel tables


def test_frozen_grid_is_dropped_after_the_export():
    psi = ScalarChannels(2, 8, init="exp")
    with frozen_for_export(psi, 1.0):
        pass
    with torch.no_grad():
        psi.b2.add_(1.0)
    u = torch.randn(5, 3)
    torch.testing.assert_close(scalar_channels_of(psi, u)[0], psi(u), rtol=0, atol=1e-6)
