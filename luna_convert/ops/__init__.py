"""Tensor math that knows no model: linear attention, its products, the explicit N x N references, and the
native code beside them. Which module holds what: CONTRIBUTING.md, *Package map*.

Shapes: q, k, v are [B, H, N, d]; features phi(q), phi(k) are [B, H, N, D];
``key_mask`` is a bool [B, N] with True for real tokens (None: all real).
Every fast op is checked against its naive reference (``reference`` or torch's own op) in tests/.
"""
