"""``luna-convert bench``: how much linear attention pays off, measured.

One entry point, :func:`run_benchmark`. It measures

1. **attention layers** (12 heads x 64 dims, batch 1, float32): softmax via
   ``torch.nn.functional.scaled_dot_product_attention``, an eager softmax with
   the N x N matrix (``softmax-eager``, short lengths only, a memory reference)
   and every method in ``luna_convert.METHODS`` as a
   :class:`~luna_convert.layers.attention.LinearAttention` built with the method's
   feature map and defaults (plus ``luna:dwc=true``, LUNA with
   the DWC branch it leaves off by default). For each
   sequence length: forward time (no grad), forward+backward time (q, k, v and
   the layer's parameters get gradients), the peak tensor memory of each, and the
   aten operator calls of one forward (``tools.op_count``: what sets the time of
   small inputs); the log-log slope of time against N between N = 1024 and 16384.
2. **whole models**, original vs converted (``luna_convert.convert``), random
   init: ViT-B/16 (``transformers.ViTConfig`` base sizes) inference at several
   image sizes, BERT-base (``BertConfig`` base, ``max_position_embeddings``
   raised to the longest length) inference at several lengths, and one
   BERT-base training step (batch 16 x 128 tokens, AdamW).

Every time is the median of ``repeats`` runs after warm-up; the candidates of
one comparison run round-robin (A, B, A, B, ...) so that a change in machine
load hits all of them alike, and every ratio is taken within the same run.
Times are wall clock (CUDA events on a GPU), or with ``timer="cpu"`` the CPU
time of a single thread, for machines shared with other work.

Memory: on CUDA, ``torch.cuda.max_memory_allocated`` minus the memory held
before the step. On the CPU, one extra run of each step inside one
``torch.profiler.profile(profile_memory=True)`` session, each in its own
``record_function`` range: the profiler reports every allocation and free of
the CPU allocator (size and time); the running sum of those events is the live
tensor memory, and a step's peak is its maximum inside the step's range minus
its value when the range began. Inputs and parameters that exist before the
step are not counted; gradients of the inputs are.

Heavy imports (torch, transformers, matplotlib, rich) happen inside functions.
"""

from __future__ import annotations

from ...layers.attention import LinearAttention
from .layers import bench_layers, layer_modules, layer_variant
from .long_models import bench_long_models
from .models import bench_models
from .run import run_benchmark
from .tables import markdown_tables
from .timing import forward_ops, peak_memory

# LinearAttention: what benchmarks/ scripts build a bench layer with, beside layer_variant
__all__ = ["LinearAttention", "bench_layers", "bench_long_models", "bench_models", "forward_ops", "layer_modules",
           "layer_variant", "markdown_tables", "peak_memory", "run_benchmark"]
