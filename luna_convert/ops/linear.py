"""Kernel linear attention, out_i = phi(q_i)^T S / (phi(q_i)^T z + eps) with S = sum_j phi(k_j) v_j^T and
z = sum_j phi(k_j). Its naive reference is ``reference.linear_attention_weights(phi_q, phi_k) @ v``.

``linear_attention_core`` is the autograd function with a hand-written backward (fewer passes
over [N, d] tensors, contiguous gradients, the key mask folded into the products);
``linear_attention`` adds dtypes.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from . import products
from .dtypes import accumulation_dtype
from .reference import EPS


@dataclass(frozen=True)
class Divisor:
    """How each row is divided by its sum d_i = phi(q_i)^T z: a feature map says (``FeatureMap.divisor``), the
    functions here apply it.

    ``clamp``: by max(d_i, eps), not d_i + eps: a signed kernel's d_i may be 0 or negative (such rows are never
    streamed). ``floor`` f (with clamp): by max(d_i, f |phi(q_i)| sum_j |phi(k_j)|, eps)
    (:func:`floored_linear_attention`). ``check``: the features are exps under stabilisers that cancel in the
    division; rows whose d_i is that of underflowed features are warned about (:func:`warn_small_denominators`).
    """

    clamp: bool = False
    floor: float | None = None
    check: bool = False

    @staticmethod
    def signed(floor: float | None = None) -> "Divisor":
        return Divisor(clamp=True, floor=floor)


def _sums_and_products(phi_q, phi_k, v, keep):
    """(phi_q, phi_k, the values, [S | z], [phi_q S | phi_q z]), all expanded to one leading shape (an
    expanded tensor is a view): the products of ``_LinearAttentionCore`` below, whose docstring says why
    they are these. The values are v as given without a key mask, else [m v | m]."""
    lead = torch.broadcast_shapes(phi_q.shape[:-2], phi_k.shape[:-2], v.shape[:-2])
    v = _values_kept(v, keep)
    phi_q, phi_k, v = (t if t.shape[:-2] == lead else t.expand(*lead, *t.shape[-2:]) for t in (phi_q, phi_k, v))
    # [S | z]   [..., D, d + 1]; without a mask z as a sum: a 65th column of ones would cost a copy of v
    kvz = products.transposed_product(phi_k, v, with_sum=keep is None)
    return phi_q, phi_k, v, kvz, products.product(phi_q, kvz)  # the last [..., N, d + 1]


def _values_kept(v: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """The values as the core takes them: v without a key mask (copied only where its columns are not adjacent:
    the native products read rows of unit column stride), else [m v | m] (a fresh contiguous tensor)."""
    if keep is None:
        return v if v.stride(-1) == 1 or v.shape[-1] == 1 else v.contiguous()
    return torch.nn.functional.pad(v, (0, 1), value=1.0).mul_(keep)


def _keys_kept(key_mask: torch.Tensor | None) -> torch.Tensor | None:
    """A [B, N] key mask as the core's ``keep``, [B, 1, N, 1] (None stays None)."""
    return None if key_mask is None else key_mask.view(key_mask.shape[0], 1, -1, 1)


# A stabilised kernel's row (largest term about 1 when its keys' features are sound) whose den is below this has
# lost its significant terms to underflow, or meets the 1e-12 eps guard within 1e-5: every row of Performer's,
# Flexformer's and ELA's that was off by > 1e-3 against the exact attention of the same random features was below
# it (64 tokens, head dims 16-64, q, k x1 to x100; tests/test_numerics.py)
SMALL_DENOMINATOR = 1e-7


def warn_small_denominators(den: torch.Tensor, keep: torch.Tensor | None, name: str) -> None:
    """Warn with the fraction of real rows (``keep``: the key mask [B, N], or as the core takes it; in
    self-attention the queries are the keys) whose den [B, H, N, 1] is below ``SMALL_DENOMINATOR``: a stabilised
    kernel's features underflowed there. Eager code only (a data-dependent branch)."""
    if torch.compiler.is_compiling():
        return
    small = torch.lt(den, SMALL_DENOMINATOR)
    if not bool(small.any()):  # the common case in three operator calls
        return
    if keep is not None and keep.shape[-1] * keep.shape[-2] == small.shape[-2]:
        real = keep.reshape(keep.shape[0], 1, -1, 1).bool().expand_as(small)
        small, rows = small & real, int(real.sum())
    else:
        rows = small.numel()
    count = int(small.sum())
    if count:
        warnings.warn(f"{name}: {100 * count / max(rows, 1):.2g} % of attention rows ({count} of {rows}) have a "
                      f"denominator below {SMALL_DENOMINATOR:g}: the keys' features underflowed under the "
                      "stabiliser (activations too large for this kernel in this precision), so those rows' outputs "
                      "may be off", RuntimeWarning, stacklevel=2)


