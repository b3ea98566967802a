"""LUNA's channel bank and feature norm for one map, native kernel against the PyTorch path
(docs/performance-log.md, *LUNA's native channel kernel*).

One map at the conversion defaults: 12 heads x N tokens x 64 projections, L = 2 channels at their exp
init, the feature norm (``--form paper``: 8 projections, L = 8 channels at their random init, no norm);
forward with gradients recorded (the tables built, as in training), its backward, and the forward without
gradients (the tables cached, as at inference). Wall clock, median of --repeats, each path in its own
process (``LUNA_CONVERT_NATIVE`` is read when the kernel is loaded): the PyTorch path, the native kernel
in its portable build (``ops.native.FLAGS`` alone) and as ``ops.native`` builds it (``-march=native`` too).

    python benchmarks/channel_kernel.py --threads 1,2
    python benchmarks/channel_kernel.py --threads 1 --form paper
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


FORMS = {"defaults": (64, 2, "exp", True), "paper": (8, 8, "random", False)}  # M, L, channel init, norm


def measure(tokens: int, threads: int, repeats: int, form: str, portable: bool) -> dict:
    import torch

    from luna_convert.linear_methods.luna import FEATURE_NORM_EPS, ScalarChannels
    from luna_convert.linear_methods.luna_kernel import channel_features_of
    from luna_convert.linear_methods.luna_native import status
    from luna_convert.ops import native

    if portable:
        native.TUNED_FLAGS = ()
    projections, channels, init, norm = FORMS[form]
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    psi = ScalarChannels(channels, 64, init=init)
    u = (2 * torch.randn(1, 12, tokens, projections)).requires_grad_()
    grad = torch.randn(1, 12, tokens, projections, channels)
    norm_eps = FEATURE_NORM_EPS if norm else None
    run = lambda: channel_features_of(psi, u, scale=projections**-0.5, norm_eps=norm_eps)[0]  # noqa: E731
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
    parser.add_argument("--form", choices=sorted(FORMS), default="defaults")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--portable", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    if args.child:
        print(json.dumps([measure(args.tokens, t, args.repeats, args.form, args.portable) for t in threads]))
        return
    projections, channels, _, norm = FORMS[args.form]
    print(f"one LUNA map, 12 heads x {args.tokens} tokens x {projections} projections, L = {channels}, "
          f"{'feature norm' if norm else 'no norm'}; ms, median of {args.repeats}\n")
    print("| path | threads | forward | backward | forward + backward | forward, no grad |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for label, setting, extra in (("PyTorch", "0", []), ("native, portable build", "1", ["--portable"]),
                                  ("native", "1", [])):
        env = {**os.environ, "LUNA_CONVERT_NATIVE": setting}
        out = subprocess.run([sys.executable, __file__, "--child", "--tokens", str(args.tokens), "--threads",
                              args.threads, "--repeats", str(args.repeats), "--form", args.form, *extra], env=env,
                             check=True, capture_output=True, text=True).stdout
        for row in json.loads(out.strip().splitlines()[-1]):
            path = label if row["native"] == "on" else "PyTorch"
            print(f"| {path} | {row['threads']} | {row['forward']} | {row['backward']} | {row['forward_backward']} "
                  f"| {row['inference_forward']} |")


if __name__ == "__main__":
    main()
