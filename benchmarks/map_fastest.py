"""One LUNA map's native pass without gradients, fastest of many calls in one process, with the minor page
faults per call (docs/design-decisions.md, *The CLI keeps glibc's heap*).

On a machine where a faulted page is expensive (a VM), medians of a few calls mostly measure which calls
found their output buffer's pages already mapped; the fastest of many measures the pass. Timed: the
channel pass on a projected u (``luna_kernel.channel_features_of``; the conversion defaults, and the paper
form), the projection before it, and the paper form's pass with the projection inside
(``luna_kernel.projected_channel_features_of``). The channel tables are cached after the first call.

    python benchmarks/map_fastest.py --calls 60
"""

from __future__ import annotations

import argparse
import math
import resource
import time


def fastest(fn, calls: int) -> tuple[float, float]:
    """(fastest wall ms, minor faults per call) of ``calls`` calls of fn."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return 1000 * best, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch

    from luna_convert.layers.attention import LinearAttention
    from luna_convert.linear_methods import luna_kernel, luna_native
    from luna_convert.linear_methods.luna import FEATURE_NORM_EPS, PAPER_OPTIONS

    torch.set_num_threads(args.threads)
    if luna_native.library() is None:
        raise SystemExit(f"the native kernel is off: {luna_native.status()}")
    print(f"one map, 12 heads x 4,096 tokens, {args.threads} thread(s), no grad; fastest of {args.calls} calls")
    print("| form | pass | ms | faults per call |\n| --- | --- | ---: | ---: |")
    for form, options, norm_eps in (("defaults", {}, FEATURE_NORM_EPS), ("paper", dict(PAPER_OPTIONS), None)):
        torch.manual_seed(0)
        feature_map = LinearAttention("luna", 64, 12, 0.125, **options).eval().phi_q
        x = torch.randn(1, 4096, 12, 64).transpose(1, 2)  # heads split from [B, N, H*d], as the adapters pass them
        scale, psi = 1 / math.sqrt(feature_map.projections), feature_map.psi
        with torch.no_grad():
            u = feature_map.project(x).contiguous()
            runs = {"projection (PyTorch)": lambda: feature_map.project(x).contiguous(),
                    "channel pass on u": lambda: luna_kernel.channel_features_of(psi, u, scale=scale,
                                                                                 norm_eps=norm_eps)}
            if feature_map.proj is not None:
                weight, bias = feature_map.proj.weight, feature_map.proj.bias
                runs["pass with the projection inside"] = lambda: luna_kernel.projected_channel_features_of(
                    psi, weight, bias, x, scale=scale, norm_eps=norm_eps)
            for name, fn in runs.items():
                ms, faults = fastest(fn, args.calls)
                print(f"| {form} | {name} | {ms:.2f} | {faults:.0f} |")


if __name__ == "__main__":
    main()
