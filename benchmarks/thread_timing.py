"""The timing loop the one-thread benchmarks share: the calling thread's CPU time of ``call``, so that other
jobs on a shared machine do not count (one thread: every kernel runs on the calling thread)."""

from __future__ import annotations

import statistics
import time


def median_thread_ms(call, repeats: int, warmup: int = 2) -> float:
    """Median over ``repeats`` calls, after ``warmup`` untimed ones, in milliseconds."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        call()
        times.append((time.thread_time() - start) * 1e3)
    return statistics.median(times)
