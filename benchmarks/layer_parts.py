"""Where one attention layer's forward time goes (no gradients), fastest of many calls in one process
(docs/benchmarks.md, *Where a layer's time goes*).

Timed apart, on the same [B, H, N, d] inputs: the whole layer; where the layer makes its features inside the
core's products (``ops.linear.produced_attention_unnormalised``), that; its feature maps
(queries and keys) stored; the linear-attention core of the stored features before its division
(``ops.linear.linear_attention_unnormalised``); the DWC branch
with the division (where the method has one); then the core's two products, torch.bmm against
``ops.products`` (the native code where it applies), the second one phi_q [S | z] with its
65 columns against phi_q S with 64, and three ways of computing the denominator phi_q z apart.

    python benchmarks/layer_parts.py --method "luna:projections=8:channels=8:per_head_projections=false:projection_init=random:channel_init=random:feature_norm=none:separate_key_map=false"
    python benchmarks/layer_parts.py --method luna --threads 2 --keep-heap
"""

from __future__ import annotations

import argparse

from map_fastest import fastest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="luna", help="a bench layer name, options after colons")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=25)
    parser.add_argument("--keep-heap", action="store_true", help="glibc's heap as the luna-convert command keeps it "
                        "(luna_convert.tools.heap); without it, glibc's defaults, as a Python user gets them")
    args = parser.parse_args()
    if args.keep_heap:
        from luna_convert.tools.heap import keep_heap

        print("heap:", keep_heap())

    import torch

    from luna_convert.ops import products
    from luna_convert.ops.linear import linear_attention_unnormalised, produced_attention_unnormalised
    from luna_convert.ops.reference import EPS
    from luna_convert.tools.bench import LinearAttention, layer_variant

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base, options = layer_variant(args.method)
    layer = LinearAttention(base, args.head_dim, args.heads, args.head_dim**-0.5, options=options)
    shape = (args.batch, args.heads, args.tokens, args.head_dim)
    q, k, v = (torch.randn(shape) for _ in range(3))

    def show(name: str, fn) -> None:
        ms, faults = fastest(fn, args.calls)
        print(f"{name:44s} {ms:8.2f} ms  ({faults:.0f} minor faults a call)")

    with torch.no_grad():
        phi_q, phi_k = layer.features(q, k, None)
        sums = linear_attention_unnormalised(phi_q, phi_k, v)
        show("layer", lambda: layer(q, k, v))
        if layer.feature_rows(q, k) is not None:  # what the layer runs: the features never stored
            show("maps + core, features made in the products", lambda: produced_attention_unnormalised(
                *layer.feature_rows(q, k), v))
        show("feature maps (q and k), stored", lambda: layer.features(q, k, None))
        show("core, undivided, of stored features", lambda: linear_attention_unnormalised(phi_q, phi_k, v))
        if layer.dwc is not None:
            show("DWC with the division", lambda: layer.dwc(v, None, plus=sums, divide=(EPS, False)))
        rows, width = args.batch * args.heads, phi_q.shape[-1]
        phi = phi_q.reshape(rows, args.tokens, width)
        phi_keys, values = phi_k.reshape(rows, args.tokens, width), v.reshape(rows, args.tokens, args.head_dim)
        print("ops.products:", products.native_status())
        show("[S | z]: bmm(phi_k^T, v), phi_k's sum, cat", lambda: torch.cat(
            [torch.bmm(phi_keys.transpose(1, 2), values), phi_keys.sum(1).unsqueeze_(-1)], -1))
        show("[S | z]: ops.products", lambda: products.transposed_product(phi_keys, values, with_sum=True))
        sz = torch.randn(rows, width, args.head_dim + 1)
        s, z = sz[..., :-1].contiguous(), sz[..., -1].contiguous()
        show("phi_q [S | z]: ops.products", lambda: products.product(phi, sz))
        show(f"phi_q [S | z], D = {width}, 65 columns", lambda: torch.bmm(phi, sz))
        show("phi_q S, 64 columns", lambda: torch.bmm(phi, s))
        show("phi_q z apart: bmm(phi_q, z)", lambda: torch.bmm(phi, z[:, :, None]))
        show("phi_q z apart: (phi_q * z).sum(-1)", lambda: (phi * z[:, None]).sum(-1))
        show("phi_q z apart: bmm(z^T, phi_q^T)", lambda: torch.bmm(z[:, None], phi.transpose(1, 2)))


if __name__ == "__main__":
    main()
