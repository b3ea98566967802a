"""The attention-layer benchmark: softmax (SDPA), eager softmax and every method's layer against N."""

from __future__ import annotations

import time
from typing import Callable, Sequence

from ...conversion import resolve_options
from ...errors import LunaConvertError, unknown_name
from ...layers.attention import LinearAttention
from ...linear_methods import METHODS, AttentionOptions
from ...run.recipes import parse_override
from .timing import Clock, forward_ops, loglog_slope, median_ms, peak_memory, round_robin

DEFAULT_LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (128, 256)
HEADS, HEAD_DIM, BATCH = 12, 64, 1
SOFTMAX = "softmax"  # torch scaled_dot_product_attention (flash kernel where available)
SOFTMAX_EAGER = "softmax-eager"  # explicit N x N softmax, a reference for memory
LUNA_DWC = "luna:dwc=true"  # LUNA with the paper's DWC branch (off by default), to show what it costs
SLOPE_RANGE = (1024, 16384)
OPTION_SEPARATOR = ":"  # hedgehog:window=64 is Hedgehog's layer with method option window = 64
BENCH_DTYPES = {"float32": "float32", "bf16": "bfloat16"}  # --dtype -> torch dtype name


def _eager_softmax(q, k, v):
    """softmax(q k^T / sqrt(d)) v with the N x N matrix in memory (what eager attention in a model does)."""
    import torch

    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def layer_variant(name: str) -> tuple[str, AttentionOptions]:
    """A bench layer name -> (method, its options object, validated once): a method, or a method
    with options, ``METHOD:NAME=VALUE[:NAME=VALUE]`` (``hedgehog:window=64``); values read as ``--set`` reads
    them. An unknown method or option, or a bad value, is a LunaConvertError."""
    method, *pairs = name.split(OPTION_SEPARATOR)
    if method not in METHODS:
        raise unknown_name("method", method, METHODS)
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not (key and sep and value):
            raise LunaConvertError(f"bench method {name!r}: give options as METHOD:NAME=VALUE, e.g. hedgehog:window=64")
        option, value = parse_override(pair)
        options[option] = value
    return method, resolve_options(method, options)  # ConversionError (a LunaConvertError) on a bad option


def layer_modules(methods: Sequence[str], device, heads: int, head_dim: int):
    """name -> callable(q, k, v) for softmax (SDPA), eager softmax and every linear method; and the modules."""
    import torch.nn.functional as F

    layers, modules = {}, {}
    for name in methods:
        if name == SOFTMAX:
            layers[name] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v)
            continue
        if name == SOFTMAX_EAGER:
            layers[name] = _eager_softmax
            continue
        base, options = layer_variant(name)
        module = LinearAttention(base, head_dim, heads, head_dim**-0.5, options=options).to(device)
        layers[name] = module
        modules[name] = module
    return layers, modules


