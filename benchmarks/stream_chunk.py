"""How large the streamed path's chunks should be (docs/benchmarks.md, *Streaming*).

For each method:tokens case, the layer (12 heads x 64, batch 1, float32) is timed with each chunk size
of --chunk-mib in alternating rounds: the fastest forward (no grad) and forward + backward in ms, and
the aten operator calls of one forward. With --background-load P, P worker processes multiply
matrices on the other cores for the whole run (the bench's busy condition).

    python benchmarks/stream_chunk.py --cases taylor:4096,t2r:16384,hedgehog:16384 --chunk-mib 4,8,16,28
"""

from __future__ import annotations

import argparse
import contextlib

from layer_ab import fastest_ms, layer_calls  # benchmarks/ is the script's own folder, first on sys.path

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="taylor:4096,t2r:16384,hedgehog:16384",
                        help="comma-separated bench layer names with their token counts, name:tokens")
    parser.add_argument("--chunk-mib", default="4,8,16,28", help="comma-separated chunk sizes in MiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--background-load", type=int, default=0, help="worker processes doing matrix products")
    args = parser.parse_args()

    import torch

    from luna_convert.tools import bench
    from luna_convert.tools.background_load import background_load

    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.chunk_mib.split(",")]
    load = background_load(args.background_load) if args.background_load else contextlib.nullcontext()
    with load:
        for case in args.cases.split(","):
            method, tokens = case.rsplit(":", 1)
            n = int(tokens)
            torch.manual_seed(0)
            base, options = bench.layer_variant(method)
            layer = bench.LinearAttention(base, 64, 12, 64**-0.5, options=options)
            forward, train_step = layer_calls(layer, 1, n)
            best = {size: [float("inf"), float("inf")] for size in sizes}
            calls = {}
            for _ in range(args.rounds):
                for size in sizes:
                    layer.stream_chunk_bytes = size * MIB
                    best[size][0] = min(best[size][0], fastest_ms(forward, 2))
                    best[size][1] = min(best[size][1], fastest_ms(train_step, 1))
                    calls[size] = bench.forward_ops(forward).total
            for size in sizes:
                layer.stream_chunk_bytes = size * MIB
                chunk = layer.stream_chunk(1, n, training=False)
                print(f"{method} N={n} chunk {size} MiB ({chunk} tokens): forward {best[size][0]:.1f} ms, "
                      f"forward + backward {best[size][1]:.1f} ms, calls {calls[size]}", flush=True)


if __name__ == "__main__":
    main()
