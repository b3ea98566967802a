"""LUNA's native channel kernel (``luna_native``, ``luna_channels.c``, loaded by ``ops.native``).

Its reference is the plain MLP bank ``ScalarChannels.forward`` followed by the feature norm written out
(x / (sum over the projections + eps)), in float64: values and gradients for u and the four bank
parameters, at the conversion defaults and at the paper's form, on and beside the knots, over several
threads. Then: the layer gives the PyTorch path's outputs and gradients, it really takes the native
path, and without a compiler (or with LUNA_CONVERT_NATIVE=0, or a source that does not compile) the
PyTorch path runs and says why.
"""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from luna_convert.cli import app
from luna_convert.layers.attention import LinearAttention
from luna_convert.linear_methods import luna_kernel, luna_native
from luna_convert.linear_methods.luna import FEATURE_NORM_EPS, PAPER_OPTIONS, ScalarChannels
from luna_convert.linear_methods.luna_kernel import channel_features_of, channel_tables
from luna_convert.ops import native
from luna_convert.tools.op_count import AtenOpCounter


@pytest.fixture
def kernel():
    if luna_native.library() is None:
        pytest.skip(native.unavailable_reason(luna_native.SOURCE))
    return luna_native.library()


def bank(channels: int, init: str, hidden: int = 64) -> ScalarChannels:
    torch.manual_seed(channels)
    return ScalarChannels(channels, hidden, init=init)


def reference(psi: ScalarChannels, u: torch.Tensor, scale: float, norm_eps: float | None) -> torch.Tensor:
    """The bank's MLP times scale, each channel divided by its sum over the projections (dim -2) + eps."""
    feats = psi(u) * scale
    return feats if norm_eps is None else feats / (feats.sum(-2, keepdim=True) + norm_eps)


def values_and_grads(psi: ScalarChannels, u: torch.Tensor, out: torch.Tensor, grad: torch.Tensor):
    return [out.detach(), *torch.autograd.grad(out, [u, *psi.parameters()], grad.to(out.dtype))]


@pytest.mark.parametrize("init, projections, channels, norm_eps, grid", [
    ("exp", 64, 2, FEATURE_NORM_EPS, "linear"),  # the conversion default
    ("exp", 7, 2, FEATURE_NORM_EPS, "linear"),  # L = 2's vector paths with their ends: scalars, M, rows
    ("random", 3, 12, 0.5, "squashed"),  # eight channels per vector op, then four one by one
    ("random", 8, 8, None, "squashed"),  # the paper's form: heavy-tailed knots
    ("exp", 5, 3, FEATURE_NORM_EPS, "linear"),  # L that the kernel does not specialise
    ("random", 7, 1, 0.5, "linear"),
])
def test_matches_the_mlp_bank_and_its_norm(kernel, init, projections, channels, norm_eps, grid):
    psi = bank(channels, init)
    assert luna_kernel.knot_locator(psi).mapping == grid  # both of the kernel's cell maps are exercised
    psi64 = bank(channels, init).double()
    u = (torch.randn(2, 3, 37, projections) * 3).requires_grad_()
    u64 = u.detach().double().requires_grad_()
    grad = torch.randn(2, 3, 37, projections, channels, dtype=torch.float64)
    got = values_and_grads(psi, u, channel_features_of(psi, u, scale=0.3, norm_eps=norm_eps)[0], grad)
    want = values_and_grads(psi64, u64, reference(psi64, u64, 0.3, norm_eps), grad)
    for name, a, b in zip(["features", "u", "w1", "b1", "w2", "b2"], got, want):
        # float32 against float64: measured at most 4e-6 relative to the largest entry (w2's gradient sums
        # over every scalar of u)
        torch.testing.assert_close(a.double(), b, rtol=0, atol=2e-5 * max(1.0, b.abs().max().item()), msg=name)


