"""``luna-convert bench``: how much linear attention pays off, measured.

One entry point, :func:`run_benchmark`. It measures

1. **attention layers** (12 heads x 64 dims, batch 1, float32): softmax via
   ``torch.nn.functional.scaled_dot_product_attention``, an eager softmax with
   the N x N matrix (``softmax-eager``, short lengths only, a memory reference)
   and every method in ``luna_convert.METHODS`` as a
   :class:`~luna_convert.layers.attention.LinearAttention` built with the method's
   feature map and defaults (plus ``luna-nodwc``, LUNA's feature maps and
   linear attention without the DWC branch). For each
   sequence length: forward time (no grad), forward+backward time (q, k, v and
   the layer's parameters get gradients), the peak tensor memory of each, and the
   aten operator calls of one forward (``tools.op_count``: what sets the time of
   small inputs); the log-log slope of time against N between N = 1024 and 16384.
2. **whole models**, original vs converted (``luna_convert.convert``), random
   init: ViT-B/16 (``transformers.ViTConfig`` base sizes) inference at several
   image sizes, BERT-base (``BertConfig`` base, ``max_position_embeddings``
   raised to the longest length) inference at several lengths, and one
   BERT-base training step (batch 16 x 128 tokens, AdamW).

Every time is the median of ``repeats`` runs after warm-up; the candidates of
one comparison run round-robin (A, B, A, B, ...) so that a change in machine
load hits all of them alike, and every ratio is taken within the same run.
Times are wall clock (CUDA events on a GPU), or with ``timer="cpu"`` the CPU
time of a single thread, for machines shared with other work.

Memory: on CUDA, ``torch.cuda.max_memory_allocated`` minus the memory held
before the step. On the CPU, one extra run of each step inside one
``torch.profiler.profile(profile_memory=True)`` session, each in its own
``record_function`` range: the profiler reports every allocation and free of
the CPU allocator (size and time); the running sum of those events is the live
tensor memory, and a step's peak is its maximum inside the step's range minus
its value when the range began. Inputs and parameters that exist before the
step are not counted; gradients of the inputs are.

Heavy imports (torch, transformers, matplotlib, rich) happen inside functions.
"""

from __future__ import annotations

import io
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

from ..errors import LunaConvertError, unknown_name
from ..fileio import atomic_write_bytes, atomic_write_json, atomic_write_text
from ..conversion import convert, resolve_options
from ..layers.attention import LinearAttention
from ..linear_methods import METHODS, luna_native, sorting_native
from ..ops import exp_rows
from ..ops.dwc import native_status as dwc_native_status
from ..ops.products import native_status as products_native_status
from ..run.recipes import parse_override
from .background_load import background_load as run_background_load
from .heap import heap_policy
from .op_count import AtenOpCounter

DEFAULT_LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (128, 256)
HEADS, HEAD_DIM, BATCH = 12, 64, 1
SOFTMAX = "softmax"  # torch scaled_dot_product_attention (flash kernel where available)
SOFTMAX_EAGER = "softmax-eager"  # explicit N x N softmax, a reference for memory
LUNA_CORE = "luna-nodwc"  # LUNA feature maps + linear attention, without the DWC branch
SLOPE_RANGE = (1024, 16384)
OPTION_SEPARATOR = ":"  # hedgehog:window=64 is Hedgehog's layer with method option window = 64
BENCH_DTYPES = {"float32": "float32", "bf16": "bfloat16"}  # --dtype -> torch dtype name

VIT_SIZES = (224, 512, 1024)
BERT_LENGTHS = (128, 512, 1024, 2048, 4096)
BERT_TRAIN = (16, 128)  # batch, tokens


# --------------------------------------------------------------------------- timing and memory
class _Clock:
    """Seconds for one call: CUDA events + synchronize on a GPU; on the CPU ``perf_counter`` (wall
    clock) or, with ``cpu_time=True`` (single-threaded runs), the calling thread's CPU time, which
    leaves out the time other processes on a shared machine take the core away."""

    def __init__(self, device, cpu_time: bool = False):
        import torch

        self.device = device
        self.cuda = device.type == "cuda"
        self.torch = torch
        self.now = time.thread_time if cpu_time and not self.cuda else time.perf_counter

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            torch = self.torch
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(self.device)
            return start.elapsed_time(end) / 1000.0
        t0 = self.now()
        fn()
        return self.now() - t0