def _reciprocal_denominator(den: torch.Tensor, eps: float, clamp: bool):
    """(1 / (den + eps), None), or with ``clamp`` (1 / max(den, eps), where den > eps: where clamped the
    denominator passes no gradient). Not in place: den is a column of [num | den], and an export makes a write
    into it a copy of the whole (slice_scatter: 4 transposes and a scatter, ~7 ms a layer at 512 tokens in ONNX
    Runtime, measured)."""
    if clamp:
        unclamped = den > eps
        return den.clamp_min(eps).reciprocal_(), unclamped
    return den.add(eps).reciprocal_(), None


class _LinearAttentionCore(torch.autograd.Function):
    """out = (phi_q S) / (phi_q z + eps) with S = phi_k^T (m v), z = phi_k^T m (per batch and head; m the
    key mask, 1 without one).

    Numerator and denominator come from one product with [S | z]: [phi_q S | phi_q z] = phi_q [S | z].
    Without a key mask z is phi_k's sum over tokens and S = phi_k^T v, v read where it lies (a ones
    column on v would cost a copy of v and, on one core, about 1.5 ms of 13 in the products at
    12 x 4,096 x 64). With a mask the values get a column of ones appended and are multiplied by the
    mask, which removes the pad keys as zeroing phi_k would: [S | z] = phi_k^T [m v | m], and no
    masked copy of phi_k.

    A hand-written backward: autograd's version of the division and the slicing
    makes several extra full passes over [N, d] tensors, which at long N run
    at memory speed and cost more than the matrix products. It does not keep
    the output: grad_out . out, the one place it enters, equals
    (grad_out r S^T) . phi_q, and that product is a piece of phi_q's gradient
    anyway. Every gradient comes back contiguous.
    """

    @staticmethod
    def forward(ctx, phi_q, phi_k, v, keep, eps, clamp, check):
        phi_q, phi_k, values, kvz, num_den = _sums_and_products(phi_q, phi_k, v, keep)
        num, den = num_den.split([v.shape[-1], 1], -1)  # one view call, not two slices
        if check is not None:
            warn_small_denominators(den, keep, check)
        r, unclamped = _reciprocal_denominator(den, eps, clamp)
        ctx.save_for_backward(phi_q, phi_k, values, kvz, r, unclamped)
        return num * r  # [..., N, d]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        phi_q, phi_k, values, kvz, r, unclamped = ctx.saved_tensors
        d = kvz.shape[-1] - 1
        kv_t, z = kvz.transpose(-1, -2).split([d, 1], -2)  # S^T [..., d, D], z^T [..., 1, D]
        grad_num = grad_out * r  # d loss / d (phi_q S)   [..., N, d]
        grad_q = products.product(grad_num, kv_t)  # its part of phi_q's gradient   [..., N, D]
        # d loss / d (phi_q z) = -(grad_out . out) r, and grad_out . out = (grad_num S^T) . phi_q
        grad_den = torch.linalg.vecdot(grad_q, phi_q).unsqueeze_(-1).mul_(r).neg_()  # [..., N, 1]
        if unclamped is not None:
            grad_den.mul_(unclamped)
        grad_q.addcmul_(grad_den, z)
        grad_kvz = products.transposed_product(phi_q, torch.cat([grad_num, grad_den], -1))  # [..., D, d + 1]
        grad_k = grad_v = None
        masked = values.shape[-1] > d  # [m v | m]; else v, and z was phi_k's sum
        if ctx.needs_input_grad[1]:
            grad_kvz_t = grad_kvz.transpose(-1, -2)
            if masked:
                grad_k = products.product(values, grad_kvz_t)
            else:  # v grad_S^T + 1 grad_z^T
                grad_k = products.product(values, grad_kvz_t[..., :d, :], bias=grad_kvz_t[..., d:, :])
        if ctx.needs_input_grad[2]:
            # with a mask v entered as m v (m: the ones column, masked); gradients of broadcast inputs come back
            # at the leading shape, and autograd sums them to the inputs' shapes
            grad_v = products.product(phi_k, grad_kvz[..., :d])
            if masked:
                grad_v.mul_(values[..., d:])
        return grad_q if ctx.needs_input_grad[0] else None, grad_k, grad_v, None, None, None, None


def linear_attention_core(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, eps: float,
                          clamp: bool = False, keep: torch.Tensor | None = None, check: str | None = None) -> torch.Tensor:
    """phi_q S / (phi_q z + eps) for [B, H, N, D] features and [B, H, N, d] values, all of one float dtype
    (``clamp``: phi_q S / max(phi_q z, eps), the guard for signed features, whose sums can be <= 0).

    ``keep``: which keys are real, broadcastable to [B, H, N, 1] (bool or 0/1; None: all), the
    sums then run over real keys only. ``check``: a stabilised kernel's name; rows whose den is that of
    underflowed features are then warned about (``warn_small_denominators``). The caller handles dtypes; see
    ``linear_attention`` below.
    """
    return _LinearAttentionCore.apply(phi_q, phi_k, v, keep, eps, clamp, check)