def test_on_and_beside_the_knots_as_the_pytorch_path(kernel, monkeypatch):
    """At a knot exactly, and one float32 step to either side, the same interval as the PyTorch path."""
    psi = bank(2, "random")
    knots, _, _ = channel_tables(psi)
    finite = knots[torch.isfinite(knots)].float()
    up, down = torch.nextafter(finite, finite + 1), torch.nextafter(finite, finite - 1)
    u = torch.cat([finite, up, down, torch.tensor([-1e30, 1e30, 0.0, -0.0])]).view(1, -1, 1).requires_grad_()
    grad = torch.randn(1, u.shape[1], 1, 2)
    native_out = values_and_grads(psi, u, channel_features_of(psi, u)[0], grad)
    monkeypatch.setenv(native.DISABLE_VARIABLE, "0")
    torch_out = values_and_grads(psi, u, channel_features_of(psi, u)[0], grad)
    for name, a, b in zip(["features", "u", "w1", "b1", "w2", "b2"], native_out, torch_out):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)  # measured 0 for the features and u


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_split_the_rows_and_give_one_threads_result(kernel, threads):
    psi = bank(2, "exp")
    u = torch.randn(4, 12, 300, 16).requires_grad_()
    grad = torch.randn(4, 12, 300, 16, 2)
    before = torch.get_num_threads()
    results = []
    try:
        for count in (1, threads):
            torch.set_num_threads(count)
            results.append(values_and_grads(psi, u, channel_features_of(psi, u, norm_eps=1e-6)[0], grad))
        assert native.chunk_count(u.numel() // 16, luna_native.MIN_ROWS_PER_CHUNK) == 4 * threads
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)  # rows are independent
    for a, b in zip(results[1][1:], results[0][1:]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # per-chunk float64 sums, in another grouping


def test_bfloat16_input_computes_in_float32_and_returns_bfloat16(kernel):
    psi = bank(2, "exp")
    u = torch.randn(2, 3, 20, 16).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = channel_features_of(psi, u, norm_eps=FEATURE_NORM_EPS)[0]
    want = reference(psi.double(), u.double(), 1.0, FEATURE_NORM_EPS)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-3)  # bf16's rounding of the result


def test_run_in_chunks_visits_every_row_once():
    seen = []
    native.run_in_chunks(lambda r0, r1, i: seen.append((r0, r1, i)), 103, 7)
    assert sorted(seen) == sorted(seen, key=lambda s: s[2]) and len(seen) == 7
    rows = [r for r0, r1, _ in seen for r in range(r0, r1)]
    assert sorted(rows) == list(range(103))


def luna_layer(**options) -> LinearAttention:
    torch.manual_seed(0)
    layer = LinearAttention("luna", 16, 3, 16**-0.5, **options)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.05 * torch.randn_like(p))  # off the init: DWC non-zero, projections not I
    return layer


@pytest.mark.parametrize("options", [{}, dict(PAPER_OPTIONS)], ids=["defaults", "paper"])
def test_layer_takes_the_native_path_and_gives_the_pytorch_paths_outputs(kernel, monkeypatch, options):
    q, k, v = (torch.randn(2, 3, 40, 16, requires_grad=True) for _ in range(3))
    key_mask = torch.ones(2, 40, dtype=torch.bool)
    key_mask[1, -7:] = False
    grad = torch.randn(2, 3, 40, 16)
    calls = []
    spy = luna_kernel.native_channel_features
    monkeypatch.setattr(luna_kernel, "native_channel_features", lambda *a, **kw: calls.append(1) or spy(*a, **kw))
    results = []
    for setting in ("1", "0"):
        monkeypatch.setenv(native.DISABLE_VARIABLE, setting)
        layer = luna_layer(**options)
        out = layer(q, k, v, key_mask=key_mask)
        results.append([out.detach(), *torch.autograd.grad(out, [q, k, v, *layer.parameters()], grad)])
    assert len(calls) == 2  # queries and keys, with the native path on; none with it off
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # measured below 1e-6


