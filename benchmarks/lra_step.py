"""Time and peak memory of one LRA training step against sequence length (docs/lra.md, *Cost per step*).

Each method x length case runs in a fresh process, so that its peak resident set size (ru_maxrss) is its own:
the small LRA encoder (2 layers, hidden 64, 2 heads, feed-forward 128, mean pooling; LUNA in the paper's form
pinned in the LRA recipes) on synthetic byte inputs of that length, every token real; AdamW; one warm-up step,
then the median of --steps timed steps (forward, backward, update). RSS is given after the model and inputs are
built (``base``) and at the peak, so ``peak - base`` is what the steps added.

    python benchmarks/lra_step.py --methods softmax,luna,hedgehog,t2r,performer,cosformer --lengths 1024,2048,4096
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, statistics, sys, time
import torch
from luna_convert.lra.config import load_lra_config
from luna_convert.lra.model import LRAEncoder

method, length, batch, steps, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
torch.manual_seed(0)
config = load_lra_config("image", "cpu", overrides={"method": method})  # the recipes' method options
model = LRAEncoder(config.encoder, 256, 10, length, method, config.attention_options())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 256, (batch, length))
mask = torch.ones(batch, length, dtype=torch.long)
labels = torch.randint(0, 10, (batch,))
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
base = rss()
times = []
for i in range(steps + 1):
    t = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(model(ids, mask), labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if i:  # the first step warms up (native kernels compiled, buffers allocated)
        times.append(time.perf_counter() - t)
print(json.dumps({"method": method, "length": length, "batch": batch, "threads": threads,
                  "s_per_step": statistics.median(times), "base_rss_mib": base, "peak_rss_mib": rss()}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="softmax,luna,hedgehog,t2r,performer,cosformer")
    parser.add_argument("--lengths", default="1024,2048,4096")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    rows = []
    print("| method | tokens | s / step | base RSS MiB | peak RSS MiB | peak - base |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for length in (int(n) for n in args.lengths.split(",")):
        for method in args.methods.split(","):
            out = subprocess.run([sys.executable, "-c", CHILD, method, str(length), str(args.batch), str(args.steps),
                                  str(args.threads)], capture_output=True, text=True)
            if out.returncode:
                print(f"| {method} | {length} | failed: {(out.stderr.strip().splitlines() or ['?'])[-1][:80]} | | | |")
                continue
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"| {method} | {length} | {row['s_per_step']:.2f} | {row['base_rss_mib']:.0f} | "
                  f"{row['peak_rss_mib']:.0f} | {row['peak_rss_mib'] - row['base_rss_mib']:.0f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