def _round_robin(fns: dict[str, Callable[[], object]], clock: _Clock, repeats: int, warmup: int,
                 setup: Callable[[str], None] | None = None, budget_s: float | None = None) -> dict[str, list[float]]:
    """Times every fn ``repeats`` times after ``warmup`` untimed rounds, interleaved A, B, A, B, ...

    With ``budget_s``, a round that is slow (measured on the last warm-up round)
    cuts the timed rounds to what fits the budget, but to no fewer than 3.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    rounds, rnd = warmup + repeats, 0
    while rnd < rounds:
        start = time.perf_counter()
        for name, fn in fns.items():
            if setup is not None:
                setup(name)
            t = clock(fn)
            if rnd >= warmup:
                times[name].append(t)
        if budget_s is not None and rnd == warmup - 1:
            took = time.perf_counter() - start
            if took * repeats > budget_s:
                rounds = warmup + min(repeats, max(3, int(budget_s // max(took, 1e-9))))
        rnd += 1
    return times


def peak_memory(fns: dict[str, Callable[[], object]], device, setup: Callable[[str], None] | None = None) -> dict[str, int]:
    """Peak bytes of tensor memory each fn allocates (net of frees) while it runs, one run each.

    CUDA: ``max_memory_allocated`` relative to what was allocated before.
    CPU: all fns run in one ``torch.profiler`` session with ``profile_memory=True``,
    each inside a ``record_function`` range; the profiler logs every allocation and
    free of the CPU allocator (bytes, time). The running sum of those events is
    the live memory; a fn's peak is its maximum inside the fn's range minus its
    value when the range began.
    """
    import torch

    peaks: dict[str, int] = {}
    if device.type == "cuda":
        for name, fn in fns.items():
            if setup is not None:
                setup(name)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            fn()
            torch.cuda.synchronize(device)
            peaks[name] = int(torch.cuda.max_memory_allocated(device) - before)
        return peaks
    from torch.profiler import ProfilerActivity, profile, record_function

    # Kineto otherwise prints start/stop lines and "gpuGetDeviceCount failed" on CPU-only machines.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    labels = {name: f"luna-bench-memory/{i}" for i, name in enumerate(fns)}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for name, fn in fns.items():
            if setup is not None:
                setup(name)
            with record_function(labels[name]):
                fn()
    events = prof.profiler.kineto_results.events()
    memory = sorted(((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type().name == "CPU"))
    ranges = {e.name(): (e.start_ns(), e.end_ns()) for e in events if e.name() in labels.values()}
    for name, label in labels.items():
        start, end = ranges[label]
        live = base = peak = 0
        for t, nbytes in memory:
            if t > end:
                break
            if t < start:
                live += nbytes
                base = peak = live
                continue
            live += nbytes
            peak = max(peak, live)
        peaks[name] = int(peak - base)
    return peaks


def forward_ops(fn: Callable[[], object]) -> AtenOpCounter:
    """The aten operator calls of one run of ``fn`` (after the runs already timed: caches are warm)."""
    with AtenOpCounter() as ops:
        fn()
    return ops


VIEWS_IN_BRACKETS = "in brackets, those that only make a view (no data moved)"


def _operator_calls_cell(row: dict) -> str:
    """A layer's calls per forward for a table, "37 (17)": all of them, and in brackets the views among them
    (rows of bench.json written before views were counted show the total alone)."""
    views = row.get("fwd_view_ops")
    return str(row["fwd_ops"]) if views is None else f"{row['fwd_ops']} ({views})"


def _median_ms(times: Sequence[float]) -> float:
    return 1000.0 * statistics.median(times)


def _slope(points: dict[int, float], lo: int, hi: int) -> tuple[float | None, list[int]]:
    """Least-squares slope of log(time) on log(N) over the lengths in [lo, hi] (all lengths if < 2 there)."""
    ns = sorted(n for n in points if lo <= n <= hi and points[n] > 0)
    if len(ns) < 2:
        ns = sorted(n for n in points if points[n] > 0)
    if len(ns) < 2:
        return None, ns
    xs = [math.log(n) for n in ns]
    ys = [math.log(points[n]) for n in ns]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx, ns


# --------------------------------------------------------------------------- attention layers
def _eager_softmax(q, k, v):
    """softmax(q k^T / sqrt(d)) v with the N x N matrix in memory (what eager attention in a model does)."""
    import torch

    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def layer_variant(name: str) -> tuple[str, dict]:
    """A bench layer name -> (method, options): a method, ``luna-nodwc`` (LUNA without DWC), or a method
    with options, ``METHOD:NAME=VALUE[:NAME=VALUE]`` (``hedgehog:window=64``); values read as ``--set`` reads
    them. An unknown method or option, or a bad value, is a LunaConvertError."""
    if name == LUNA_CORE:
        return "luna", {"dwc": False}
    method, *pairs = name.split(OPTION_SEPARATOR)
    if method not in METHODS:
        raise unknown_name("method", method, [*METHODS, LUNA_CORE])
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not (key and sep and value):
            raise LunaConvertError(f"bench method {name!r}: give options as METHOD:NAME=VALUE, e.g. hedgehog:window=64")
        option, value = parse_override(pair)
        options[option] = value
    resolve_options(method, options)  # ConversionError (a LunaConvertError) on a bad option
    return method, options


def _layer_modules(methods: Sequence[str], device, heads: int, head_dim: int):
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
        module = LinearAttention(base, head_dim, heads, head_dim**-0.5, **options).to(device)
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
    layers, modules = _layer_modules(methods, device, heads, head_dim)
    clock = _Clock(device, cpu_time)
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
        fwd = _round_robin({m: forward(layers[m]) for m in here}, clock, repeats, warmup, zero, budget_s)
        fb = _round_robin({m: train_step(layers[m]) for m in here}, clock, repeats, warmup, zero, budget_s)
        if memory:
            runs = {}
            for m in here:
                runs[(m, "fwd")] = forward(layers[m])
                runs[(m, "fwd_bwd")] = train_step(layers[m])
            peaks = peak_memory(runs, device, setup=lambda key: zero(key[0]))
            zero(here[0])
        for m in here:
            row = {"method": m, "n": n, "fwd_ms": _median_ms(fwd[m]), "fwd_bwd_ms": _median_ms(fb[m]),
                   "fwd_runs_ms": [1000 * t for t in fwd[m]], "fwd_bwd_runs_ms": [1000 * t for t in fb[m]]}
            if count_ops:
                ops = forward_ops(forward(layers[m]))
                row["fwd_ops"], row["fwd_view_ops"] = ops.total, ops.views
            if memory:
                row["fwd_peak_mb"] = peaks[(m, "fwd")] / 2**20
                row["fwd_bwd_peak_mb"] = peaks[(m, "fwd_bwd")] / 2**20
            rows.append(row)
        log(f"layers N={n}: " + ", ".join(f"{m} {_median_ms(fwd[m]):.1f}/{_median_ms(fb[m]):.1f} ms" for m in here)
            + f"  (fwd/fwd+bwd, {len(fwd[here[0]])}+{len(fb[here[0]])} runs, {time.perf_counter() - t0:.0f} s)")
        del q, k, v, qg, kg, vg, grad

    # Ratios against softmax (SDPA) in the same run, memory also against eager softmax; log-log slopes.
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
            s, used = _slope({r["n"]: r[key] for r in rows if r["method"] == m}, *SLOPE_RANGE)
            entry[key.replace("_ms", "")] = s
            entry["lengths"] = used
        slopes[m] = entry
    return {"config": {"heads": heads, "head_dim": head_dim, "batch": batch, "dtype": dtype,
                       "lengths": list(lengths), "methods": list(methods), "repeats": repeats, "warmup": warmup,
                       "eager_max_length": eager_max_length, "budget_s": budget_s},
            "results": rows, "slopes": slopes}


# --------------------------------------------------------------------------- whole models
def _model_configs(quick: bool):
    """(ViT config kwargs, BERT config kwargs, ViT sizes, BERT lengths, BERT train (batch, tokens))."""
    if quick:  # tiny models: exercises every code path in seconds
        small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
        return (dict(small, patch_size=8), dict(small, vocab_size=1000), (32, 64), (64, 128), (2, 32))
    return {}, {}, VIT_SIZES, BERT_LENGTHS, BERT_TRAIN


def _pair(build, method: str, device):
    """(original, converted) with identical weights; the converted one is ``convert(copy, method)``."""
    import copy

    original = build().to(device)
    converted = copy.deepcopy(original)
    convert(converted, method)
    return original, converted


def _compare(original: Callable[[], object], converted: Callable[[], object], clock: _Clock, repeats: int, warmup: int,
             **fields) -> dict:
    """Round-robin timing of the original and the converted model; a result row."""
    times = _round_robin({"original": original, "converted": converted}, clock, repeats, warmup)
    row = {**fields, "original_ms": _median_ms(times["original"]), "converted_ms": _median_ms(times["converted"])}
    row["ratio"] = row["converted_ms"] / row["original_ms"]
    row["original_runs_ms"] = [1000 * t for t in times["original"]]
    row["converted_runs_ms"] = [1000 * t for t in times["converted"]]
    return row


def _inference(model, inputs: dict) -> Callable[[], None]:
    """One forward of ``model(**inputs)`` in eval mode, without autograd."""
    import torch

    def run():
        model.eval()
        with torch.inference_mode():
            model(**inputs)
    return run


def _train_step(model, batch: dict) -> Callable[[], None]:
    """One training step: forward, ``.loss``, backward, AdamW step (dropout on, as in finetuning)."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def run():
        model.train()
        optimizer.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        optimizer.step()
    return run


