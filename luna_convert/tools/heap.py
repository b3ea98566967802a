"""glibc's heap kept for the tool's large tensors (the CLI sets this at start; ``LUNA_CONVERT_KEEP_HEAP=0``
leaves glibc's defaults).

A layer at a few thousand tokens allocates and frees several buffers of 10-30 MB in every call. With its
defaults glibc hands memory at the top of its heap back to the OS once more than about twice the largest
recent buffer lies free there, so the next call faults every page in again: the paper form's layer at
4,096 tokens took up to 6,490 minor faults a call, and on a VM each costs microseconds. Buffers up to
32 MiB (glibc's largest mmap threshold) are served from the heap and the heap is never trimmed, so a
freed buffer's pages are reused as they are. Larger tensors still map fresh pages: above 32 MiB of
features the layers stream (``layers.attention``). The process keeps its peak heap until it exits.
Measured in docs/design-decisions.md (*The CLI keeps glibc's heap*).
"""

from __future__ import annotations

import ctypes
import os
import sys

DISABLE_VARIABLE = "LUNA_CONVERT_KEEP_HEAP"
# glibc's own environment settings: a user who set any of them has chosen a policy, which stays.
GLIBC_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit systems
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: 2 GiB, in effect never


_said: str | None = None  # what keep_heap did in this process


def heap_policy() -> str:
    """The heap policy of this process, in words (for bench.json)."""
    return _said or "glibc's defaults (keep_heap not called: luna_convert used from Python)"


def keep_heap() -> str:
    """Make glibc serve buffers up to 32 MiB from a heap it never trims; returns what was done, in words."""
    global _said
    _said = _keep_heap()
    return _said


def _keep_heap() -> str:
    if os.environ.get(DISABLE_VARIABLE) == "0":
        return f"glibc's defaults ({DISABLE_VARIABLE}=0)"
    chosen = [name for name in GLIBC_VARIABLES if name in os.environ]
    if chosen:
        return f"glibc's, as set by {', '.join(chosen)}"
    if not sys.platform.startswith("linux"):
        return "the platform's allocator (not Linux)"
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    except (OSError, AttributeError):
        return "the C library's defaults (no mallopt)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the threshold first: a refusal there changes nothing, where a trim threshold alone would fix glibc's
    # mmap threshold at its 128 KiB start and map every large buffer afresh
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "the C library's defaults (mallopt refused)"
    return "kept: buffers up to 32 MiB from a heap that is never trimmed"