def test_native_forward_is_one_call_per_map(kernel, monkeypatch):
    q, k, v = (torch.randn(1, 3, 64, 16) for _ in range(3))
    counts = {}
    for setting in ("1", "0"):
        monkeypatch.setenv(native.DISABLE_VARIABLE, setting)
        layer = luna_layer()
        with torch.no_grad():
            layer(q, k, v)  # builds and caches the tables
            with AtenOpCounter() as ops:
                layer(q, k, v)
        counts[setting] = ops.total
    # measured 31 native, 63 PyTorch (two maps: the grid search, gathers, multiply-add, relu and the norm)
    assert counts["1"] <= counts["0"] - 25, counts


def split_heads(batch: int, tokens: int, heads: int, d: int, seed: int = 0) -> torch.Tensor:
    """[B, H, N, d] as the adapters pass it: a view of the heads split from [B, N, H*d]."""
    return torch.randn(batch, tokens, heads, d, generator=torch.Generator().manual_seed(seed)).transpose(1, 2)


@pytest.mark.parametrize("projections, channels, norm_eps", [
    (8, 8, None),  # the paper's form: one vector of eight projections per row
    (16, 2, FEATURE_NORM_EPS),  # two vectors
    (5, 3, 0.5),  # M not a multiple of 8: the row-by-row sums
])
@pytest.mark.parametrize("threads", [1, 3])
def test_the_projection_inside_the_pass_matches_projecting_first(kernel, projections, channels, norm_eps, threads):
    """x [B, H, N, d] strided as a model splits heads, B * H * N = 222 rows: full blocks, a part block, and
    rows left over after the groups of four; float64 reference of x W^T + b through the MLP bank."""
    psi, linear = bank(channels, "random"), torch.nn.Linear(16, projections)
    x = 2 * split_heads(2, 37, 3, 16)
    scale = projections**-0.5
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with torch.no_grad():
            out = luna_kernel.projected_channel_features_of(psi, linear.weight, linear.bias, x, scale=scale,
                                                            norm_eps=norm_eps)[0]
            expected = reference(bank(channels, "random").double(), x.double() @ linear.weight.double().T
                                 + linear.bias.double(), scale, norm_eps)
    finally:
        torch.set_num_threads(before)
    assert out.shape == (2, 3, 37, projections, channels) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=2e-5)


def test_the_projection_inside_the_pass_is_for_inference_only(kernel):
    psi, linear, x = bank(8, "random"), torch.nn.Linear(16, 8), split_heads(1, 9, 2, 16)
    assert luna_kernel.projected_channel_features_of(psi, linear.weight, linear.bias, x) is None  # W records
    with torch.no_grad():
        assert luna_kernel.projected_channel_features_of(psi, linear.weight, linear.bias, x.double()) is None
        assert luna_kernel.projected_channel_features_of(psi, linear.weight, linear.bias, x) is not None


def test_the_paper_layer_projects_inside_the_pass_at_inference(kernel, monkeypatch):
    q, k, v = (split_heads(2, 40, 3, 16, seed) for seed in range(3))
    key_mask = torch.ones(2, 40, dtype=torch.bool)
    key_mask[1, -7:] = False
    calls, spy = [], luna_kernel.native_projected_channel_features
    monkeypatch.setattr(luna_kernel, "native_projected_channel_features",
                        lambda *a, **kw: calls.append(True) or spy(*a, **kw))
    outs, counts = [], []
    for setting in ("1", "0"):
        monkeypatch.setenv(native.DISABLE_VARIABLE, setting)
        layer = luna_layer(**PAPER_OPTIONS)
        with torch.no_grad():
            outs.append(layer(q, k, v, key_mask=key_mask))
            with AtenOpCounter() as ops:
                layer(q, k, v, key_mask=key_mask)
        counts.append(ops.total)
    assert calls == [True] * 4  # queries and keys with W, twice, with the native path on; none with it off
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert counts[0] <= counts[1] - 60, counts  # measured 30 and 110