def bench_models(device, repeats: int, warmup: int, quick: bool = False, method: str = "luna",
                 vit_sizes: Sequence[int] | None = None, bert_lengths: Sequence[int] | None = None,
                 cpu_time: bool = False, log: Callable[[str], None] = print) -> dict:
    """Original vs converted (random init): ViT-B/16 and BERT-base inference, one BERT-base train step."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertModel, ViTConfig, ViTModel

    vit_kw, bert_kw, sizes, lengths, (train_batch, train_tokens) = _model_configs(quick)
    sizes = tuple(vit_sizes or sizes)
    lengths = tuple(bert_lengths or lengths)
    clock = _Clock(device, cpu_time)
    out: dict = {"method": method, "vit": [], "bert": [], "bert_train": None}
    torch.manual_seed(0)

    def report(label: str, row: dict, t0: float) -> None:
        log(f"{label}: original {row['original_ms']:.0f} ms, converted {row['converted_ms']:.0f} ms"
            f" (x{row['ratio']:.2f})  ({time.perf_counter() - t0:.0f} s)")

    for size in sizes:
        t0 = time.perf_counter()
        config = ViTConfig(image_size=size, **vit_kw)
        original, converted = _pair(lambda: ViTModel(config, add_pooling_layer=False).eval(), method, device)
        inputs = {"pixel_values": torch.randn(1, 3, size, size, device=device)}
        tokens = (size // config.patch_size) ** 2 + 1
        row = _compare(_inference(original, inputs), _inference(converted, inputs), clock, repeats, warmup,
                       image_size=size, tokens=tokens, batch=1)
        out["vit"].append(row)
        report(f"ViT {size}px ({tokens} tokens)", row, t0)
        del original, converted

    max_pos = max([*lengths, train_tokens, 512])
    for n in lengths:
        t0 = time.perf_counter()
        config = BertConfig(max_position_embeddings=max_pos, **bert_kw)
        original, converted = _pair(lambda: BertModel(config, add_pooling_layer=False).eval(), method, device)
        inputs = {"input_ids": torch.randint(0, config.vocab_size, (1, n), device=device)}
        row = _compare(_inference(original, inputs), _inference(converted, inputs), clock, repeats, warmup, tokens=n, batch=1)
        out["bert"].append(row)
        report(f"BERT {n} tokens", row, t0)
        del original, converted

    # One training step: forward, loss, backward, AdamW step (dropout on, as in finetuning).
    t0 = time.perf_counter()
    config = BertConfig(max_position_embeddings=max_pos, num_labels=2, **bert_kw)
    original, converted = _pair(lambda: BertForSequenceClassification(config).train(), method, device)
    batch = {"input_ids": torch.randint(0, config.vocab_size, (train_batch, train_tokens), device=device),
             "attention_mask": torch.ones(train_batch, train_tokens, dtype=torch.long, device=device),
             "labels": torch.randint(0, 2, (train_batch,), device=device)}

    row = _compare(_train_step(original, batch), _train_step(converted, batch), clock, repeats, warmup, batch=train_batch, tokens=train_tokens)
    out["bert_train"] = row
    report(f"BERT train step {train_batch}x{train_tokens}", row, t0)
    return out


LONG_LENGTHS = (1024, 2048, 4096, 8192)
DINO_SIZES = (224, 518, 1024)  # DINOv2 is trained at 518 px; 224 and 1024 interpolate its positions
LONG_VARIANTS = ("original", "converted global", "converted all")  # softmax; global layers linear; every layer


def _ms_and_ratio(cell: dict, key: str) -> str:
    """``"1234 (x0.81)"`` for a long-model cell's value and its ratio to the original; "-" where not measured."""
    if key not in cell:
        return "-"
    ratio = cell.get(f"{key}_ratio")
    return f"{cell[key]:.0f}" + (f" (x{ratio:.2f})" if ratio is not None else "")


