"""The linear-attention layer that replaces softmax inside a converted attention module.

``LinearAttention`` owns only what conversion adds: the method's attention core (feature
map(s), or a kernel) and the optional depthwise-convolution (DWC) branch. The pretrained
Q/K/V/output projections stay in the original attention module (see ``adapters``), which
hands per-head q, k, v here.

What a layer computes is its :class:`AttentionMode`, set for a block of code with
:func:`attention_mode` (distillation, the softmax teacher pass); the losses a distilling layer
keeps are collected through the object that block gets.
"""

from __future__ import annotations

import enum
from contextlib import contextmanager
from dataclasses import asdict
from typing import Iterable, Iterator

import torch
from torch import nn

from ..linear_methods.base import FEATURE_MAP_KIND, AttentionOptions
from ..linear_methods.registry import get_method
from ..ops.context import AttentionContext
from ..ops.dtypes import records_grad
from ..ops.dwc import depthwise_conv_tokens_plus
from ..ops.linear import Divisor, divided_linear_attention, divided_sums, produced_attention_unnormalised
from ..ops.reference import (attention_distillation_loss, linear_attention_weights, output_distillation_loss,
                             softmax_attention, softmax_attention_weights, windowed_linear_attention_weights)
from ..ops.streamed import streamed_linear_attention
from ..ops.windowed import windowed_linear_attention


# A trace records one input's path: whether the padding mask was all ones, which kernels ran (a native call
# is recorded as an empty tensor). Replayed on other inputs it gave NaN or wrong values, so it is refused.
TRACING_REFUSED = ("torch.jit.trace cannot record a converted model (its attention takes input-dependent steps that "
                   "a trace would freeze); use torch.export.export, torch.onnx.export(..., dynamo=True) or "
                   "`luna-convert export`")


class TracingRefused(RuntimeError):
    """Raised when a converted layer runs under torch.jit.trace (and so under the TorchScript ONNX exporter)."""


WINDOW_MIX_LR_SCALE = 10.0  # the window's mixing factors train at 10 x the rate of the rest (see window_mix)


class AttentionMode(enum.Enum):
    """What a :class:`LinearAttention` layer computes and returns."""

    LINEAR = "linear"  # the method's linear attention: the converted model
    # Attention distillation, each from the same q and k (no second model); the layer returns softmax's output
    # (so every layer sees the teacher's activations) and keeps a loss:
    DISTILL_ATTENTION = "attention"  # each linear row against the softmax row (Hedgehog's cross-entropy; N x N)
    DISTILL_OUTPUT = "output"  # the linear output against softmax's (relative MSE; SDPA, memory linear in N)
    SOFTMAX = "softmax"  # exact softmax attention through SDPA (logits distillation's teacher pass)
    # a ``window`` layer without its linear part (gamma = 0): the window's softmax alone (engine.hybrid_check)
    WINDOW_ONLY = "window-only"

    @property
    def distills(self) -> bool:
        return self in (AttentionMode.DISTILL_ATTENTION, AttentionMode.DISTILL_OUTPUT)


class AttentionPath(enum.Enum):
    """How a :class:`LinearAttention` call computes its output: chosen by :meth:`LinearAttention.path` alone."""

    SOFTMAX = "softmax"  # AttentionMode.SOFTMAX: SDPA
    DISTILL_OUTPUT = "distill output"  # SDPA's output returned, the linear output's distance to it kept
    DISTILL_ATTENTION = "distill attention"  # softmax's N x N rows returned through v, the linear rows' CE kept
    KERNEL = "kernel"  # a kernel method's own computation (sorting: sorting_sums.c where built, else PyTorch)
    WINDOWED = "windowed"  # exact softmax in the window, gamma x linear attention beyond (ops.windowed)
    MADE_ROWS = "made rows"  # features made inside the native products, never stored (Taylor's pair_rows.c)
    STREAMED = "streamed"  # the standard path chunk by chunk over the tokens (ops.streamed)
    LINEAR = "linear"  # the standard path: features stored, two products, one division (ops.linear)