def test_without_a_compiler_the_pytorch_path_runs_and_says_why(monkeypatch):
    monkeypatch.setattr(native, "compiler", lambda: None)
    native.forget()
    try:
        assert luna_native.library() is None
        assert "no C compiler" in native.unavailable_reason(luna_native.SOURCE)
        assert not luna_kernel.native_kernel_applies(8, 8, torch.float32, torch.device("cpu"))
        psi = bank(2, "exp")
        u = torch.randn(2, 5, 8)
        torch.testing.assert_close(channel_features_of(psi, u)[0], psi(u), rtol=0, atol=2e-6)
    finally:
        native.forget()


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(native.DISABLE_VARIABLE, "0")
    assert luna_native.library() is None
    assert native.unavailable_reason(luna_native.SOURCE) == f"{native.DISABLE_VARIABLE}=0"
    result = CliRunner().invoke(app, ["methods", "--details"])  # where a user sees it
    shown = " ".join(result.output.split())
    assert result.exit_code == 0 and f"native channel kernel (CPU, float32): off: {native.DISABLE_VARIABLE}=0" in shown


@pytest.fixture
def c_file(tmp_path, monkeypatch):
    """A C file of the given text in tmp_path, built into tmp_path/cache; returns (source, built folder)."""
    if native.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv(native.CACHE_VARIABLE, str(tmp_path / "cache"))
    yield lambda name, text: ((tmp_path / name).write_text(text) and tmp_path / name, tmp_path / "cache" / "native")
    native.forget()


def test_a_source_that_does_not_compile_gives_a_reason_and_leaves_no_file(c_file):
    source, built = c_file("broken.c", "int broken( {\n")
    assert native.load_library(source) is None
    reason = native.unavailable_reason(source)
    assert reason.startswith("broken.c not built: ") and "error" in reason, reason
    assert list(built.iterdir()) == []


def test_the_library_is_cached_by_its_source(c_file):
    source, built = c_file("twice.c", "int twice(int x) { return 2 * x; }\n")
    lib = native.load_library(source)
    assert lib is not None and lib.twice(x=21) == 42
    assert [p.suffix for p in built.iterdir()] == [".so"]
    c_file("twice.c", "int twice(int x) { return x + x; }\n")
    native.forget()
    assert native.load_library(source).twice(x=4) == 8
    assert len(list(built.iterdir())) == 2  # a changed source is built anew