def linear_attention(
    phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None, eps: float = EPS,
    clamp: bool = False, check: str | None = None,
) -> torch.Tensor:
    """out_i = phi(q_i)^T S / (phi(q_i)^T z + eps), S = sum_j phi(k_j) v_j^T, z = sum_j phi(k_j)
    (``clamp``: divided by max(phi(q_i)^T z, eps) instead, for signed features; ``check``: a method's name,
    :func:`linear_attention_core`'s). :func:`divided_linear_attention` takes a map's :class:`Divisor`.

    Pads are removed from the sums (as zeroing phi(k) would; not k or v alone: phi(0) need not be 0).
    Sums and the division run in fp32 even under autocast, so bf16/fp16
    inputs cannot overflow the sums or divide by a rounded-off zero; float64
    inputs stay float64.
    """
    out_dtype, compute = v.dtype, accumulation_dtype(phi_q, phi_k, v)
    with torch.autocast(device_type=v.device.type, enabled=False):
        phi_q, phi_k, v = phi_q.to(compute), phi_k.to(compute), v.to(compute)
        out = linear_attention_core(phi_q, phi_k, v, eps, clamp, _keys_kept(key_mask), check)
    return out.to(out_dtype)


def divided_linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                              key_mask: torch.Tensor | None, eps: float, divisor: Divisor, name: str) -> torch.Tensor:
    """Linear attention with each row divided as ``divisor`` says (``name``: the method, for its warnings)."""
    if divisor.floor is not None:
        return floored_linear_attention(phi_q, phi_k, v, key_mask, eps, divisor.floor)
    return linear_attention(phi_q, phi_k, v, key_mask, eps, divisor.clamp, name if divisor.check else None)


def floored_linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                             key_mask: torch.Tensor | None, eps: float, floor: float) -> torch.Tensor:
    """phi(q_i)^T S / max(phi(q_i)^T z, floor |phi(q_i)| sum_j |phi(k_j)|, eps) over real keys j, for signed
    kernels: |phi(q_i)| sum_j |phi(k_j)| bounds every |phi(q_i)^T phi(k_j)| summed (Cauchy-Schwarz), so the
    divisor is at least ``floor`` times the scale of the row's own terms, never ~0 (max(den, eps) divided
    random-feature rows whose den cancelled to ~0 by 1e-12), and |out_i| <= max|v| / floor. A rescaling of
    phi_k (a stabiliser) scales numerator and divisor alike. Plain autograd, in float32 (float64 stays)."""
    out_dtype, compute = v.dtype, accumulation_dtype(phi_q, phi_k, v)
    with torch.autocast(device_type=v.device.type, enabled=False):
        phi_q, phi_k, v = phi_q.to(compute), phi_k.to(compute), v.to(compute)
        keep = _keys_kept(key_mask)
        values = torch.nn.functional.pad(v, (0, 1), value=1.0)
        key_norms = phi_k.norm(dim=-1, keepdim=True)  # [B, H, N, 1]
        if keep is not None:
            values, key_norms = values * keep, key_norms * keep
        num_den = phi_q @ (phi_k.transpose(-1, -2) @ values)
        num, den = num_den.split([v.shape[-1], 1], -1)
        bound = phi_q.norm(dim=-1, keepdim=True) * key_norms.sum(-2, keepdim=True)
        out = num / torch.maximum(den, floor * bound).clamp_min(eps)
    return out.to(out_dtype)


def produced_attention_unnormalised(query_rows: products.ProducedRows, key_rows: products.ProducedRows,
                                    v: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[phi(q_i)^T S | phi(q_i)^T z], [B, H, N, d + 1], of features that the native products make block by block
    (``products.ProducedRows``: Taylor's), so that neither phi_q nor phi_k is ever in memory: float32 v
    [B, H, N, d] on the CPU, no gradients. Equal to the stored features' output to float32 rounding (the
    native products sum in their own order)."""
    keep = _keys_kept(key_mask)
    kvz = products.produced_transposed_product(key_rows, _values_kept(v, keep), with_sum=keep is None)
    return products.produced_product(query_rows, kvz)


def divided_sums(num_den: torch.Tensor, key_mask: torch.Tensor | None, eps: float, divisor: Divisor,
                 name: str) -> torch.Tensor:
    """[phi_q S | phi_q z] divided as ``divisor`` says, as :func:`divided_linear_attention` divides (no floor:
    the floor needs the features, and maps that make their rows have none)."""
    if divisor.check:
        warn_small_denominators(num_den[..., -1:], key_mask, name)
    return divide_by_last_column(num_den, eps, divisor.clamp)


def divide_by_last_column(num_den: torch.Tensor, eps: float = EPS, clamp: bool = False) -> torch.Tensor:
    """x[..., :d] / (x[..., d] + eps) (``clamp``: / max(x[..., d], eps)) for x = num_den [..., d + 1], computed as
    the core computes it (a reciprocal, then a product)."""
    num, den = num_den.split([num_den.shape[-1] - 1, 1], -1)
    r, _ = _reciprocal_denominator(den, eps, clamp)
    return num * r
