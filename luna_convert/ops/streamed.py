"""Linear attention streamed over chunks of tokens, for long inputs on the CPU.

Same values and gradients as :func:`luna_convert.ops.linear.linear_attention` on the full
features (its reference); never holds phi(q) or phi(k) for all tokens at once.

Feature maps that derive something costly from their parameters before touching any token
(LUNA's channel tables) can share it across the chunks of one backward through
:func:`current_recompute_scope` (one scope per backward call, held in a context variable, so
two threads in their backwards at once never see each other's tensors).
"""

from __future__ import annotations

import contextvars
from typing import Callable

import torch

from . import products
from .context import AttentionContext
from .dtypes import accumulation_dtype
from .linear import divide_by_last_column
from .reference import EPS


class RecomputeScope:
    """Tensors derived from parameters, built once per streamed backward and shared by its chunks.

    ``shared(key, build)`` builds them on the first call (``build() -> (tensors, extra)``, the
    tensors keeping their graph to the parameters) and hands out detached leaf copies, the same
    ones to every later chunk; the backward then carries the leaves' summed gradients back to the
    parameters once (``pullback``).
    """

    def __init__(self):
        self.entries: dict = {}  # key -> (tensors with graph, leaf copies, extra)

    def shared(self, key, build: Callable[[], tuple]) -> tuple:
        """(leaf copies of the built tensors, extra) for ``key``, built on the first call."""
        if key not in self.entries:
            tensors, extra = build()
            leaves = tuple(t.detach().requires_grad_() for t in tensors)
            self.entries[key] = (tuple(tensors), leaves, extra)
        _, leaves, extra = self.entries[key]
        return leaves, extra

    def leaves(self) -> list[torch.Tensor]:
        return [leaf for _, leaves, _ in self.entries.values() for leaf in leaves]

    def pullback(self, leaf_grads: dict, params: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Gradients of ``params`` from the accumulated gradients of the leaves."""
        outputs, grads = [], []
        for tensors, leaves, _ in self.entries.values():
            for t, leaf in zip(tensors, leaves):
                if leaf in leaf_grads and t.requires_grad:
                    outputs.append(t)
                    grads.append(leaf_grads[leaf])
        if not outputs or not params:
            return [None] * len(params)
        return list(torch.autograd.grad(outputs, params, grads, allow_unused=True))


# The scope of the streamed backward running in this thread (a thread's context starts with None).
_RECOMPUTE_SCOPE: contextvars.ContextVar[RecomputeScope | None] = contextvars.ContextVar("recompute_scope", default=None)


def current_recompute_scope() -> RecomputeScope | None:
    """The scope of the streamed backward running now in this thread, or None outside one."""
    return _RECOMPUTE_SCOPE.get()


def _token_chunks(n: int, chunk: int):
    return [slice(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def _chunk_features(phi, x: torch.Tensor, rows: slice, compute: torch.dtype,
                    keep: torch.Tensor | None = None, context: AttentionContext | None = None) -> torch.Tensor:
    """phi(x[:, :, rows]) in ``compute`` dtype, rows of pad keys zeroed where ``keep`` ([B, 1, N, 1] bool) says so.

    With a ``context``, phi also gets the context of those rows (token positions of the chunk)."""
    part = x[:, :, rows]
    feats = (phi(part) if context is None else phi(part, context.rows(rows))).to(compute)
    return feats if keep is None else feats * keep[:, :, rows].to(feats.dtype)


class _StreamedLinearAttention(torch.autograd.Function):
    """Linear attention that never holds phi(q) or phi(k) for all tokens at once.

    Forward: S = sum_j phi(k_j) v_j^T and z = sum_j phi(k_j) are accumulated over
    chunks of keys, then each chunk of queries gives its rows of the output.
    Backward recomputes the features chunk by chunk (one extra feature-map
    forward) and pulls their gradients through ``torch.autograd.grad``, so
    only q, k, v, S and z are saved. Long sequences gain twice: every
    intermediate stays small enough for the cache, and no [N, D]-sized buffer
    is allocated per call (above 32 MiB, glibc hands those out as fresh
    mmapped pages, and faulting them in costs as much as the arithmetic).
    """

    @staticmethod
    def forward(ctx, q, k, v, key_mask, eps, chunk, phi_q, phi_k, q_context, k_context, *params):
        n, compute = v.shape[2], accumulation_dtype(q, k, v)
        keep = None if key_mask is None else key_mask[:, None, :, None]
        kvz = None  # [S | z], [B, H, D, d + 1]: S = sum pk^T v, z = sum pk (pads' pk are zero)
        for c in _token_chunks(n, chunk):
            pk = _chunk_features(phi_k, k, c, compute, keep, k_context)
            part = products.transposed_product(pk, v[:, :, c].to(compute), with_sum=True)
            kvz = part if kvz is None else kvz.add_(part)
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        for c in _token_chunks(n, chunk):
            pq = _chunk_features(phi_q, q, c, compute, context=q_context)
            out[:, :, c] = divide_by_last_column(products.product(pq, kvz), eps)  # pq S / (pq z + eps)
        device_type = v.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.eps, ctx.chunk, ctx.phi_q, ctx.phi_k, ctx.compute = eps, chunk, phi_q, phi_k, compute
        ctx.contexts = (q_context, k_context)
        ctx.save_for_backward(q, k, v, key_mask, kvz, *params)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        scope = RecomputeScope()
        token = _RECOMPUTE_SCOPE.set(scope)
        try:
            return _StreamedLinearAttention._backward(ctx, grad_out, scope)
        finally:
            _RECOMPUTE_SCOPE.reset(token)

    @staticmethod
    def _backward(ctx, grad_out, scope: RecomputeScope):
        q, k, v, key_mask, kvz, *params = ctx.saved_tensors
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        need_params = ctx.needs_input_grad[10:]
        wanted = [p for p, need in zip(params, need_params) if need]
        param_grads = [torch.zeros_like(p) for p in wanted]
        leaf_grads: dict = {}
        n = v.shape[2]
        grad_q = torch.empty_like(q) if need_q else None
        grad_k = torch.empty_like(k) if need_k else None
        grad_v = torch.empty_like(v) if need_v else None
        d = v.shape[-1]
        # S^T [B, H, d, D] and z^T [B, H, 1, D], contiguous once for the products of every chunk
        kv_t, z_t = (t.contiguous() for t in kvz.transpose(-1, -2).split([d, 1], -2))
        d_kvz = torch.zeros_like(kvz)  # [d S | d z]
        keep = None if key_mask is None else key_mask[:, None, :, None]
        device_type, autocast_on, autocast_dtype = ctx.autocast
        q_context, k_context = ctx.contexts

        def features(phi, x, need_x, rows, masked=False, context=None):
            """phi(x[rows]) recomputed with a graph back to x's rows (if needed) and the parameters."""
            xc = x[:, :, rows].detach().requires_grad_(need_x)
            with torch.enable_grad(), torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
                feats = _chunk_features(phi, xc, slice(None), ctx.compute,
                                        keep[:, :, rows] if masked and keep is not None else None,
                                        None if context is None else context.rows(rows))
            return xc, feats

        def pull(feats, xc, need_x, grad_feats, grad_x, rows):
            """Back-propagate grad_feats into x's rows, the parameters and the scope's leaf tables."""
            if not feats.requires_grad:  # nothing upstream needs a gradient
                if need_x:
                    grad_x[:, :, rows] = 0
                return
            leaves = scope.leaves() if wanted else []
            inputs = ([xc] if need_x else []) + wanted + leaves
            grads = list(torch.autograd.grad(feats, inputs, grad_feats, allow_unused=True))
            if need_x:
                grad_x[:, :, rows] = grads.pop(0)
            for acc, g in zip(param_grads, grads[: len(wanted)]):
                if g is not None:
                    acc.add_(g)
            for leaf, g in zip(leaves, grads[len(wanted):]):
                if g is not None:
                    leaf_grads[leaf] = g if leaf not in leaf_grads else leaf_grads[leaf].add_(g)

        # Queries: out = (pq kv) r with r = 1 / (pq z + eps).
        for c in _token_chunks(n, ctx.chunk):
            qc, pq = features(ctx.phi_q, q, need_q, c, context=q_context)
            with torch.no_grad():
                pq_ = pq.detach()
                num, den = products.product(pq_, kvz).split([d, 1], -1)
                r = den.add_(ctx.eps).reciprocal_()
                o = num * r
                g = grad_out[:, :, c].to(ctx.compute)
                g_num = g * r  # d loss / d (pq kv)
                g_den = torch.linalg.vecdot(g, o)[..., None].mul_(r).neg_()  # d loss / d (pq z)
                d_kvz.add_(products.transposed_product(pq_, torch.cat([g_num, g_den], -1)))
                grad_pq = products.product(g_num, kv_t).addcmul_(g_den, z_t)
            pull(pq, qc, need_q, grad_pq, grad_q, c)
        # Keys and values: kv = sum pk^T v, z = sum pk.
        d_kv = d_kvz[..., :d].contiguous()
        d_kvz_t = d_kvz.transpose(-1, -2).contiguous()  # [d S^T ; d z^T], [B, H, d + 1, D]
        for c in _token_chunks(n, ctx.chunk):
            kc, pk = features(ctx.phi_k, k, need_k, c, masked=True, context=k_context)
            with torch.no_grad():
                if need_v:
                    grad_v[:, :, c] = products.product(pk.detach(), d_kv)
                grad_pk = products.product(v[:, :, c].to(ctx.compute), d_kvz_t[..., :d, :], bias=d_kvz_t[..., d:, :])
            pull(pk, kc, need_k, grad_pk, grad_k, c)
        for acc, g in zip(param_grads, scope.pullback(leaf_grads, wanted)):
            if g is not None:
                acc.add_(g)
        grads = iter(param_grads)
        param_out = [next(grads) if need else None for need in need_params]
        return (grad_q, grad_k, grad_v, None, None, None, None, None, None, None, *param_out)


def streamed_linear_attention(q, k, v, phi_q, phi_k, params, key_mask=None, eps: float = EPS,
                              chunk: int = 1024, q_context: AttentionContext | None = None,
                              k_context: AttentionContext | None = None) -> torch.Tensor:
    """phi_q(q) S / (phi_q(q) z + eps) over chunks of ``chunk`` tokens, for token-wise feature maps.

    ``phi_q`` and ``phi_k`` map [B, H, n, d] to [B, H, n, D] one token at a time;
    ``params`` are the tensors they depend on (their gradients come back through
    autograd). key_mask: bool [B, N], True = real. Returns [B, H, N, d] in v's
    dtype; sums, the division and gradients run in float32 (float64 for float64 inputs). Same values and
    gradients as ``ops.linear.linear_attention(phi_q(q), phi_k(k), v)``.

    With ``q_context`` / ``k_context`` (see :class:`~luna_convert.ops.context.AttentionContext`) the maps are
    called as ``phi(x_chunk, context.rows(chunk))``, so position-aware maps see their chunk's positions.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    return _StreamedLinearAttention.apply(q, k, v, key_mask, eps, chunk, phi_q, phi_k, q_context, k_context, *params)
