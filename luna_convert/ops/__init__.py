"""Tensor math that knows no method and no model.

    dtypes     the accumulation dtype rule (fp32 for half precision, float64 stays float64)
    reference  explicit N x N forms: linear-attention weights and their sliding-window hybrid (the test
               references and the distillation student), masked softmax attention (the teacher), the
               distillation loss
    linear     kernel linear attention phi(q) S / (phi(q) z + eps) with a hand-written backward
    products   its batched products over tokens: native (token_products.c) where it applies, else torch.bmm
    streamed   the same, streamed over chunks of tokens for long CPU inputs
    windowed   sliding-window softmax + linear attention in one layer (the ``window`` option), block-banded
    dwc        depthwise convolution over tokens in the [..., tokens, C] layout
    normalize  x / (sum of x along a dim + eps) with a hand-written backward

Shapes: q, k, v are [B, H, N, d]; features phi(q), phi(k) are [B, H, N, D];
``key_mask`` is a bool [B, N] with True for real tokens (None: all real).
Every fast op is checked against its naive reference (``reference`` or torch's own op) in tests/.
"""
