"""Why linear attention's time bends upwards at 16k tokens on the CPU: page faults.

Times one attention layer (12 heads x 64, batch 1, one thread, thread CPU time) at
N = 8192 and 16384 on the plain path and the streamed path, and counts the minor page
faults of each call. Run it twice to compare allocators:

    python benchmarks/page_faults.py
    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 python benchmarks/page_faults.py

The second line stops glibc from mapping (and unmapping) big buffers fresh for every
call, so the faults, and the extra time, go away. See docs/benchmarks.md.
"""

from __future__ import annotations

import resource
import statistics
import time

import torch

from luna_convert.tools.bench import layer_modules

torch.set_num_threads(1)
METHODS = ("t2r", "hedgehog", "luna")


def measure(fn, repeats: int = 3) -> tuple[float, int]:
    """Median thread CPU ms and median minor page faults of fn, after one warm-up call."""
    fn()
    times, faults = [], []
    for _ in range(repeats):
        before, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.thread_time()
        fn()
        times.append(1000 * (time.thread_time() - t0))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return statistics.median(times), int(statistics.median(faults))


def main() -> None:
    layers, _ = layer_modules(METHODS, torch.device("cpu"), 12, 64)
    print("| method | N | path | forward ms | faults | fwd+bwd ms | faults |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for n in (8192, 16384):
        q, k, v = (torch.randn(1, 12, n, 64) for _ in range(3))
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        grad = torch.randn(1, 12, n, 64)
        for name in METHODS:
            layer = layers[name]
            for path, min_bytes in (("plain", 1 << 62), ("streamed", 0)):
                layer.stream_min_bytes = min_bytes

                def forward():
                    with torch.no_grad():
                        layer(q, k, v)

                def train():
                    layer(qg, kg, vg).backward(grad)
                    for x in (qg, kg, vg):
                        x.grad = None
                    layer.zero_grad(set_to_none=True)

                if path == "streamed" and layer.stream_chunk(1, n, training=True) is None:
                    path = "streamed (fwd+bwd: plain, by policy)"
                fwd_ms, fwd_faults = measure(forward)
                fb_ms, fb_faults = measure(train)
                print(f"| {name} | {n} | {path} | {fwd_ms:.0f} | {fwd_faults} | {fb_ms:.0f} | {fb_faults} |", flush=True)


if __name__ == "__main__":
    main()
