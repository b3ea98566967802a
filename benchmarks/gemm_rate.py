"""What one core of this machine can do, for the one-thread limit of an attention layer
(docs/design-decisions.md, *The core's products in native code*): float32 matrix-product rate on
square matrices and on the two products of the linear-attention core (torch.bmm, and ``ops.products``, the
native code the core uses where it applies), and the copy and read bandwidth of large buffers.

The core's products at N tokens, H heads, D features and d value columns: [S | z] = phi_k^T [v | 1]
(H x [D, N] @ [N, d + 1]) and phi_q [S | z] (H x [N, D] @ [D, d + 1]). Reported: the median of ``--repeats``
wall-clock runs after warm-up, as GFLOP/s (2 m n k per product) and GB/s (bytes moved / time); outputs are
preallocated, so no page faults are timed.

    python benchmarks/gemm_rate.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time


def median_seconds(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    import torch

    from luna_convert.ops import products

    torch.set_num_threads(args.threads)
    for size in (1024, 2048):
        a, out = torch.randn(size, size), torch.empty(size, size)
        seconds = median_seconds(lambda: torch.mm(a, a, out=out), args.repeats)
        print(f"square {size} x {size}: {2 * size**3 / seconds / 1e9:.1f} GFLOP/s")
    n, h = args.tokens, args.heads
    for features, columns in ((64, 65), (64, 64), (128, 65)):
        phi = torch.randn(h, n, features)
        values, state = torch.randn(h, n, columns), torch.randn(h, features, columns)
        out_state, out_rows = torch.empty(h, features, columns), torch.empty(h, n, columns)
        flops = 2 * h * n * features * columns
        for name, transposed, product in (
                ("torch.bmm", lambda: torch.bmm(phi.transpose(1, 2), values, out=out_state),
                 lambda: torch.bmm(phi, state, out=out_rows)),
                (f"ops.products ({products.native_status()})", lambda: products.transposed_product(phi, values),
                 lambda: products.product(phi, state))):
            t_state, t_rows = median_seconds(transposed, args.repeats), median_seconds(product, args.repeats)
            print(f"core products, {h} x N={n}, D={features}, {columns} columns, {name}: phi_k^T [v|1] "
                  f"{1e3 * t_state:.2f} ms ({flops / t_state / 1e9:.1f} GFLOP/s), phi_q [S|z] {1e3 * t_rows:.2f} ms "
                  f"({flops / t_rows / 1e9:.1f} GFLOP/s)")
    big = torch.randn(64 << 18)  # 64 MiB, beyond the caches
    copy = torch.empty_like(big)
    seconds = median_seconds(lambda: copy.copy_(big), args.repeats)
    print(f"copy of 64 MiB: {2 * big.numel() * 4 / seconds / 1e9:.1f} GB/s (read + write)")
    seconds = median_seconds(lambda: big.sum(), args.repeats)
    print(f"sum of 64 MiB: {big.numel() * 4 / seconds / 1e9:.1f} GB/s (read)")


if __name__ == "__main__":
    main()
