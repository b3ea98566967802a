"""``run_benchmark``: the bench's one entry point; it measures, then writes bench.json, bench.md and bench.png."""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

from ...errors import LunaConvertError, unknown_name
from ...fileio import atomic_write_json, atomic_write_text
from ...linear_methods import METHODS, luna_native, sorting_native
from ...ops.products import native_status as products_native_status
from ..background_load import background_load as run_background_load
from ..heap import heap_policy
from .layers import (BENCH_DTYPES, DEFAULT_LENGTHS, LUNA_DWC, QUICK_LENGTHS, SOFTMAX, SOFTMAX_EAGER, bench_layers,
                     layer_variant)
from .long_models import bench_long_models
from .models import bench_models
from .plot import write_plot
from .tables import markdown_tables, print_tables


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
            "luna_native_kernel": luna_native.status(),
            "sorting_native_pass": sorting_native.status(), "core_native_products": products_native_status(),
            "heap": heap_policy()}
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
                  plus ``luna:dwc=true``, LUNA with the DWC branch). Softmax (SDPA) is always included,
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
    (``vit``, ``bert``, ``bert_train`` rows with ``ratio`` = converted/original), and ``layers_busy`` and
    ``long_models`` where asked for.
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
        methods = [*METHODS, LUNA_DWC]
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
        f"the sorting kernel's native passes {results['meta']['sorting_native_pass']}, "
        f"the core's native products {results['meta']['core_native_products']}; "
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
    results["meta"]["seconds"] = time.perf_counter() - t0
    if hasattr(os, "getloadavg"):
        results["meta"]["load_average_end"] = os.getloadavg()
    atomic_write_json(output_dir / "bench.json", results)
    atomic_write_text(output_dir / "bench.md", markdown_tables(results))
    write_plot(results, output_dir / "bench.png")
    print_tables(results, console)
    log(f"wrote bench.json, bench.md and bench.png to {output_dir} ({results['meta']['seconds']:.0f} s)")
    return results