def _available_memory_bytes(device) -> int | None:
    """Memory a new allocation can still get: CUDA's free memory, or Linux's MemAvailable (None elsewhere)."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# A training step's peak at the next length is guessed as the last one's, scaled linearly in N (what the
# original's flash SDPA and the linear layers need), with this margin; above what is free, the step is skipped.
TRAIN_MEMORY_MARGIN = 1.3


def _train_step_would_not_fit(last_peak: tuple[int, float] | None, n: int, device) -> str | None:
    """Why the training step at ``n`` tokens is skipped, or None: ``last_peak`` (tokens, bytes) scaled to ``n``,
    with TRAIN_MEMORY_MARGIN, against the free memory (no previous step, or no way to read it: never skipped)."""
    available = _available_memory_bytes(device) if last_peak else None
    if available is None:
        return None
    need = last_peak[1] * n / last_peak[0]
    if need * TRAIN_MEMORY_MARGIN <= available:
        return None
    return (f"needs about {need / 2**30:.1f} GiB (the {last_peak[0]}-token step's peak, linear in N), "
            f"{available / 2**30:.1f} GiB free")


def _time_train_step(model, batch: dict, clock, repeats: int, warmup: int, device, memory: bool) -> dict:
    """``train_ms`` (median step time) and, with ``memory``, ``train_peak_mb`` (a fresh optimizer's first step);
    each optimizer and the gradients are freed before the next, so one model's training state is alive at a time."""
    import gc

    def release() -> None:
        model.zero_grad(set_to_none=True)
        gc.collect()

    step = _train_step(model, batch)
    cell = {"train_ms": _median_ms(_round_robin({"step": step}, clock, repeats, warmup)["step"])}
    del step  # its optimizer state
    release()
    if memory:
        cell["train_peak_mb"] = peak_memory({"step": _train_step(model, batch)}, device)["step"] / 2**20
        release()
    return cell


def bench_long_models(device, repeats: int, warmup: int, quick: bool = False, method: str = "luna",
                      lengths: Sequence[int] | None = None, memory: bool = True, cpu_time: bool = False,
                      log: Callable[[str], None] = print) -> dict:
    """A long-context encoder where linear attention can pay: ModernBERT-base sizes (random init from
    its config; tiny if ``quick``), batch 1, inference and one training step (AdamW) at each length.
    Three variants with the same weights: the original (SDPA, its global/local pattern), the global
    layers converted (``convert``'s default: local layers stay sliding-window softmax), every layer
    converted (``convert_local_layers=True``). Times and the training step's peak tensor memory, each
    also as a ratio to the original.

    The variants run one after another, each with its own optimizer freed before the next, so only one
    trains at a time (a ModernBERT-base training step at 4k tokens peaks near 10 GB in float32). With
    ``memory``, a training step whose peak, extrapolated from the previous length, would not fit in the
    memory left is skipped and the row says so (``train_skipped``) rather than the process being killed."""
    import copy
    import gc

    import torch
    import transformers

    if quick:
        config = transformers.ModernBertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=3,
                                               num_attention_heads=2, intermediate_size=96, local_attention=16,
                                               global_attn_every_n_layers=3, pad_token_id=0, bos_token_id=1,
                                               eos_token_id=2, cls_token_id=1, sep_token_id=2)
        lengths = tuple(lengths or (64, 128))
    else:
        config = transformers.ModernBertConfig()  # ModernBERT-base: 22 layers, 768 wide, window 128
        lengths = tuple(lengths or LONG_LENGTHS)
    config.max_position_embeddings = max(lengths)
    config._attn_implementation = "sdpa"  # the eager-free CPU path; v4's flash/unpadded path is refused
    clock = _Clock(device, cpu_time)
    torch.manual_seed(0)
    original = transformers.ModernBertForMaskedLM(config).to(device)
    inputs = {n: (torch.randint(3, config.vocab_size, (1, n), device=device),
                  torch.randint(3, config.vocab_size, (1, n), device=device)) for n in lengths}
    rows = [{"tokens": n, "batch": 1} for n in lengths]
    models = {"original": original}  # copied before any training step, so every variant has the same weights
    for name, local in (("converted global", False), ("converted all", True)):
        models[name] = copy.deepcopy(original)
        convert(models[name], method, convert_local_layers=local)
    del original
    for name in LONG_VARIANTS:
        model = models.pop(name)
        last_peak: tuple[int, float] | None = None  # (tokens, bytes) of the last measured training step
        for row in rows:
            n, (ids, labels) = row["tokens"], inputs[row["tokens"]]
            t0 = time.perf_counter()
            x = row[name] = {"fwd_ms": _median_ms(_round_robin({name: _inference(model, {"input_ids": ids})}, clock,
                                                               repeats, warmup)[name])}
            skip = _train_step_would_not_fit(last_peak, n, device) if memory else None
            if skip:
                x["train_skipped"] = skip
                log(f"ModernBERT {n} tokens, {name}: training step skipped: {skip}")
            else:
                x.update(_time_train_step(model, {"input_ids": ids, "labels": labels}, clock, repeats, warmup,
                                          device, memory))
                if memory:
                    last_peak = (n, x["train_peak_mb"] * 2**20)
            for key in [k for k in x if k.endswith(("_ms", "_mb"))]:
                base = row["original"].get(key)
                x[f"{key}_ratio"] = 1.0 if name == "original" else x[key] / base if base else None
            log(f"ModernBERT {n} tokens, {name}: forward {x['fwd_ms']:.0f} ms, train step "
                + (f"{x['train_ms']:.0f} ms" if "train_ms" in x else "skipped")
                + (f", peak {x['train_peak_mb']:.0f} MiB" if "train_peak_mb" in x else "")
                + f"  ({time.perf_counter() - t0:.0f} s)")
        del model
        gc.collect()
    # DINOv2 (ViT-B/14 sizes, random init) at other resolutions: positions interpolated from 518 px.
    if quick:
        dino = transformers.Dinov2Config(image_size=56, patch_size=14, hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, intermediate_size=128)
        sizes = (28, 56, 84)
    else:
        dino, sizes = transformers.Dinov2Config(image_size=518, patch_size=14), DINO_SIZES
    dino._attn_implementation = "sdpa"
    original = transformers.Dinov2Model(dino).to(device).eval()
    converted = copy.deepcopy(original)
    convert(converted, method)
    vit_rows = []
    for size in sizes:
        t0 = time.perf_counter()
        inputs = {"pixel_values": torch.randn(1, 3, size, size, device=device)}
        row = _compare(_inference(original, inputs), _inference(converted, inputs), clock, repeats, warmup, image_size=size,
                       tokens=(size // dino.patch_size) ** 2 + 1, batch=1)
        vit_rows.append(row)
        log(f"DINOv2 {size}px ({row['tokens']} tokens): original {row['original_ms']:.0f} ms, converted "
            f"{row['converted_ms']:.0f} ms (x{row['ratio']:.2f})  ({time.perf_counter() - t0:.0f} s)")
    return {"method": method, "model": "ModernBERT-base" if not quick else "ModernBERT (tiny)",
            "layers": config.num_hidden_layers, "hidden": config.hidden_size, "window": config.local_attention,
            "rows": rows, "dinov2": vit_rows, "dinov2_model": "DINOv2-base (ViT-B/14)" if not quick else "DINOv2 (tiny)"}


# --------------------------------------------------------------------------- targets, table, plot
def _targets(layers: dict | None, models: dict | None, layers_busy: dict | None = None,
             long_models: dict | None = None) -> list[dict]:
    """The issue's targets, evaluated on what was measured (missing data: not listed)."""
    targets: list[dict] = []

    def add(name, value, op, threshold):
        if value is None:
            return
        met = value >= threshold if op == ">=" else value <= threshold if op == "<=" else value < threshold
        targets.append({"target": name, "value": value, "op": op, "threshold": threshold, "met": bool(met)})

    if layers:
        by = {(r["method"], r["n"]): r for r in layers["results"]}
        lengths = sorted({r["n"] for r in layers["results"]})
        for variant in ("luna", LUNA_CORE):
            label = "LUNA layer" if variant == "luna" else "LUNA layer without DWC"
            for n, need in ((4096, 5.0), (16384, 20.0)):
                r = by.get((variant, n))
                add(f"{label}: forward speed-up vs softmax (SDPA) at N={n}", r and r.get("fwd_speedup_vs_softmax"), ">=", need)
            for n in lengths:
                luna, t2r = by.get((variant, n)), by.get(("t2r", n))
                if n < 1024 or not luna or not t2r:
                    continue
                add(f"{label}: forward time / T2R at N={n}", luna["fwd_ms"] / t2r["fwd_ms"], "<=", 2.0)
                add(f"{label}: fwd+bwd time / T2R at N={n}", luna["fwd_bwd_ms"] / t2r["fwd_bwd_ms"], "<=", 2.0)
                if luna.get("fwd_bwd_peak_mb") and t2r.get("fwd_bwd_peak_mb"):
                    add(f"{label}: fwd+bwd peak memory / T2R at N={n}", luna["fwd_bwd_peak_mb"] / t2r["fwd_bwd_peak_mb"], "<=", 2.0)
            r = by.get((variant, 4096))
            add(f"{label}: fwd+bwd peak memory / softmax (SDPA) at N=4096", r and r.get("fwd_bwd_memory_vs_softmax"), "<=", 0.25)
            add(f"{label}: fwd+bwd peak memory / eager softmax (N x N) at N=4096 [context]",
                r and r.get("fwd_bwd_memory_vs_softmax_eager"), "<=", 0.25)
        if max(lengths) >= SLOPE_RANGE[1] and min(lengths) <= SLOPE_RANGE[0]:
            for m, s in layers["slopes"].items():
                if m in (SOFTMAX, SOFTMAX_EAGER):
                    continue
                add(f"{m}: log-log slope of forward time, N={SLOPE_RANGE[0]}..{SLOPE_RANGE[1]}", s.get("fwd"), "<=", 1.1)
                add(f"{m}: log-log slope of fwd+bwd time, N={SLOPE_RANGE[0]}..{SLOPE_RANGE[1]}", s.get("fwd_bwd"), "<=", 1.1)
    if layers_busy:
        by = {(r["method"], r["n"]): r for r in layers_busy["results"]}
        load = f"{layers_busy['background']['processes']} background process(es)"
        luna, t2r = by.get(("luna", 4096)), by.get(("t2r", 4096))
        for key, what in (("fwd", "forward"), ("fwd_bwd", "fwd+bwd")):
            if luna and t2r:
                add(f"LUNA layer, {load}: {what} time / T2R at N=4096", luna[f"{key}_ms"] / t2r[f"{key}_ms"], "<=", 1.5)
            add(f"LUNA layer, {load}: {what} speed-up vs softmax (SDPA) at N=4096",
                luna and luna.get(f"{key}_speedup_vs_softmax"), ">=", 3.0)
    if long_models:
        rows = {r["tokens"]: r for r in long_models["rows"]}
        for variant in LONG_VARIANTS[1:]:
            if 8192 in rows:
                r = rows[8192][variant]
                add(f"{long_models['model']} 8192 tokens, {variant}: inference time / original", r["fwd_ms_ratio"], "<=", 0.5)
                add(f"{long_models['model']} 8192 tokens, {variant}: train step time / original", r.get("train_ms_ratio"), "<=", 0.5)
            peaks = {n: r[variant]["train_peak_mb"] for n, r in rows.items() if "train_peak_mb" in r[variant]}
            if len(peaks) >= 2:  # over the lengths whose step was measured (a step that would not fit is skipped)
                slope, _ = _slope(peaks, 1024, 8192)
                add(f"{long_models['model']}, {variant}: log-log slope of train-step peak memory, "
                    f"{min(peaks)}..{max(peaks)} tokens", slope, "<=", 1.1)
        for r in long_models.get("dinov2", []):
            if r["image_size"] >= 1024:
                add(f"{long_models['dinov2_model']} inference {r['image_size']}px: converted / original time",
                    r["ratio"], "<=", 0.5)
    if models:
        m = models["method"]
        if models.get("bert_train"):
            r = models["bert_train"]
            add(f"BERT-base train step {r['batch']}x{r['tokens']}: {m} / original time", r["ratio"], "<=", 1.5)
        for r in models["vit"]:
            if r["image_size"] == 224:
                add(f"ViT-B/16 inference 224px: {m} / original time", r["ratio"], "<=", 1.3)
            if r["image_size"] >= 1024:
                add(f"ViT-B/16 inference {r['image_size']}px: {m} / original time", r["ratio"], "<", 1.0)
        for r in models["bert"]:
            if r["tokens"] >= 4096:
                add(f"BERT-base inference {r['tokens']} tokens: {m} / original time", r["ratio"], "<", 1.0)
    return targets


def _print_tables(results: dict, console) -> None:
    from rich.table import Table

    for section in ("layers", "layers_busy"):
        layers = results.get(section)
        if not layers:
            continue
        methods = layers["config"]["methods"]
        by = {(r["method"], r["n"]): r for r in layers["results"]}
        lengths = layers["config"]["lengths"]
        for key, title in (("fwd_ms", "forward"), ("fwd_bwd_ms", "forward+backward")):
            table = Table(title=f"Attention layer {title} time, ms (speed-up vs softmax)  "
                                f"[{layers['config']['heads']}x{layers['config']['head_dim']}, batch {layers['config']['batch']}]"
                                + _load_label(layers))
            table.add_column("N", justify="right")
            for m in methods:
                table.add_column(m, justify="right")
            for n in lengths:
                cells = []
                for m in methods:
                    r = by.get((m, n))
                    if r is None:
                        cells.append("-")
                        continue
                    sp = r.get("fwd_speedup_vs_softmax" if key == "fwd_ms" else "fwd_bwd_speedup_vs_softmax")
                    cells.append(f"{r[key]:.1f}" + (f" ({sp:.1f}x)" if sp else ""))
                table.add_row(str(n), *cells)
            slope_key = key.replace("_ms", "")
            table.add_row("slope", *[f"{s:.2f}" if (s := layers['slopes'][m].get(slope_key)) is not None else "-" for m in methods])
            console.print(table)
    layers = results.get("layers")
    if layers:
        methods, lengths = layers["config"]["methods"], layers["config"]["lengths"]
        by = {(r["method"], r["n"]): r for r in layers["results"]}

        def per_length_table(title: str, key: str, cell) -> None:
            """One row per N, one column per method: ``cell(result)`` where the result has ``key``."""
            if not any(key in r for r in layers["results"]):
                return
            table = Table(title=title)
            table.add_column("N", justify="right")
            for m in methods:
                table.add_column(m, justify="right")
            for n in lengths:
                table.add_row(str(n), *[cell(by[(m, n)]) if key in by.get((m, n), {}) else "-" for m in methods])
            console.print(table)

        per_length_table(f"Attention layer aten operator calls per forward (no grad); {VIEWS_IN_BRACKETS}", "fwd_ops",
                         _operator_calls_cell)
        per_length_table("Attention layer peak tensor memory, MiB: forward (no grad) / forward+backward",
                         "fwd_peak_mb", lambda r: f"{r['fwd_peak_mb']:.0f} / {r['fwd_bwd_peak_mb']:.0f}")
    models = results.get("models")
    if models:
        table = Table(title=f"Whole models, original vs converted ({models['method']}), ms (median)")
        for col in ("model", "input", "original", "converted", "converted/original"):
            table.add_column(col, justify="right" if col != "model" else "left")
        for r in models["vit"]:
            table.add_row("ViT-B/16 inference", f"{r['image_size']}px, {r['tokens']} tok", f"{r['original_ms']:.0f}",
                          f"{r['converted_ms']:.0f}", f"{r['ratio']:.2f}")
        for r in models["bert"]:
            table.add_row("BERT-base inference", f"{r['tokens']} tok", f"{r['original_ms']:.0f}", f"{r['converted_ms']:.0f}",
                          f"{r['ratio']:.2f}")
        if models.get("bert_train"):
            r = models["bert_train"]
            table.add_row("BERT-base train step", f"{r['batch']}x{r['tokens']} tok", f"{r['original_ms']:.0f}",
                          f"{r['converted_ms']:.0f}", f"{r['ratio']:.2f}")
        console.print(table)
    long = results.get("long_models")
    if long:
        table = Table(title=f"{long['model']}, batch 1, original vs converted ({long['method']}): inference / train "
                            "step ms (x original)")
        table.add_column("tokens", justify="right")
        for v in LONG_VARIANTS:
            table.add_column(v, justify="right")
        for r in long["rows"]:
            table.add_row(str(r["tokens"]), *[f"{_ms_and_ratio(r[v], 'fwd_ms')} / {_ms_and_ratio(r[v], 'train_ms')}"
                                              for v in LONG_VARIANTS])
        console.print(table)
        table = Table(title=f"{long['dinov2_model']} inference, positions interpolated, ms")
        for col in ("image", "tokens", "original", "converted", "converted/original"):
            table.add_column(col, justify="right")
        for r in long["dinov2"]:
            table.add_row(f"{r['image_size']}px", str(r["tokens"]), f"{r['original_ms']:.0f}", f"{r['converted_ms']:.0f}",
                          f"{r['ratio']:.2f}")
        console.print(table)
    if results.get("targets"):
        table = Table(title="Targets")
        for col in ("target", "measured", "needed", "met"):
            table.add_column(col, justify="left" if col == "target" else "right")
        for t in results["targets"]:
            table.add_row(t["target"], f"{t['value']:.2f}", f"{t['op']} {t['threshold']:g}", "yes" if t["met"] else "NO")
        console.print(table)


def _load_label(layers: dict) -> str:
    """Title suffix of a layer table timed under a background load ("" for the idle run)."""
    load = layers.get("background")
    if not load:
        return ""
    return (f", with {load['processes']} background process(es) multiplying {load['matmul_size']}x"
            f"{load['matmul_size']} matrices ({load['matmuls']} products during the timing)")


def markdown_tables(results: dict) -> str:
    """The result tables as GitHub markdown (what ``bench.md`` holds)."""
    lines: list[str] = []
    layers, models = results.get("layers"), results.get("models")
    for section in ("layers", "layers_busy"):
        if not results.get(section):
            continue
        cfg = results[section]["config"]
        methods, lengths = cfg["methods"], cfg["lengths"]
        by = {(r["method"], r["n"]): r for r in results[section]["results"]}
        for key, title in (("fwd_ms", "forward (no grad)"), ("fwd_bwd_ms", "forward + backward")):
            speed = "fwd_speedup_vs_softmax" if key == "fwd_ms" else "fwd_bwd_speedup_vs_softmax"
            lines += [f"**Attention layer, {title}: median ms (speed-up vs softmax SDPA)**, "
                      f"{cfg['heads']} heads x {cfg['head_dim']}, batch {cfg['batch']}, {cfg['dtype']}"
                      + _load_label(results[section]), "",
                      "| N | " + " | ".join(methods) + " |", "|---:|" + "---:|" * len(methods)]
            for n in lengths:
                cells = []
                for m in methods:
                    r = by.get((m, n))
                    cells.append("-" if r is None else f"{r[key]:.1f}" + (f" ({r[speed]:.1f}x)" if r.get(speed) else ""))
                lines.append(f"| {n} | " + " | ".join(cells) + " |")
            slope_key = key.replace("_ms", "")
            cells = [f"{s:.2f}" if (s := results[section]["slopes"][m].get(slope_key)) is not None else "-"
                     for m in methods]
            lines += ["| log-log slope | " + " | ".join(cells) + " |", ""]
    if layers:
        methods, lengths = layers["config"]["methods"], layers["config"]["lengths"]
        by = {(r["method"], r["n"]): r for r in layers["results"]}
        if any("fwd_ops" in r for r in layers["results"]):
            lines += [f"**Attention layer, aten operator calls per forward (no grad); {VIEWS_IN_BRACKETS}**", "",
                      "| N | " + " | ".join(methods) + " |", "|---:|" + "---:|" * len(methods)]
            for n in lengths:
                cells = [_operator_calls_cell(by[(m, n)]) if "fwd_ops" in by.get((m, n), {}) else "-" for m in methods]
                lines.append(f"| {n} | " + " | ".join(cells) + " |")
            lines.append("")
        if any("fwd_bwd_peak_mb" in r for r in layers["results"]):
            lines += ["**Attention layer, peak tensor memory: forward / forward + backward, MiB**", "",
                      "| N | " + " | ".join(methods) + " |", "|---:|" + "---:|" * len(methods)]
            for n in lengths:
                cells = [f"{by[(m, n)]['fwd_peak_mb']:.1f} / {by[(m, n)]['fwd_bwd_peak_mb']:.1f}"
                         if (m, n) in by and "fwd_peak_mb" in by[(m, n)] else "-" for m in methods]
                lines.append(f"| {n} | " + " | ".join(cells) + " |")
            lines.append("")
    if models:
        lines += [f"**Whole models, original vs converted with `{models['method']}` (random init), median ms**", "",
                  "| model | input | original | converted | converted / original |", "|---|---:|---:|---:|---:|"]
        for r in models["vit"]:
            lines.append(f"| ViT-B/16 inference | {r['image_size']} px ({r['tokens']} tokens) | {r['original_ms']:.0f} | "
                         f"{r['converted_ms']:.0f} | {r['ratio']:.2f} |")
        for r in models["bert"]:
            lines.append(f"| BERT-base inference | {r['tokens']} tokens | {r['original_ms']:.0f} | {r['converted_ms']:.0f} | "
                         f"{r['ratio']:.2f} |")
        if models.get("bert_train"):
            r = models["bert_train"]
            lines.append(f"| BERT-base train step (AdamW) | {r['batch']} x {r['tokens']} tokens | {r['original_ms']:.0f} | "
                         f"{r['converted_ms']:.0f} | {r['ratio']:.2f} |")
        lines.append("")
    long = results.get("long_models")
    if long:
        lines += [f"**{long['model']} ({long['layers']} layers, {long['hidden']} wide, local window {long['window']}), "
                  f"batch 1, original vs converted with `{long['method']}` (random init), median ms "
                  "(x original); train step peak tensor memory, MiB**", "",
                  "| tokens | " + " | ".join(f"{v}: inference | {v}: train step | {v}: train memory"
                                             for v in LONG_VARIANTS) + " |",
                  "|---:|" + "---:|" * (3 * len(LONG_VARIANTS))]
        for r in long["rows"]:
            cells = []
            for v in LONG_VARIANTS:
                x = r[v]
                cells += [_ms_and_ratio(x, key) for key in ("fwd_ms", "train_ms", "train_peak_mb")]
            lines.append(f"| {r['tokens']} | " + " | ".join(cells) + " |")
        skipped = [f"{r['tokens']} tokens, {v}: {r[v]['train_skipped']}" for r in long["rows"] for v in LONG_VARIANTS
                   if "train_skipped" in r[v]]
        if skipped:
            lines += ["", "Training steps skipped (they would not fit in memory): " + "; ".join(skipped) + "."]
        lines += ["", f"**{long['dinov2_model']} inference at other resolutions (positions interpolated), batch 1, "
                  f"original vs converted with `{long['method']}`, median ms**", "",
                  "| image | tokens | original | converted | converted / original |", "|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['image_size']} px | {r['tokens']} | {r['original_ms']:.0f} | {r['converted_ms']:.0f} | "
                  f"{r['ratio']:.2f} |" for r in long["dinov2"]]
        lines.append("")
    if results.get("targets"):
        lines += ["**Targets**", "", "| target | measured | needed | met |", "|---|---:|---:|:---:|"]
        for t in results["targets"]:
            lines.append(f"| {t['target']} | {t['value']:.2f} | {t['op']} {t['threshold']:g} | {'yes' if t['met'] else '**no**'} |")
        lines.append("")
    return "\n".join(lines)


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    layers = results.get("layers")
    models = results.get("models")
    panels = [("fwd_ms", "forward time (ms)"), ("fwd_bwd_ms", "forward+backward time (ms)"),
              ("fwd_bwd_peak_mb", "forward+backward peak memory (MiB)")]
    fig, axes = plt.subplots(1, len(panels) + (1 if models else 0), figsize=(4.2 * (len(panels) + (1 if models else 0)), 3.6))
    if layers:
        methods = layers["config"]["methods"]
        for ax, (key, label) in zip(axes, panels):
            for m in methods:
                pts = sorted((r["n"], r[key]) for r in layers["results"] if r["method"] == m and r.get(key))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, lw=1.2, label=m,
                            ls="--" if m in (SOFTMAX, SOFTMAX_EAGER) else "-")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length N")
            ax.set_title(label, fontsize=9)
            ax.grid(True, which="both", lw=0.3)
        axes[0].legend(fontsize=7)
    if models:
        ax = axes[-1]
        labels, ratios = [], []
        for r in models["vit"]:
            labels.append(f"ViT {r['image_size']}px")
            ratios.append(r["ratio"])
        for r in models["bert"]:
            labels.append(f"BERT {r['tokens']}")
            ratios.append(r["ratio"])
        if models.get("bert_train"):
            labels.append("BERT train")
            ratios.append(models["bert_train"]["ratio"])
        ys = list(range(len(labels)))
        colors = ["tab:green" if x < 1 else "tab:orange" for x in ratios]
        ax.hlines(ys, 1.0, ratios, colors=colors, lw=2)
        ax.scatter(ratios, ys, c=colors, s=18, zorder=3)
        for y, x in zip(ys, ratios):
            ax.annotate(f"{x:.2f}", (x, y), xytext=(4, 3), textcoords="offset points", fontsize=7)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xscale("log")
        lo, hi = min([*ratios, 1.0]) / 1.25, max([*ratios, 1.0]) * 1.3
        ax.set_xlim(lo, hi)
        ticks = [t for t in (0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0) if lo <= t <= hi]
        ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_yticks(ys, labels)
        ax.set_title(f"whole models: {models['method']} / original time", fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(True, axis="x", which="both", lw=0.3)
        ax.invert_yaxis()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())


def _meta(device, repeats: int, warmup: int, quick: bool) -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    meta = {"torch": torch.__version__, "python": sys.version.split()[0], "device": str(device),
            "threads": torch.get_num_threads(), "cpu": cpu, "cpu_count": os.cpu_count(), "repeats": repeats,
            "warmup": warmup, "quick": quick, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "luna_native_kernel": luna_native.status(), "dwc_native_pass": dwc_native_status(),
            "sorting_native_pass": sorting_native.status(), "core_native_products": products_native_status(),
            "exp_rows_native": exp_rows.status(), "heap": heap_policy()}
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
    if hasattr(os, "getloadavg"):
        meta["load_average_start"] = os.getloadavg()
    return meta


def run_benchmark(
    output_dir: Path | str,
    lengths: Iterable[int] | None = DEFAULT_LENGTHS,
    methods: Iterable[str] | None = None,
    repeats: int | None = None,
    models: bool = True,
    quick: bool = False,
    device: str = "auto",
    *,
    warmup: int | None = None,
    memory: bool = True,
    eager_max_length: int = 4096,
    model_method: str = "luna",
    vit_sizes: Sequence[int] | None = None,
    bert_lengths: Sequence[int] | None = None,
    threads: int | None = None,
    timer: str = "wall",
    background_load: int = 0,
    dtype: str = "float32",
    long_models: bool = False,
    long_lengths: Sequence[int] | None = None,
    console=None,
) -> dict:
    """Measure attention layers and whole models; write ``bench.json``, ``bench.md`` and ``bench.png`` under ``output_dir``.

    output_dir    folder for ``bench.json`` (all numbers), ``bench.md`` (the tables) and ``bench.png``
                  (plots); created if missing.
    lengths       sequence lengths for the layer benchmark (None: the default 256..16384, or 128, 256 if quick).
    methods       linear methods to compare with softmax (None: every method in ``luna_convert.METHODS``
                  plus ``luna-nodwc``, LUNA without its DWC branch). Softmax (SDPA) is always included,
                  and ``softmax-eager`` (explicit N x N attention) for N <= ``eager_max_length``.
    repeats       timed runs per measurement, median reported (None: 5 for layers/3 for models; 1 if quick).
    models        also run the whole-model benchmark (ViT-B/16, BERT-base inference, BERT-base train step).
    quick         a smoke run: short default lengths, 1 repeat, tiny 2-layer models instead of base sizes.
    device        "auto" (CUDA if available, else CPU), "cpu", "cuda" or "cuda:N".
    warmup        untimed runs before timing (None: 1).
    memory        also measure peak tensor memory of every layer (one extra run each).
    eager_max_length  longest N for the eager-softmax reference (0: leave it out).
    model_method  the conversion method for the whole-model benchmark.
    vit_sizes, bert_lengths  override the model input sizes.
    threads       torch intra-op threads for the run (None: leave torch's setting); restored afterwards.
    timer         "wall" (default) or "cpu": on the CPU, time the calling thread's CPU time instead of
                  the wall clock, for a machine shared with other work. Needs a single thread (implies
                  threads=1). Ignored on CUDA.
    background_load  also time the attention layers a second time while this many processes multiply
                  matrices on one thread each (``tools.background_load``, started and stopped here): a busy
                  machine, reported beside the idle run as ``layers_busy`` (0: idle run only).
    long_models   also time a long-context encoder (``bench_long_models``: ModernBERT-base at 1k-8k tokens,
                  original vs converted, inference and a training step); ``long_lengths`` overrides the lengths.
    dtype         the attention layers' dtype: "float32" or "bf16" (bf16 inputs under autocast, sums in
                  float32: the GPU setting); whole models run in float32.
    console       a rich Console for progress and tables (None: a new one on stdout).

    Returns the results dict that is also written to ``bench.json``: ``meta``, ``layers``
    (``config``, ``results`` rows with times/speed-ups/memory, ``slopes``), ``models``
    (``vit``, ``bert``, ``bert_train`` rows with ``ratio`` = converted/original) and ``targets``.
    """
    import torch
    from rich.console import Console

    console = console or Console()
    output_dir = Path(output_dir)
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise LunaConvertError("--device cuda was asked for but torch sees no CUDA GPU; use --device cpu")
    if lengths is None or (quick and tuple(lengths) == DEFAULT_LENGTHS):
        lengths = QUICK_LENGTHS if quick else DEFAULT_LENGTHS
    lengths = tuple(sorted({int(n) for n in lengths}))
    if not lengths or min(lengths) < 1:
        raise LunaConvertError(f"lengths must be positive integers, got {lengths}")
    if methods is None:
        methods = [*METHODS, LUNA_CORE]
    linear = list(dict.fromkeys(m for m in methods if m not in (SOFTMAX, SOFTMAX_EAGER)))
    for name in linear:  # an unknown method or option fails before anything is timed
        layer_variant(name)
    with_eager = bool(eager_max_length) and min(lengths) <= eager_max_length
    methods = [SOFTMAX, *([SOFTMAX_EAGER] if with_eager else []), *linear]
    layer_repeats = repeats or (1 if quick else 5)
    model_repeats = repeats or (1 if quick else 3)
    warmup = 1 if warmup is None else warmup

    def log(msg: str) -> None:
        console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {msg}", highlight=False)

    if isinstance(background_load, bool) or not isinstance(background_load, int) or background_load < 0:
        raise LunaConvertError(f"background_load must be 0 or a number of processes, got {background_load!r}")
    if dtype not in BENCH_DTYPES:
        raise unknown_name("dtype", str(dtype), list(BENCH_DTYPES))
    if timer not in ("wall", "cpu"):
        raise LunaConvertError(f"timer must be 'wall' or 'cpu', got {timer!r}")
    cpu_time = timer == "cpu" and dev.type == "cpu"
    if cpu_time:
        if threads not in (None, 1):
            raise LunaConvertError("the cpu timer measures one thread: use --threads 1 (or leave it out)")
        threads = 1
    output_dir.mkdir(parents=True, exist_ok=True)
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run(output_dir, lengths, methods, dev, layer_repeats, model_repeats, warmup, models, quick, memory,
                    eager_max_length, model_method, vit_sizes, bert_lengths, cpu_time, background_load, console, log,
                    dtype=dtype, long_models=long_models, long_lengths=long_lengths)
    finally:
        torch.set_num_threads(previous_threads)


def _run(output_dir, lengths, methods, dev, layer_repeats, model_repeats, warmup, models, quick, memory,
         eager_max_length, model_method, vit_sizes, bert_lengths, cpu_time, background_load, console, log,
         dtype: str = "float32", long_models: bool = False, long_lengths: Sequence[int] | None = None) -> dict:
    import torch

    results: dict = {"meta": _meta(dev, layer_repeats, warmup, quick)}
    results["meta"]["model_repeats"] = model_repeats
    results["meta"]["timer"] = "thread CPU time" if cpu_time else "CUDA events" if dev.type == "cuda" else "wall clock"
    t0 = time.perf_counter()
    log(f"attention layers on {dev} ({torch.get_num_threads()} threads): N = {', '.join(map(str, lengths))}; "
        f"methods: {', '.join(methods)}; LUNA's native channel kernel {results['meta']['luna_native_kernel']}, "
        f"DWC's native pass (no grad) {results['meta']['dwc_native_pass']}, "
        f"the sorting kernel's native passes {results['meta']['sorting_native_pass']}, "
        f"the core's native products {results['meta']['core_native_products']}, "
        f"the native exps of rows (Hedgehog, Performer, Flexformer) {results['meta']['exp_rows_native']}; "
        f"heap: {results['meta']['heap']}")
    results["layers"] = bench_layers(lengths, methods, dev, layer_repeats, warmup, memory=memory,
                                     eager_max_length=eager_max_length or 0, cpu_time=cpu_time, dtype=dtype, log=log)
    if background_load:
        log(f"attention layers again, {background_load} background process(es) multiplying matrices ...")
        with run_background_load(background_load) as load:
            busy = bench_layers(lengths, methods, dev, layer_repeats, warmup, memory=False,
                                eager_max_length=eager_max_length or 0, cpu_time=cpu_time, count_ops=False,
                                dtype=dtype, log=log)
        results["layers_busy"] = {**busy, "background": load.to_dict()}
    results["models"] = None
    if models:
        log(f"whole models ({model_method}) ...")
        results["models"] = bench_models(dev, model_repeats, warmup, quick=quick, method=model_method,
                                         vit_sizes=vit_sizes, bert_lengths=bert_lengths, cpu_time=cpu_time, log=log)
    if long_models:
        log(f"long-context model ({model_method}) ...")
        results["long_models"] = bench_long_models(dev, model_repeats, warmup, quick=quick, method=model_method,
                                                   lengths=long_lengths, memory=memory, cpu_time=cpu_time, log=log)
    results["targets"] = _targets(results["layers"], results["models"], results.get("layers_busy"),
                                  results.get("long_models"))
    results["meta"]["seconds"] = time.perf_counter() - t0
    if hasattr(os, "getloadavg"):
        results["meta"]["load_average_end"] = os.getloadavg()
    atomic_write_json(output_dir / "bench.json", results)
    atomic_write_text(output_dir / "bench.md", markdown_tables(results))
    _plot(results, output_dir / "bench.png")
    _print_tables(results, console)
    log(f"wrote bench.json, bench.md and bench.png to {output_dir} ({results['meta']['seconds']:.0f} s)")
    return results
