"""torch.compile (Inductor) of converted attention layers: compiled with the native operators in the graph,
compiled with the PyTorch reference only (what compiled code ran before the operators were registered),
and eager; forward (no_grad) and forward + backward, on the CPU.

    python benchmarks/compile_native.py --methods luna,hedgehog,t2r --lengths 512,4096 --threads 1

Prints a markdown table of medians (ms) over --repeats calls after warm-up; 12 heads of 64, batch 1. Times are
the calling thread's CPU time (one thread: every kernel runs on it), so other jobs on the machine do not count.
"""

from __future__ import annotations

import argparse
import contextlib
import torch

from luna_convert.layers.attention import LinearAttention
from luna_convert.ops import native
from thread_timing import median_thread_ms


def measure(method: str, tokens: int, repeats: int) -> dict[str, float]:
    torch.manual_seed(0)
    layer = LinearAttention(method, 64, 12, 64**-0.5)
    q, k, v = (torch.randn(1, 12, tokens, 64) for _ in range(3))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def forward(f):
        with torch.no_grad():
            f(q, k, v)

    def train(f):
        f(*leaves).sum().backward()

    row = {}
    for mode, scope in (("eager", contextlib.nullcontext), ("compiled, native ops", contextlib.nullcontext),
                        ("compiled, reference only", native.reference_kernels)):
        with scope():
            torch._dynamo.reset()
            f = layer if mode == "eager" else torch.compile(layer, fullgraph=True)
            row[f"{mode} fwd"] = median_thread_ms(lambda: forward(f), repeats)
            row[f"{mode} fwd+bwd"] = median_thread_ms(lambda: train(f), repeats)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="luna,hedgehog,t2r")
    parser.add_argument("--lengths", default="512,4096")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for method in args.methods.split(","):
        for tokens in map(int, args.lengths.split(",")):
            rows.append((method, tokens, measure(method, tokens, args.repeats)))
            print(f"measured {method} at {tokens}", flush=True)
    columns = list(rows[0][2])
    print("| method | tokens | " + " | ".join(columns) + " |")
    print("| --- | ---: | " + " | ".join("---:" for _ in columns) + " |")
    for method, tokens, row in rows:
        print(f"| {method} | {tokens:,} | " + " | ".join(f"{row[c]:.1f}" for c in columns) + " |")


if __name__ == "__main__":
    main()
