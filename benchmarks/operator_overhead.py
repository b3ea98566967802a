"""What a registered operator's dispatcher round trip costs in eager code: ``ops.products``' native product
called directly and through ``torch.ops.luna_convert.product`` (12 heads x 128 tokens x 64 times 64 x 65, one
thread, the calling thread's CPU time, best of 5 runs of 2,000 calls).

    python benchmarks/operator_overhead.py
"""

from __future__ import annotations

import time

import torch

from luna_convert.ops import products


def microseconds_per_call(call, calls: int = 2000) -> float:
    for _ in range(100):
        call()
    runs = []
    for _ in range(5):
        start = time.thread_time()
        for _ in range(calls):
            call()
        runs.append((time.thread_time() - start) / calls * 1e6)
    return min(runs)


def main() -> None:
    torch.set_num_threads(1)
    x, w = torch.randn(1, 12, 128, 64), torch.randn(1, 12, 64, 65)
    with torch.no_grad():
        direct = microseconds_per_call(lambda: products.product(x, w))
        dispatched = microseconds_per_call(lambda: torch.ops.luna_convert.product(x, w, None))
    print(f"direct {direct:.1f} us, through the dispatcher {dispatched:.1f} us per call")


if __name__ == "__main__":
    main()
