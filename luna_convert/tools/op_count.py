"""How many aten operator calls a piece of eager code issues.

Each call is one trip through PyTorch's dispatcher (a few microseconds of Python and C++ on the
CPU, a kernel launch on a GPU), whatever the tensor sizes: for small inputs the count, not the
arithmetic, sets the time. Counted below autograd, as ``torch.compile`` would trace them: composite
ops appear as what they decompose into (``matmul`` as expand/view/bmm), views and in-place ops
count too, and a custom autograd function's forward is counted op by op.

    with AtenOpCounter(skip=[attention.query, attention.key]) as ops:
        attention(hidden_states)
    ops.total, ops.views, ops.by_op.most_common(5)

``views`` counts the calls that only make a view (view, transpose, split, expand: no data moved, no
parallel region), so ``total - views`` are the calls that do work.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


class AtenOpCounter(TorchDispatchMode):
    """Counts aten calls inside its ``with`` block, except those made inside the modules of ``skip``
    (e.g. a layer's pretrained projections, to count what conversion put around them)."""

    def __init__(self, skip: Iterable[nn.Module] = ()):
        super().__init__()
        self.by_op: Counter = Counter()
        self.views = 0  # calls of view ops (their output aliases an input: no data moved)
        self._skip = list(skip)
        self._skipping = 0
        self._hooks: list = []

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __enter__(self):
        for module in self._skip:
            self._hooks.append(module.register_forward_pre_hook(self._pause))
            self._hooks.append(module.register_forward_hook(self._resume))
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        return super().__exit__(*exc)

    def _pause(self, module, args):
        self._skipping += 1

    def _resume(self, module, args, output):
        self._skipping -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._skipping:
            self.by_op[str(func.overloadpacket)] += 1
            self.views += func.is_view
        return func(*args, **(kwargs or {}))
