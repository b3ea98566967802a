"""What a registered operator's dispatcher round trip costs in eager code: ``ops.products``' native product
called directly and through ``torch.ops.luna_convert.product`` (12 heads x 128 tokens x 64 times 64 x 65, one
thread, the calling thread's CPU time, best of 5 runs of 2,000 calls).

    python benchmarks/operator_overhead.py
"""

from __future__ import annotations

import torch

from luna_convert.ops import products
from thread_timing import median_thread_ms


def microseconds_per_call(call, calls: int = 2000) -> float:
    """Best of 5 runs of ``calls`` calls (the median helper times each run), per call."""
    for _ in range(100):
        call()
    return min(median_thread_ms(lambda: [call() for _ in range(calls)], 1, warmup=0) for _ in range(5)) * 1e3 / calls


def main() -> None:
    torch.set_num_threads(1)
    x, w = torch.randn(1, 12, 128, 64), torch.randn(1, 12, 64, 65)
    with torch.no_grad():
        direct = microseconds_per_call(lambda: products.product(x, w))
        dispatched = microseconds_per_call(lambda: torch.ops.luna_convert.product(x, w, None))
    print(f"direct {direct:.1f} us, through the dispatcher {dispatched:.1f} us per call")


if __name__ == "__main__":
    main()
