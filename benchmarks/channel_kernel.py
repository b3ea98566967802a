"""LUNA's channel bank and feature norm for one map, native kernel against the PyTorch path
(docs/benchmarks.md, *LUNA's native channel kernel*).

One map at the conversion defaults: 12 heads x N tokens x 64 projections, L = 2 channels at their exp
init, the feature norm; forward with gradients recorded (the tables built, as in training), its backward,
and the forward without gradients (the tables cached, as at inference). Wall clock, median of --repeats,
each path in its own process (``LUNA_CONVERT_NATIVE`` is read when the kernel is loaded).

    python benchmarks/channel_kernel.py --threads 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def measure(tokens: int, threads: int, repeats: int) -> dict:
    import torch

    from luna_convert.linear_methods.luna import FEATURE_NORM_EPS, ScalarChannels
    from luna_convert.linear_methods.luna_kernel import channel_features_of
    from luna_convert.linear_methods.luna_native import status

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    psi = ScalarChannels(2, 64, init="exp")
    u = (2 * torch.randn(1, 12, tokens, 64)).requires_grad_()
    grad = torch.randn(1, 12, tokens, 64, 2)
    run = lambda: channel_features_of(psi, u, scale=0.125, norm_eps=FEATURE_NORM_EPS)[0]  # noqa: E731
    fwd, bwd, inference = [], [], []
    for i in range(repeats + 1):  # the first round warms up
        t0 = time.perf_counter()
        out = run()
        t1 = time.perf_counter()
        out.backward(grad)
        t2 = time.perf_counter()
        with torch.no_grad():
            run()
        t3 = time.perf_counter()
        if i:
            fwd.append(t1 - t0), bwd.append(t2 - t1), inference.append(t3 - t2)
        u.grad = None
    ms = lambda ts: round(1000 * statistics.median(ts), 1)  # noqa: E731
    return {"native": status(), "threads": threads, "forward": ms(fwd), "backward": ms(bwd),
            "forward_backward": ms([a + b for a, b in zip(fwd, bwd)]), "inference_forward": ms(inference)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    if args.child:
        print(json.dumps([measure(args.tokens, t, args.repeats) for t in threads]))
        return
    print(f"one LUNA map, 12 heads x {args.tokens} tokens x 64 projections, L = 2, feature norm; ms, median of "
          f"{args.repeats}\n")
    print("| path | threads | forward | backward | forward + backward | forward, no grad |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for setting in ("0", "1"):
        env = {**os.environ, "LUNA_CONVERT_NATIVE": setting}
        out = subprocess.run([sys.executable, __file__, "--child", "--tokens", str(args.tokens), "--threads",
                              args.threads, "--repeats", str(args.repeats)], env=env, check=True,
                             capture_output=True, text=True).stdout
        for row in json.loads(out.strip().splitlines()[-1]):
            path = "native" if row["native"] == "on" else "PyTorch"
            print(f"| {path} | {row['threads']} | {row['forward']} | {row['backward']} | {row['forward_backward']} "
                  f"| {row['inference_forward']} |")


if __name__ == "__main__":
    main()
