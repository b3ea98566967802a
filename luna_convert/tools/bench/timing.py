"""Timing and memory of the bench's steps: the clock, round-robin medians, peak tensor memory, operator
calls, log-log slopes (how the measurements are taken: see the package docstring)."""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Callable, Sequence

from ..op_count import AtenOpCounter


class Clock:
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


def round_robin(fns: dict[str, Callable[[], object]], clock: Clock, repeats: int, warmup: int,
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


def median_ms(times: Sequence[float]) -> float:
    return 1000.0 * statistics.median(times)


def loglog_slope(points: dict[int, float], lo: int, hi: int) -> tuple[float | None, list[int]]:
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
