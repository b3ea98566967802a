"""One attention layer at two commits, timed in one process (docs/performance-log.md, *Fewer passes over
memory in the feature maps*).

The package as it is at --base (a git commit) is exported beside the working tree's under another name,
and each method's layer of both versions is timed in alternating rounds, so a change is measured
against its parent under the same machine conditions. Reported: the fastest forward (no grad) and
forward + backward of each version over all rounds, in ms, and new / old. On a shared machine the
fastest run is the one least disturbed; still, differences under about 10 % are within this machine's
run-to-run spread.

    python benchmarks/layer_ab.py --base d8d930e --methods performer,flexformer --batch 1 --tokens 4096
    python benchmarks/layer_ab.py --base 989503b --methods luna --grid 64x64 --prefix 1   # a ViT's layer: DWC on the grid
    python benchmarks/layer_ab.py --base 4bd2f61 --methods luna --part maps   # the feature maps alone
    python benchmarks/layer_ab.py --base 105b667 --methods hedgehog,relu --threads 2 --background-load 1   # busy
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

OLD_NAME = "luna_convert_base"


def export_base(commit: str, into: Path) -> None:
    """``luna_convert/`` at ``commit`` -> ``into/luna_convert_base`` (its imports are relative)."""
    root = Path(__file__).resolve().parents[1]
    archive = into / "base.tar"
    subprocess.run(["git", "-C", str(root), "archive", "--format=tar", "-o", str(archive), commit, "luna_convert"],
                   check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    (into / "luna_convert").rename(into / OLD_NAME)


def fastest_ms(fn, calls: int) -> float:
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return 1000 * best


def layer_calls(layer, batch: int, tokens: int, maps_only: bool = False, **patch_layout):
    """(forward without gradients, forward + backward) of ``layer`` on random [batch, 12, tokens, 64] q, k, v,
    heads split as a model splits them; ``patch_layout``: grid and num_prefix for an image layer. ``maps_only``:
    of its feature maps alone (``LinearAttention.features`` of q and k), random gradients for both."""
    import torch

    shape = (batch, tokens, 12, 64)
    q, k, v = (torch.randn(shape).transpose(1, 2) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    grad = torch.randn(batch, 12, tokens, 64)
    if maps_only:
        feature_grads = [torch.randn(batch, 12, tokens, layer.feature_dim) for _ in range(2)]

        def maps_forward():
            with torch.no_grad():
                layer.features(q, k)

        def maps_train_step():
            torch.autograd.backward(layer.features(qg, kg), feature_grads)
            qg.grad = kg.grad = None
            layer.zero_grad(set_to_none=True)

        return maps_forward, maps_train_step

    def forward():
        with torch.no_grad():
            layer(q, k, v, **patch_layout)

    def train_step():
        layer(qg, kg, vg, **patch_layout).backward(grad)
        qg.grad = kg.grad = vg.grad = None
        layer.zero_grad(set_to_none=True)

    return forward, train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git commit to compare the working tree against")
    parser.add_argument("--methods", required=True, help="comma-separated bench layer names")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--grid", help="GHxGW: an image layer (spatial DWC) over this patch grid; sets --tokens")
    parser.add_argument("--prefix", type=int, default=0, help="prefix tokens before the grid (with --grid)")
    parser.add_argument("--part", choices=("layer", "maps"), default="layer",
                        help="time the whole layer, or its feature maps alone (feature-map methods)")
    parser.add_argument("--keep-heap", action="store_true",
                        help="glibc's heap as the luna-convert command keeps it (luna_convert.tools.heap)")
    parser.add_argument("--background-load", type=int, default=0,
                        help="single-threaded matrix-product processes running meanwhile (the bench's busy condition)")
    args = parser.parse_args()
    patch_layout = {}
    if args.grid:
        grid = tuple(int(side) for side in args.grid.lower().split("x"))
        patch_layout = {"grid": grid, "num_prefix": args.prefix}
        args.tokens = args.prefix + grid[0] * grid[1]

    import torch

    torch.set_num_threads(args.threads)
    from luna_convert.tools.background_load import background_load

    if args.keep_heap:
        from luna_convert.tools.heap import keep_heap

        print("heap:", keep_heap())

    load = background_load(args.background_load) if args.background_load else contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as tmp, load:
        export_base(args.base, Path(tmp))
        sys.path.insert(0, tmp)
        versions = {"old": importlib.import_module(f"{OLD_NAME}.tools.bench"),
                    "new": importlib.import_module("luna_convert.tools.bench")}
        for method in args.methods.split(","):
            runs = {}
            for name, bench in versions.items():
                torch.manual_seed(0)
                base, options = bench.layer_variant(method)
                layer = bench.LinearAttention(base, 64, 12, 64**-0.5, spatial=bool(patch_layout), options=options)
                runs[name] = layer_calls(layer, args.batch, args.tokens, args.part == "maps", **patch_layout)
            best = {name: [float("inf"), float("inf")] for name in runs}
            for _ in range(args.rounds):
                for name, (forward, train_step) in runs.items():
                    best[name][0] = min(best[name][0], fastest_ms(forward, 3))
                    best[name][1] = min(best[name][1], fastest_ms(train_step, 2))
            (old_f, old_fb), (new_f, new_fb) = best["old"], best["new"]
            part = " (feature maps)" if args.part == "maps" else ""
            print(f"{method}{part} B={args.batch} N={args.tokens}: old {old_f:.1f} / {old_fb:.1f} ms, "
                  f"new {new_f:.1f} / {new_fb:.1f} ms, new/old forward {new_f / old_f:.2f}, "
                  f"forward + backward {new_fb / old_fb:.2f}", flush=True)


if __name__ == "__main__":
    main()