class DepthwiseConvBranch(nn.Module):
    """DWC(V): a depthwise conv over tokens shared across heads (FLatten-style).

    Text: Conv1d over the sequence, pads zeroed before and after. Images: a
    k x k Conv2d over the patch grid, prefix tokens (CLS, registers) get none.
    Zero-initialised so a freshly converted model is pure linear attention.
    The kernel size is validated with the options (``AttentionOptions.dwc_kernel``).
    """

    def __init__(self, head_dim: int, kernel_size: int = 3, spatial: bool = False):
        super().__init__()
        conv = nn.Conv2d if spatial else nn.Conv1d
        self.spatial = spatial
        self.conv = conv(head_dim, head_dim, kernel_size, padding=kernel_size // 2, groups=head_dim)
        nn.init.zeros_(self.conv.weight)
        nn.init.zeros_(self.conv.bias)

    def forward(self, v, key_mask=None, grid=None, num_prefix: int = 0, plus: torch.Tensor | None = None):
        """The branch's output [B, H, N, d], plus ``plus`` (the attention output) if given
        (``ops.dwc.depthwise_conv_tokens_plus``)."""
        # ops.dwc works in the [..., tokens, d] layout of v, so no channels-first copies (and a faster
        # backward than torch's CPU depthwise conv).
        weight, bias = self.conv.weight.to(v.dtype), self.conv.bias.to(v.dtype)  # as autocast would run the conv
        if self.spatial:  # images bring no key mask; the prefix tokens get no branch
            return depthwise_conv_tokens_plus(v, weight, bias, plus, None, tuple(grid), num_prefix)
        return depthwise_conv_tokens_plus(v, weight, bias, plus, key_mask)


class LinearAttention(nn.Module):
    """Linear attention of one registered method over per-head q, k, v, with optional DWC.

    ``LinearAttention(method, head_dim, num_heads, softmax_scale, spatial=False, options=None,
    **overrides)``: ``options`` is the method's options object (or None: its defaults),
    ``overrides`` replace single options (``dwc=False``).

    Feature-map methods keep their map(s) as ``phi_q`` / ``phi_k`` (``phi_k`` None when q and k
    share one map: a shared map is stored once, so checkpoints hold no duplicated tensors);
    kernel methods keep theirs as ``kernel``.

    ``window`` > 0 (feature-map methods): exact softmax over the keys with |i - j| <= window of each
    query and gamma_h x linear attention over the other real keys, one normalisation
    (``ops.windowed``); gamma_h = exp(``window_mix``), learned per head from 1.

    ``mode`` (:class:`AttentionMode`, set with :meth:`set_mode` or :func:`attention_mode`) says what the
    layer computes; in a distilling mode it keeps ``distill_loss``, the loss of its last forward.
    """

    def __init__(self, method: str, head_dim: int, num_heads: int, softmax_scale: float, spatial: bool = False,
                 options: AttentionOptions | None = None, **overrides):
        super().__init__()
        spec = get_method(method)
        if options is None or overrides:  # built (and validated) here; a given options object was validated once
            options = spec.make_options(**{**(asdict(options) if options is not None else {}), **overrides})
        self.method, self.options = spec.name, spec.check_options(options)
        self.head_dim, self.num_heads, self.softmax_scale, self.eps = head_dim, num_heads, softmax_scale, options.eps
        if spec.kind == FEATURE_MAP_KIND:
            self.phi_q = spec.core(head_dim, num_heads, options)
            self.phi_k = None if self.phi_q.shared_qk else spec.core(head_dim, num_heads, options)
            self.kernel = None
        else:
            self.phi_q = self.phi_k = None
            self.kernel = spec.core(head_dim, num_heads, options)
        self.dwc = DepthwiseConvBranch(head_dim, options.dwc_kernel, spatial) if options.dwc else None
        self.window = options.window
        # Per-head log of gamma, the weight of the linear part beyond the window (gamma = 1 at conversion); a
        # method parameter, so distillation trains it. Unbounded and at WINDOW_MIX_LR_SCALE x the rate: the
        # balance the kernel needs is far from 1 (features normalised per token, softmax terms at most 1), and
        # a sigmoid gate at the maps' rate moved 0.50 -> 0.55 in the digits ViT's 80 steps (docs/quality.md).
        self.window_mix = nn.Parameter(torch.zeros(num_heads)) if self.window else None
        self.spatial = spatial
        self._mode = AttentionMode.LINEAR
        # On the CPU, long inputs stream tokens in chunks (ops.streamed) once the float32
        # features of all tokens would exceed stream_min_bytes: glibc maps buffers over
        # 32 MiB fresh from the OS on every call, and faulting their pages in cost as much
        # as the arithmetic (16k tokens, forward: T2R 1.8x, Hedgehog 2.2x faster streamed;
        # docs/benchmarks.md). Same values and gradients. Chunks of 16 MiB stay under that threshold
        # and cost a quarter of 4 MiB's operator calls: with another job on the machine they were
        # 14-27 % faster in 5 of 6 cases, on an idle core the same (benchmarks/stream_chunk.py).
        # Without gradients the layer streams from inference_stream_bytes on, in chunks of that size (at most
        # the two above): LUNA's standard-operator layer at 4,096 tokens, forward, 155 -> 135 ms, no method
        # slower (benchmarks/native_kernels.py, docs/benchmarks.md).
        self.stream_min_bytes, self.stream_chunk_bytes = 32 << 20, 16 << 20
        self.inference_stream_bytes = 4 << 20
        self._distill_loss: torch.Tensor | None = None

    @property
    def mode(self) -> AttentionMode:
        return self._mode

    def set_mode(self, mode: AttentionMode) -> None:
        """Compute ``mode`` from the next forward on; the last distillation loss stays until taken."""
        if not isinstance(mode, AttentionMode):
            raise TypeError(f"mode must be an AttentionMode, got {mode!r}")
        self._mode = mode

    @property
    def distill_loss(self) -> torch.Tensor | None:
        """The distillation loss of the last forward in a distilling mode (None: none since taken)."""
        return self._distill_loss

    def take_distill_loss(self) -> torch.Tensor | None:
        """The last distillation loss, forgotten here (its graph is freed with the caller's use of it)."""
        loss, self._distill_loss = self._distill_loss, None
        return loss

    @property
    def feature_dim(self) -> int:
        return (self.kernel if self.phi_q is None else self.phi_q).feature_dim

    @property
    def divisor(self) -> Divisor:
        """How each row is divided by its sum: the feature map's ``divisor`` (``ops.linear.Divisor``)."""
        return Divisor() if self.phi_q is None else self.phi_q.divisor

    @property
    def uses_patch_layout(self) -> bool:
        """Image inputs must bring their patch grid and prefix count (spatial DWC, or a core reading the prefix)."""
        core = self.kernel if self.phi_q is None else self.phi_q
        return (self.dwc is not None and self.dwc.spatial) or (self.spatial and core.reads_prefix)

    def method_parameters(self) -> list[nn.Parameter]:
        """What the method added (feature maps or kernel, the window's mixing factors), DWC excluded: what
        distillation trains."""
        params = [p for m in (self.phi_q, self.phi_k, self.kernel) if m is not None for p in m.parameters()]
        return params if self.window_mix is None else [*params, self.window_mix]

    def learning_rate_scales(self) -> dict[int, float]:
        """id(parameter) -> learning-rate factor, for the method's parameters that train at another rate."""
        scales = {k: v for m in (self.phi_q, self.phi_k, self.kernel) if m is not None
                  for k, v in m.learning_rate_scales().items()}
        if self.window_mix is not None:
            scales[id(self.window_mix)] = WINDOW_MIX_LR_SCALE
        return scales

    def query_features(self, q: torch.Tensor, context: AttentionContext | None = None) -> torch.Tensor:
        return self.phi_q(self.query_input(q), context)

    def query_input(self, q: torch.Tensor) -> torch.Tensor:
        return q * self.head_dim**-0.5 if self.phi_q.prescale_query else q

    def key_features(self, k: torch.Tensor, context: AttentionContext | None = None) -> torch.Tensor:
        return (self.phi_k or self.phi_q)(k, context)

    def features(self, q: torch.Tensor, k: torch.Tensor,
                 context: AttentionContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.phi_k is None and self.phi_q.context_free:
            # One call for queries and keys: LUNA compares its cached channel tables once, or, when
            # training, builds them once per forward instead of twice.
            return self.phi_q.each(self.query_input(q), k)
        if context is None:  # still tell a shared map which side it is on (Performer's key stabiliser)
            context = AttentionContext(None, q.shape[2])
        return self.query_features(q, context), self.key_features(k, context.for_role("key"))

    def stream_chunk(self, batch: int, tokens: int, training: bool = True) -> int | None:
        """Tokens per chunk for the streamed path, or None when all features fit comfortably at once
        (or, when gradients are needed, the map prefers to keep its own saved state)."""
        if self.phi_q is None or not self.phi_q.token_wise or self.divisor.clamp:
            return None
        if torch.compiler.is_compiling():
            # The streamed path is a memory measure for eager CPU code (chunk loops, a custom backward
            # that re-enters autograd, a context-variable scope), none of which a graph can hold; the
            # whole-tensor path gives the same values and gradients, and compiled code fuses its temporaries.
            return None
        if training and not self.phi_q.stream_when_training:
            return None
        min_bytes, chunk_bytes = self.stream_min_bytes, self.stream_chunk_bytes
        if not training:
            min_bytes, chunk_bytes = (min(min_bytes, self.inference_stream_bytes),
                                      min(chunk_bytes, self.inference_stream_bytes))
        per_token = batch * self.num_heads * max(self.feature_dim, self.head_dim) * 4  # float32 bytes
        if per_token * tokens <= min_bytes:
            return None
        return max(16, chunk_bytes // per_token)

    def path(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> AttentionPath:
        """The one place that decides how this call computes its output (docs/deploy.md, *Paths*):

        | path | when |
        | --- | --- |
        | SOFTMAX, DISTILL_OUTPUT, DISTILL_ATTENTION | the layer's mode says so (:func:`attention_mode`) |
        | KERNEL | a kernel method (sorting); its core picks its native pass or its PyTorch one |
        | WINDOWED | ``window`` > 0 |
        | MADE_ROWS | no gradient, float32 CPU tensors, maps that make their rows (``FeatureMap.makes_rows``) |
        | STREAMED | on the CPU, token-wise maps whose stored features pass ``stream_min_bytes`` (no grad: 4 MiB) |
        | LINEAR | everything else, every device, dtype and graph (compiled, exported) |

        Inside a path a feature map computes its own features (LUNA: its native channel pass on the CPU in
        float32 where built, else ``ops.piecewise``), always the same values to float32 rounding.
        """
        if self._mode is AttentionMode.SOFTMAX:
            return AttentionPath.SOFTMAX
        if self._mode is AttentionMode.DISTILL_OUTPUT:
            return AttentionPath.DISTILL_OUTPUT
        if self._mode is AttentionMode.DISTILL_ATTENTION:
            return AttentionPath.DISTILL_ATTENTION
        return self.linear_path(q, k, v)

    def linear_path(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> AttentionPath:
        """:meth:`path` outside the softmax modes: how the linear attention itself is computed."""
        if self.kernel is not None:
            return AttentionPath.KERNEL
        if self.window:
            return AttentionPath.WINDOWED
        training = self.needs_grad(q, k, v)
        if (not training and v.dtype == torch.float32 and not torch.is_autocast_enabled(v.device.type)
                and (self.phi_k or self.phi_q).makes_rows(k) and self.phi_q.makes_rows(q)):
            return AttentionPath.MADE_ROWS
        if v.device.type == "cpu" and self.stream_chunk(v.shape[0], v.shape[2], training) is not None:
            return AttentionPath.STREAMED
        return AttentionPath.LINEAR

    def forward(self, q, k, v, key_mask=None, grid=None, num_prefix: int = 0) -> torch.Tensor:
        """q, k, v: [B, H, N, d]; key_mask: bool [B, N] (True = real). Returns [B, H, N, d]."""
        if torch.jit.is_tracing():
            raise TracingRefused(TRACING_REFUSED)
        if self._mode is AttentionMode.WINDOW_ONLY and not self.window:
            raise RuntimeError("WINDOW_ONLY needs a layer with a window (method_options.window)")
        path = self.path(q, k, v)
        if path is AttentionPath.SOFTMAX:
            return softmax_attention(q, k, v, self.softmax_scale, key_mask)
        context = AttentionContext(key_mask, v.shape[2], num_prefix, grid)
        if path is AttentionPath.DISTILL_OUTPUT:
            teacher_out = softmax_attention(q, k, v, self.softmax_scale, key_mask)
            student_out = self.linear_output(q, k, v, key_mask, context)
            self._distill_loss = output_distillation_loss(teacher_out.detach(), student_out, key_mask)
            return teacher_out
        if path is AttentionPath.DISTILL_ATTENTION:
            teacher = softmax_attention_weights(q, k, self.softmax_scale, key_mask)
            student = self.attention_weights(q, k, key_mask, context)
            self._distill_loss = attention_distillation_loss(teacher.detach(), student, key_mask, self.eps)
            return torch.einsum("bhnm,bhmd->bhnd", teacher, v.to(teacher.dtype)).to(v.dtype)
        out = self.linear_output(q, k, v, key_mask, context, path)
        if self.dwc is not None:
            # Summed into the branch's fresh output (nothing saves it): one [B, H, N, d] buffer fewer.
            out = self.dwc(v, key_mask, grid, num_prefix, plus=out)
        return out

    def needs_grad(self, *inputs: torch.Tensor) -> bool:
        """Whether this call records a gradient (for ``inputs`` or the method's parameters)."""
        return records_grad(*inputs, *self.method_parameters())

    def feature_rows(self, q: torch.Tensor, k: torch.Tensor, context: AttentionContext | None = None):
        """(queries', keys') ``FeatureMap.feature_rows``, or None unless the maps offer both."""
        context = AttentionContext(None, q.shape[2]) if context is None else context
        q_rows = self.phi_q.feature_rows(self.query_input(q), context=context)
        k_map = self.phi_q if self.phi_k is None else self.phi_k
        k_rows = None if q_rows is None else k_map.feature_rows(k, context=context.for_role("key"))
        return None if k_rows is None else (*q_rows, *k_rows)

    def linear_output(self, q, k, v, key_mask, context: AttentionContext,
                      path: AttentionPath | None = None) -> torch.Tensor:
        """The method's attention alone (no DWC branch), [B, H, N, d], by ``path`` (default:
        :meth:`linear_path`'s choice)."""
        path = self.linear_path(q, k, v) if path is None else path
        if path is AttentionPath.KERNEL:
            return self.kernel(q, k, v, key_mask, context)
        if path is AttentionPath.WINDOWED:  # never streamed: the op needs q and k beside the features
            return windowed_linear_attention(q, k, v, *self.features(q, k, context), self.window_gamma(),
                                             self.window, self.softmax_scale, key_mask, self.eps, self.divisor.clamp)
        if path is AttentionPath.MADE_ROWS:
            sums = produced_attention_unnormalised(*self.feature_rows(q, k, context), v, key_mask)
            return divided_sums(sums, key_mask, self.eps, self.divisor, self.method)
        if path is AttentionPath.STREAMED:
            chunk = self.stream_chunk(v.shape[0], v.shape[2], self.needs_grad(q, k, v))
            return streamed_linear_attention(q, k, v, self.query_features, self.key_features,
                                             self.method_parameters(), key_mask, self.eps, chunk, q_context=context,
                                             k_context=context.for_role("key"))
        return divided_linear_attention(*self.features(q, k, context), v, key_mask, self.eps, self.divisor,
                                        self.method)

    def attention_weights(self, q, k, key_mask=None, context: AttentionContext | None = None) -> torch.Tensor:
        """The explicit N x N attention matrix (the distillation student; for inspection and plots)."""
        if context is None:
            context = AttentionContext(key_mask, q.shape[2])
        if self.kernel is not None:
            return self.kernel.weights(q, k, key_mask, context)
        if self.window:
            return windowed_linear_attention_weights(q, k, *self.features(q, k, context), self.window_gamma(),
                                                     self.window, self.softmax_scale, key_mask, self.eps,
                                                     self.divisor.clamp)
        return linear_attention_weights(*self.features(q, k, context), key_mask, self.eps, self.divisor.clamp,
                                        self.divisor.floor)

    def window_gamma(self) -> torch.Tensor:
        """gamma_h = exp(window_mix_h), [H]: the weight of the linear part beyond the window (0 in WINDOW_ONLY)."""
        gamma = torch.exp(self.window_mix)
        return torch.zeros_like(gamma) if self._mode is AttentionMode.WINDOW_ONLY else gamma


class ModeScope:
    """The layers of one :func:`attention_mode` block, and what they computed in it."""

    def __init__(self, layers: list[LinearAttention]):
        self.layers = layers

    def distillation_loss(self) -> torch.Tensor:
        """The mean over the layers of the loss each kept in its last forward (taken: each is used once)."""
        losses = [layer.take_distill_loss() for layer in self.layers]
        if any(loss is None for loss in losses):
            raise RuntimeError("a layer kept no distillation loss: run a forward in a distilling mode first")
        return torch.stack(losses).mean()


@contextmanager
def attention_mode(layers: nn.Module | Iterable[LinearAttention], mode: AttentionMode) -> Iterator[ModeScope]:
    """Run ``layers`` (a model's every LinearAttention, or the given ones, in that order) in ``mode`` inside the
    block; on leaving it each gets back the mode it had, and keeps no loss."""
    if isinstance(layers, nn.Module):
        layers = [m for m in layers.modules() if isinstance(m, LinearAttention)]
    layers = list(layers)
    before = [layer.mode for layer in layers]
    for layer in layers:
        layer.set_mode(mode)
    try:
        yield ModeScope(layers)
    finally:
        for layer, previous in zip(layers, before):
            layer.set_mode(previous)
            layer.take_distill_loss()