def bench_layers(lengths: Sequence[int], methods: Sequence[str], device, repeats: int, warmup: int,
                 heads: int = HEADS, head_dim: int = HEAD_DIM, batch: int = BATCH, memory: bool = True,
                 eager_max_length: int = 4096, budget_s: float = 60.0, cpu_time: bool = False,
                 count_ops: bool = True, dtype: str = "float32", log: Callable[[str], None] = print) -> dict:
    """Attention-layer time and memory against N; ``methods`` must start with softmax.

    ``softmax-eager`` (if listed) runs only for N <= ``eager_max_length``. When one
    round over all methods takes so long that ``repeats`` rounds would exceed
    ``budget_s``, fewer rounds are timed (never fewer than 3, or ``repeats`` if smaller).
    ``dtype`` "bf16": inputs in bfloat16 and every layer under bf16 autocast (the linear-attention sums
    still accumulate in float32, ``ops.linear``), as a bf16 model runs on a GPU.
    """
    import contextlib

    import torch

    if dtype not in BENCH_DTYPES:
        raise unknown_name("dtype", str(dtype), list(BENCH_DTYPES))
    tensor_dtype = getattr(torch, BENCH_DTYPES[dtype])

    def autocast():
        if tensor_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=tensor_dtype)

    torch.manual_seed(0)
    layers, modules = layer_modules(methods, device, heads, head_dim)
    clock = Clock(device, cpu_time)
    rows = []
    for n in lengths:
        here = [m for m in methods if m != SOFTMAX_EAGER or n <= eager_max_length]
        q, k, v = (torch.randn(batch, heads, n, head_dim, device=device, dtype=tensor_dtype) for _ in range(3))
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        grad = torch.randn(batch, heads, n, head_dim, device=device, dtype=tensor_dtype)

        def forward(layer):
            def run():
                with torch.no_grad(), autocast():
                    layer(q, k, v)
            return run

        def train_step(layer):
            def run():
                with autocast():
                    out = layer(qg, kg, vg)
                out.backward(grad.to(out.dtype))
            return run

        def zero(name):
            for x in (qg, kg, vg):
                x.grad = None
            if name in modules:
                modules[name].zero_grad(set_to_none=True)

        t0 = time.perf_counter()
        fwd = round_robin({m: forward(layers[m]) for m in here}, clock, repeats, warmup, zero, budget_s)
        fb = round_robin({m: train_step(layers[m]) for m in here}, clock, repeats, warmup, zero, budget_s)
        if memory:
            runs = {}
            for m in here:
                runs[(m, "fwd")] = forward(layers[m])
                runs[(m, "fwd_bwd")] = train_step(layers[m])
            peaks = peak_memory(runs, device, setup=lambda key: zero(key[0]))
            zero(here[0])
        for m in here:
            row = {"method": m, "n": n, "fwd_ms": median_ms(fwd[m]), "fwd_bwd_ms": median_ms(fb[m]),
                   "fwd_runs_ms": [1000 * t for t in fwd[m]], "fwd_bwd_runs_ms": [1000 * t for t in fb[m]]}
            if count_ops:
                ops = forward_ops(forward(layers[m]))
                row["fwd_ops"], row["fwd_view_ops"] = ops.total, ops.views
            if memory:
                row["fwd_peak_mb"] = peaks[(m, "fwd")] / 2**20
                row["fwd_bwd_peak_mb"] = peaks[(m, "fwd_bwd")] / 2**20
            rows.append(row)
        log(f"layers N={n}: " + ", ".join(f"{m} {median_ms(fwd[m]):.1f}/{median_ms(fb[m]):.1f} ms" for m in here)
            + f"  (fwd/fwd+bwd, {len(fwd[here[0]])}+{len(fb[here[0]])} runs, {time.perf_counter() - t0:.0f} s)")
        del q, k, v, qg, kg, vg, grad

    slopes = _add_ratios(rows, methods)
    return {"config": {"heads": heads, "head_dim": head_dim, "batch": batch, "dtype": dtype,
                       "lengths": list(lengths), "methods": list(methods), "repeats": repeats, "warmup": warmup,
                       "eager_max_length": eager_max_length, "budget_s": budget_s},
            "results": rows, "slopes": slopes}


def _add_ratios(rows: list[dict], methods: Sequence[str]) -> dict:
    """Adds to each row its ratios against softmax (SDPA) in the same run, memory also against eager softmax;
    returns each method's log-log slopes of time against N."""
    by = {(r["method"], r["n"]): r for r in rows}
    for r in rows:
        ref, eager = by.get((SOFTMAX, r["n"])), by.get((SOFTMAX_EAGER, r["n"]))
        if ref is not None and r["method"] != SOFTMAX:
            r["fwd_speedup_vs_softmax"] = ref["fwd_ms"] / r["fwd_ms"]
            r["fwd_bwd_speedup_vs_softmax"] = ref["fwd_bwd_ms"] / r["fwd_bwd_ms"]
            if "fwd_bwd_peak_mb" in r and ref.get("fwd_bwd_peak_mb"):
                r["fwd_bwd_memory_vs_softmax"] = r["fwd_bwd_peak_mb"] / ref["fwd_bwd_peak_mb"]
        if eager is not None and r["method"] not in (SOFTMAX, SOFTMAX_EAGER) and eager.get("fwd_bwd_peak_mb"):
            r["fwd_bwd_memory_vs_softmax_eager"] = r["fwd_bwd_peak_mb"] / eager["fwd_bwd_peak_mb"]
    slopes = {}
    for m in methods:
        entry = {}
        for key in ("fwd_ms", "fwd_bwd_ms"):
            s, used = loglog_slope({r["n"]: r[key] for r in rows if r["method"] == m}, *SLOPE_RANGE)
            entry[key.replace("_ms", "")] = s
            entry["lengths"] = used
        slopes[m] = entry
    return slopes
