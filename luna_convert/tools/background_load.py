"""A controlled background load for ``luna-convert bench``: worker processes that multiply matrices,
one thread each, for as long as a ``with background_load(n):`` block runs.

A user's machine is rarely idle (a second job, a browser, a CI neighbour). Timings taken while other
processes compete for the cores show whether a method's speed survives that; the workers are started
and stopped here so that the load is the same from run to run.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from typing import Iterator

from ..errors import LunaConvertError

MATMUL_SIZE = 512  # 512 x 512 float32 products: about 0.27 GFLOP each, a few ms on one core
START_TIMEOUT_S = 120.0  # each worker imports torch before it reports ready


def _multiply_until_stopped(stop, ready, count, size: int) -> None:
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    ready.put(True)
    done = 0
    while not stop.is_set():
        torch.mm(a, b)
        done += 1
    with count.get_lock():
        count.value += done


class BackgroundLoadStats:
    """What the workers did: processes started and matrix products done (filled in when the block ends)."""

    def __init__(self, processes: int, size: int):
        self.processes, self.size, self.matmuls = processes, size, 0

    def to_dict(self) -> dict:
        return {"processes": self.processes, "matmul_size": self.size, "matmuls": self.matmuls,
                "threads_per_process": 1}


@contextlib.contextmanager
def background_load(processes: int, size: int = MATMUL_SIZE) -> Iterator[BackgroundLoadStats]:
    """Run ``processes`` single-threaded matrix-product workers while the block runs; the block starts
    only once every worker computes. Yields stats whose ``matmuls`` is set when the block ends."""
    if processes < 1:
        raise LunaConvertError(f"background load needs at least 1 process, got {processes}")
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds torch's thread pools
    stop, ready, count = ctx.Event(), ctx.Queue(), ctx.Value("q", 0)
    workers = [ctx.Process(target=_multiply_until_stopped, args=(stop, ready, count, size), daemon=True)
               for _ in range(processes)]
    stats = BackgroundLoadStats(processes, size)
    try:
        for w in workers:
            w.start()
        for _ in workers:
            try:
                ready.get(timeout=START_TIMEOUT_S)
            except Exception:
                raise LunaConvertError(f"the background-load workers did not start within {START_TIMEOUT_S:.0f} s; "
                                       "run the bench without --background-load") from None
        yield stats
    finally:
        stop.set()
        for w in workers:
            if w.pid is not None:
                w.join(timeout=30)
            if w.is_alive():
                w.terminate()
                w.join()
        stats.matmuls = int(count.value)
