"""The CLI's heap policy (tools.heap): freed large buffers are reused without faulting their pages in again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from luna_convert.tools import heap

linux_glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                                 reason="glibc's mallopt: Linux only")

# Three 12 MiB buffers allocated, written and freed three times (as a layer's forward does with its features and
# outputs); prints what keep_heap said and the minor page faults of the third round. heap.py is loaded from its
# file, so the child imports neither torch nor the package (nothing else touches its heap).
CHILD = """
import ctypes, importlib.util, resource, sys
spec = importlib.util.spec_from_file_location("heap", sys.argv[1])
heap = importlib.util.module_from_spec(spec)
spec.loader.exec_module(heap)
said = heap.keep_heap()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
size = 12 << 20
def one_round():
    buffers = [libc.malloc(size) for _ in range(3)]
    for b in buffers:
        ctypes.memset(b, 1, size)
    for b in buffers:
        libc.free(b)
one_round(); one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
one_round()
print(said)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def third_round_faults(**env) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if k not in (heap.DISABLE_VARIABLE, *heap.GLIBC_VARIABLES)}
    proc = subprocess.run([sys.executable, "-c", CHILD, heap.__file__], capture_output=True, text=True,
                          env={**clean, **env}, timeout=60, check=True)
    said, faults = proc.stdout.strip().splitlines()
    return said, int(faults)


@linux_glibc
def test_kept_heap_reuses_freed_buffers_where_glibc_defaults_fault_them_in_again():
    pages = 3 * (12 << 20) // os.sysconf("SC_PAGE_SIZE")
    said, kept = third_round_faults()
    assert said.startswith("kept") and kept < pages // 20, (said, kept)
    said, default = third_round_faults(**{heap.DISABLE_VARIABLE: "0"})  # glibc trims 36 MiB free at the top
    assert heap.DISABLE_VARIABLE in said and default > pages // 2, (said, default)


@linux_glibc
def test_a_users_own_glibc_setting_is_left_alone():
    said, _ = third_round_faults(MALLOC_TRIM_THRESHOLD_="1000")
    assert said == "glibc's, as set by MALLOC_TRIM_THRESHOLD_"


def test_the_cli_sets_the_policy_before_any_command(monkeypatch):
    from luna_convert import cli

    calls = []
    monkeypatch.setattr(cli, "keep_heap", lambda: calls.append("heap"))
    monkeypatch.setattr(cli, "app", lambda: calls.append("app"))
    monkeypatch.setattr(sys, "argv", ["luna-convert", "methods"])
    cli.main()
    assert calls == ["heap", "app"]