def test_native_functions_take_the_types_and_names_their_c_definitions_declare(c_file):
    source, _ = c_file("mixed.c", "#include <stdint.h>\nstatic int hidden(void) { return 1; }\n"
                                  "void mixed(int64_t big, float scale, const double *in,\n"
                                  "           double *out, int32_t count) {\n"
                                  "    for (int32_t i = 0; i < count; i++) out[i] = in[i] * scale + (double)big;\n"
                                  "}\nfloat half(float x) { return x / 2; }\n")
    declared = native.declared_functions(source)
    assert sorted(declared) == ["half", "mixed"]  # static functions are not exported
    assert declared["mixed"].parameters == ("big", "scale", "in", "out", "count")
    lib = native.load_library(source)
    values, out = torch.tensor([1.0, 2.0], dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    lib.mixed(**{"in": values.data_ptr()}, out=out.data_ptr(), count=2, scale=0.5, big=2**40)  # any order
    assert out.tolist() == [2**40 + 0.5, 2**40 + 1.0]  # int64 and float arrive as declared
    assert lib.half(x=3.0) == 1.5  # the return type too
    with pytest.raises(TypeError, match=r"missing \['count'\], unknown \['counts'\]; its C parameters are big, scale"):
        lib.mixed(**{"in": values.data_ptr()}, out=out.data_ptr(), counts=2, scale=0.5, big=1)
    with pytest.raises(TypeError):
        lib.half(3.0)  # positional calls are refused: arguments go by their C names


def test_a_c_type_without_a_ctypes_type_is_named(c_file):
    source, _ = c_file("odd.c", "void odd(long double x) { (void)x; }\n")
    with pytest.raises(TypeError, match="odd.c: odd.*'long double'"):
        native.declared_functions(source)


def test_every_shipped_kernel_declares_its_functions():
    sources = sorted(Path(luna_native.__file__).parents[1].rglob("*.c"))
    assert len(sources) == 4
    declared = {source.name: native.declared_functions(source) for source in sources}
    assert declared["token_products.c"]["produced_product"].parameters[:4] == ("produce", "state", "w", "c")
    assert all(len(functions) >= 2 for functions in declared.values())


def test_the_build_for_this_cpu_computes_bit_for_bit_what_the_portable_build_does(kernel, tmp_path, monkeypatch):
    """-march=native may vectorise, never reorder or fuse float operations (-ffp-contract=off): the same
    values and gradients to the bit, so a model behaves the same on every machine's build."""
    monkeypatch.setenv(native.CACHE_VARIABLE, str(tmp_path))
    results = []
    try:
        for flags in (native.TUNED_FLAGS, ()):
            monkeypatch.setattr(native, "TUNED_FLAGS", flags)
            native.forget()
            assert luna_native.library() is not None
            run = []
            for init, projections, channels, norm_eps in (("exp", 64, 2, FEATURE_NORM_EPS), ("random", 8, 8, None)):
                psi = bank(channels, init)
                # 294 rows: the last block of 16 (M = 64) ends in rows that the four-row vector paths leave over
                u = (2 * torch.randn(2, 3, 49, projections, generator=torch.Generator().manual_seed(1))).requires_grad_()
                out = channel_features_of(psi, u, scale=projections**-0.5, norm_eps=norm_eps)[0]
                run += values_and_grads(psi, u, out, torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
                linear = torch.nn.Linear(16, projections)
                with torch.no_grad():  # the projection inside the pass: its sums over x in a fixed order too
                    run += luna_kernel.projected_channel_features_of(psi, linear.weight, linear.bias,
                                                                     split_heads(2, 50, 3, 16), norm_eps=norm_eps)
            results.append(run)
    finally:
        native.forget()
    assert all(torch.equal(a, b) for a, b in zip(*results)), [float((a - b).abs().max()) for a, b in zip(*results)]


def test_flags_the_compiler_refuses_fall_back_to_the_portable_build(c_file, monkeypatch):
    monkeypatch.setattr(native, "TUNED_FLAGS", ("-fno-such-option-luna-convert",))
    source, built = c_file("plain.c", "int three(void) { return 3; }\n")
    lib = native.load_library(source)
    assert lib is not None and lib.three() == 3
    assert len(list(built.iterdir())) == 1


def test_a_tuned_library_is_cached_per_cpu(c_file, monkeypatch):
    real = native.cpu_identity()
    assert real.startswith(platform.machine()) and ("model name" in real or "CPU part" in real or not Path("/proc/cpuinfo").exists())
    source, built = c_file("tuned.c", "int four(void) { return 4; }\n")
    for cpu in ("cpu one", "cpu two", "cpu one"):
        monkeypatch.setattr(native, "cpu_identity", lambda cpu=cpu: cpu)
        native.forget()
        assert native.load_library(source).four() == 4
    assert len(list(built.iterdir())) == 2  # one build per CPU, the first reused


def test_limits_send_large_banks_to_the_pytorch_path():
    assert luna_native.fits(64, 2) and luna_native.fits(8, 8)
    assert not luna_native.fits(64, luna_native.MAX_CHANNELS + 1)
    assert not luna_native.fits(luna_native.BLOCK + 1, 1)
    assert not luna_native.fits(1024, 16)  # M * L over MAX_ROW
    assert not luna_kernel.native_kernel_applies(8, 8, torch.float64, torch.device("cpu"))
    assert Path(luna_native.SOURCE).is_file()
