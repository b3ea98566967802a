"""Explicit N x N attention: the reference every fast path is tested against, the
distillation student (linear-attention weights) and teacher (masked softmax).

Shapes as in :mod:`luna_convert.ops`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dtypes import accumulation_dtype

EPS = 1e-6


def linear_attention_weights(
    phi_q: torch.Tensor, phi_k: torch.Tensor, key_mask: torch.Tensor | None = None, eps: float = EPS,
    clamp: bool = False, floor: float | None = None,
) -> torch.Tensor:
    """Explicit A_ij = phi(q_i)^T phi(k_j) / (sum_m phi(q_i)^T phi(k_m) + eps), in fp32 (float64 for float64). [B, H, N, N]

    ``clamp``: the row sum is clamped at eps instead (signed features). ``floor``: clamped at
    max(floor |phi(q_i)| sum_m |phi(k_m)|, eps) over real keys m instead (``ops.linear.floored_linear_attention``)."""
    compute = accumulation_dtype(phi_q, phi_k)
    phi_q, phi_k = phi_q.to(compute), phi_k.to(compute)
    scores = torch.einsum("bhnf,bhmf->bhnm", phi_q, phi_k)
    if key_mask is not None:
        scores = scores * key_mask[:, None, None, :]
    den = scores.sum(-1, keepdim=True)
    if floor is not None:
        norms = phi_k.norm(dim=-1) if key_mask is None else phi_k.norm(dim=-1) * key_mask[:, None, :]
        bound = phi_q.norm(dim=-1, keepdim=True) * norms.sum(-1)[..., None, None]
        return scores / torch.maximum(den, floor * bound).clamp_min(eps)
    return scores / (den.clamp_min(eps) if clamp else den + eps)


def window_stabiliser(window_scores: torch.Tensor) -> torch.Tensor:
    """c_i of the window hybrid: the row maximum of scores masked to -inf outside the window, 0 for a row
    whose window holds no real key (so exp(s - c) stays finite)."""
    row_max = window_scores.amax(-1, keepdim=True)
    return torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))


def windowed_linear_attention_weights(
    q: torch.Tensor, k: torch.Tensor, phi_q: torch.Tensor, phi_k: torch.Tensor, gamma: torch.Tensor, window: int,
    scale: float, key_mask: torch.Tensor | None = None, eps: float = EPS, clamp: bool = False,
) -> torch.Tensor:
    """Explicit sliding-window softmax + linear attention, a_ij / (sum_m a_im + eps), in fp32 (float64 for
    float64). [B, H, N, N]

    s_ij = scale q_i . k_j; W(i) = {j real : |i - j| <= window}; c_i = max over W(i) of s_ij (0 if empty);
    a_ij = exp(s_ij - c_i) in W(i), gamma_h phi(q_i) . phi(k_j) for the other real keys, 0 for pads.
    ``gamma``: [H]. ``clamp``: the row sum is clamped at eps instead (signed features)."""
    compute = accumulation_dtype(q, k, phi_q, phi_k)
    n = q.shape[2]
    scores = torch.einsum("bhnd,bhmd->bhnm", q.to(compute), k.to(compute)) * scale
    kernel = torch.einsum("bhnf,bhmf->bhnm", phi_q.to(compute), phi_k.to(compute))
    position = torch.arange(n, device=q.device)
    real = torch.ones(q.shape[0], n, dtype=torch.bool, device=q.device) if key_mask is None else key_mask.bool()
    real = real[:, None, None, :]
    in_window = ((position[:, None] - position[None, :]).abs() <= window) & real  # [B, 1, N, N]
    scores = scores.masked_fill(~in_window, float("-inf"))  # exp of the rest is never taken: no inf * 0 in gradients
    far = gamma.to(compute)[:, None, None] * kernel * real
    weights = torch.where(in_window, torch.exp(scores - window_stabiliser(scores)), far)
    den = weights.sum(-1, keepdim=True)
    return weights / (den.clamp_min(eps) if clamp else den + eps)


def softmax_attention_weights(
    q: torch.Tensor, k: torch.Tensor, scale: float, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(q k^T * scale) over real keys, in fp32 (float64 for float64). [B, H, N, N]"""
    compute = accumulation_dtype(q, k)
    scores = torch.einsum("bhnd,bhmd->bhnm", q.to(compute), k.to(compute)) * scale
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1)


def attention_distillation_loss(
    teacher: torch.Tensor, student: torch.Tensor, key_mask: torch.Tensor | None = None, eps: float = EPS
) -> torch.Tensor:
    """Row cross-entropy -sum_j a_ij log a^_ij, averaged over heads and real query rows (Hedgehog stage 1)."""
    ce = -(teacher * torch.log(student + eps)).sum(-1)  # [B, H, N]
    if key_mask is None:
        return ce.mean()
    rows = key_mask[:, None, :].expand_as(ce)
    return ce[rows].mean()


def softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(q k^T * scale) v over real keys through SDPA (no N x N kept where a fused kernel runs);
    in fp32 for lower precisions, float64 for float64. [B, H, N, d]"""
    compute = accumulation_dtype(q, k)
    mask = None if key_mask is None else key_mask[:, None, None, :]
    with torch.autocast(device_type=q.device.type, enabled=False):
        out = F.scaled_dot_product_attention(q.to(compute), k.to(compute), v.to(compute), attn_mask=mask,
                                             scale=scale)
    return out.to(v.dtype)


def output_distillation_loss(teacher: torch.Tensor, student: torch.Tensor,
                             key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Relative squared error of the attention output, sum_rows |o^_i - o_i|^2 / sum_rows |o_i|^2 over
    heads and real query rows (LoLCATs-style output matching; comparable across layers)."""
    compute = accumulation_dtype(teacher, student)
    err = (student.to(compute) - teacher.to(compute)).pow(2).sum(-1)  # [B, H, N]
    ref = teacher.to(compute).pow(2).sum(-1)
    if key_mask is not None:
        rows = key_mask[:, None, :].expand_as(err)
        err, ref = err[rows], ref[rows]
    return err.sum() / ref.sum().clamp_min(1e-12)


def logits_distillation_loss(teacher: torch.Tensor, student: torch.Tensor,
                             token_mask: torch.Tensor | None = None, over_positions: bool = False) -> torch.Tensor:
    """The model-level target: KL(softmax(teacher) || softmax(student)) over the classes, mean over
    examples (as RADLADS / Mamba-in-the-Llama distil); one output (regression): the squared error.
    Per-token logits [B, N, C] with ``token_mask`` [B, N]: the mean over real tokens only. ``over_positions``:
    logits [B, R, N] whose rows are distributions over the N positions (extractive QA's start and end rows),
    padded positions (``token_mask`` 0) left out of every row's softmax; the mean over the B x R rows."""
    teacher, student = teacher.float(), student.float()
    if over_positions:
        if token_mask is not None:
            # a finite stand-in for -inf: a padded position gets probability 0 and adds 0 (not NaN) to the KL
            padded = ~token_mask.bool()[:, None, :]
            teacher, student = teacher.masked_fill(padded, -1e9), student.masked_fill(padded, -1e9)
    elif teacher.dim() == 3 and token_mask is not None:
        real = token_mask.bool()
        teacher, student = teacher[real], student[real]
    if teacher.shape[-1] == 1:
        return (student - teacher).pow(2).mean()
    log_t, log_s = F.log_softmax(teacher, -1), F.log_softmax(student, -1)
    return (log_t.exp() * (log_t - log_s)).sum(-1).mean()
