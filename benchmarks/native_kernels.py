"""Whether each native (C) kernel earns its place: one attention layer (12 heads of 64, batch 1, one thread)
with its native kernels against the standard-operator path, eager and compiled (Inductor), forward (no_grad)
and forward + backward at 1,024 and 4,096 tokens, and peak memory at 16,384 tokens.

    python benchmarks/native_kernels.py --methods luna,hedgehog,t2r,performer,taylor,sorting

Each configuration runs in a child process of its own and measures the memory first, so its peak resident
memory (ru_maxrss, above what the process held before the first call at 16k) is its own. Times are the calling thread's CPU time, medians over
--repeats calls after warm-up. ``without <source>``: that C source alone off (the others as they are).
Prints a markdown table; a kernel earns its place where the native row beats the best standard-operator row
(eager or compiled) by >= 1.5x in time or >= 2x in memory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import subprocess
import sys

import torch

from thread_timing import median_thread_ms

# per method: the C sources whose effect is worth telling apart (beyond "all native" and "none")
SOURCES = {"luna": ("luna_channels.c",), "taylor": ("token_products.c",)}


def configurations(method: str) -> list[str]:
    return ["native", *(f"without {s}" for s in SOURCES.get(method, ())), "standard eager", "standard compiled"]


def _child(method: str, config: str, lengths: list[int], memory_tokens: int, repeats: int) -> dict:
    from luna_convert.layers.attention import LinearAttention
    from luna_convert.ops import native

    torch.set_num_threads(1)
    if config.startswith("without "):
        source, load = config.removeprefix("without "), native.load_library
        native.load_library = lambda path: None if path.name == source else load(path)
    scope = native.reference_kernels if config.startswith("standard") else contextlib.nullcontext
    torch.manual_seed(0)
    layer = LinearAttention(method, 64, 12, 64**-0.5)
    run = torch.compile(layer, fullgraph=True) if config.endswith("compiled") else layer
    row = {}
    with scope():
        # the memory first: ru_maxrss is the process's high-water mark, which the timed lengths must not set
        for tokens in [memory_tokens, *lengths]:
            q, k, v = (torch.randn(1, 12, tokens, 64) for _ in range(3))
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]

            def forward():
                with torch.no_grad():
                    run(q, k, v)

            def train():
                run(*leaves).sum().backward()

            if tokens == memory_tokens:
                before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                forward()
                row["peak MB fwd"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
                train()
                row["peak MB fwd+bwd"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
            else:
                row[f"fwd {tokens}"] = median_thread_ms(forward, repeats)
                row[f"fwd+bwd {tokens}"] = median_thread_ms(train, repeats)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="luna,hedgehog,t2r,performer,taylor,sorting")
    parser.add_argument("--lengths", default="1024,4096", help="timed lengths ('': the peak memory alone)")
    parser.add_argument("--memory-tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--configurations", help="comma-separated paths to measure (default: every one)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",") if n]  # none: the memory alone
    if args.child:
        print(json.dumps(_child(*args.child, lengths, args.memory_tokens, args.repeats)))
        return
    rows = []
    for method in args.methods.split(","):
        for config in configurations(method):
            if args.configurations and config not in args.configurations.split(","):
                continue
            done = subprocess.run([sys.executable, __file__, "--child", method, config, "--lengths", args.lengths,
                                   "--memory-tokens", str(args.memory_tokens), "--repeats", str(args.repeats)],
                                  capture_output=True, text=True)
            result = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {}
            if done.returncode:
                print(f"{method}, {config}: failed: {done.stderr.strip().splitlines()[-1]}", flush=True)
            rows.append((method, config, result))
            print(f"measured {method}, {config}", flush=True)
    columns = [f"{part} {n}" for n in lengths for part in ("fwd", "fwd+bwd")] + ["peak MB fwd", "peak MB fwd+bwd"]
    print("| method | path | " + " | ".join(c.replace(" 1024", " 1k").replace(" 4096", " 4k") for c in columns) + " |")
    print("| --- | --- | " + " | ".join("---:" for _ in columns) + " |")
    for method, config, row in rows:
        print(f"| {method} | {config} | " + " | ".join(f"{row[c]:.0f}" if c in row else "-" for c in columns) + " |")


if __name__ == "__main__":
    main()
