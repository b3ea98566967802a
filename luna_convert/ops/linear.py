"""Kernel linear attention, out_i = phi(q_i)^T S / (phi(q_i)^T z + eps) with S = sum_j phi(k_j) v_j^T and
z = sum_j phi(k_j). Its naive reference is ``reference.linear_attention_weights(phi_q, phi_k) @ v``.

``linear_attention_core`` is the autograd function with a hand-written backward (fewer passes
over [N, d] tensors, contiguous gradients); ``linear_attention`` adds masking and dtypes.
"""

from __future__ import annotations

import torch

from .dtypes import accumulation_dtype
from .reference import EPS


class _LinearAttentionCore(torch.autograd.Function):
    """out = (phi_q S) / (phi_q z + eps) with S = phi_k^T v, z = sum_j phi_k[j] (per batch and head).

    A hand-written backward: autograd's version of the division and the slicing
    makes several extra full passes over [N, d] tensors, which at long N run
    at memory speed and cost more than the matrix products. It does not keep
    the output: grad_out . out, the one place it enters, equals
    (grad_out r S^T) . phi_q, and that product is a piece of phi_q's gradient
    anyway. Every gradient comes back contiguous.
    """

    @staticmethod
    def forward(ctx, phi_q, phi_k, v, eps, clamp):
        # One batch axis (B * H) and torch.bmm, which takes transposed operands as they are:
        # 4-D torch.matmul would expand, copy and reshape around every product.
        lead = torch.broadcast_shapes(phi_q.shape[:-2], phi_k.shape[:-2], v.shape[:-2])
        phi_q, phi_k, v = (t.reshape(-1, *t.shape[-2:]) if t.shape[:-2] == lead
                           else t.expand(*lead, *t.shape[-2:]).reshape(-1, *t.shape[-2:]) for t in (phi_q, phi_k, v))
        kv_t = torch.bmm(v.transpose(1, 2), phi_k)  # S^T [BH, d, D]
        z = phi_k.sum(dim=1, keepdim=True)  # [BH, 1, D]
        den = torch.bmm(phi_q, z.transpose(1, 2))  # [BH, N, 1]
        if clamp:  # 1 / max(phi_q z, eps); where clamped, the denominator passes no gradient
            unclamped = den > eps
            r = den.clamp_min_(eps).reciprocal_()
        else:  # 1 / (phi_q z + eps)
            unclamped = None
            r = den.add_(eps).reciprocal_()
        out = torch.bmm(phi_q, kv_t.transpose(1, 2)).mul_(r)  # [BH, N, d]
        ctx.save_for_backward(phi_q, phi_k, v, kv_t, z, r, unclamped)
        ctx.lead = lead
        return out.view(*lead, *out.shape[1:])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        phi_q, phi_k, v, kv_t, z, r, unclamped = ctx.saved_tensors
        lead = ctx.lead
        grad_num = grad_out.reshape(r.shape[0], *grad_out.shape[-2:]) * r  # d loss / d (phi_q S)   [BH, N, d]
        grad_q = torch.bmm(grad_num, kv_t)  # its part of phi_q's gradient   [BH, N, D]
        # d loss / d (phi_q z) = -(grad_out . out) r, and grad_out . out = (grad_num S^T) . phi_q
        grad_den = torch.linalg.vecdot(grad_q, phi_q).unsqueeze_(-1).mul_(r).neg_()  # [BH, N, 1]
        if unclamped is not None:
            grad_den.mul_(unclamped)
        grad_q.addcmul_(grad_den, z)
        grad_kv_t = torch.bmm(grad_num.transpose(1, 2), phi_q)  # [BH, d, D]
        grad_z = torch.bmm(grad_den.transpose(1, 2), phi_q)  # [BH, 1, D]
        grad_k = torch.bmm(v, grad_kv_t).add_(grad_z).view(*lead, *phi_k.shape[1:]) if ctx.needs_input_grad[1] else None
        grad_v = torch.bmm(phi_k, grad_kv_t.transpose(1, 2)).view(*lead, *v.shape[1:]) if ctx.needs_input_grad[2] else None
        grad_q = grad_q.view(*lead, *phi_q.shape[1:]) if ctx.needs_input_grad[0] else None
        return grad_q, grad_k, grad_v, None, None


def linear_attention_core(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, eps: float,
                          clamp: bool = False) -> torch.Tensor:
    """phi_q S / (phi_q z + eps) for [B, H, N, D] features and [B, H, N, d] values, all of one float dtype
    (``clamp``: phi_q S / max(phi_q z, eps), the guard for signed features, whose sums can be <= 0).

    The caller handles masking (zeroed phi_k rows) and dtypes; see
    ``linear_attention`` below.
    """
    return _LinearAttentionCore.apply(phi_q, phi_k, v, eps, clamp)


def linear_attention(
    phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None, eps: float = EPS,
    clamp: bool = False,
) -> torch.Tensor:
    """out_i = phi(q_i)^T S / (phi(q_i)^T z + eps), S = sum_j phi(k_j) v_j^T, z = sum_j phi(k_j)
    (``clamp``: divided by max(phi(q_i)^T z, eps) instead, for signed features).

    Pads are removed by zeroing phi(k) (not k or v: phi(0) need not be 0).
    Sums and the division run in fp32 even under autocast, so bf16/fp16
    inputs cannot overflow the sums or divide by a rounded-off zero; float64
    inputs stay float64.
    """
    out_dtype, compute = v.dtype, accumulation_dtype(phi_q, phi_k, v)
    with torch.autocast(device_type=v.device.type, enabled=False):
        phi_q, phi_k, v = phi_q.to(compute), phi_k.to(compute), v.to(compute)
        if key_mask is not None:
            phi_k = phi_k * key_mask[:, None, :, None].to(phi_k.dtype)
        out = linear_attention_core(phi_q, phi_k, v, eps, clamp)
    return out.to(out_dtype)
