"""Optional native kernels: a C source shipped in the package, compiled on first use by the machine's C
compiler into a cached shared library and called through ctypes on CPU buffers.

Never required. Without a C compiler, on a compile failure, or with ``LUNA_CONVERT_NATIVE=0`` in the
environment, ``load_library`` returns None and every caller keeps its pure-PyTorch path, which is also the
reference the native one is tested against. The C sources are plain C99 without PyTorch headers, so a
compile takes well under a second and needs no build tool but ``cc``.

The library is cached under ``$LUNA_CONVERT_CACHE_DIR`` (default ``~/.cache/luna_convert``) in ``native/``,
named by a hash of the source, the flags, the compiler and (for a build tuned to the CPU, ``-march=native``)
the CPU, so a changed source is rebuilt and a stale library is never loaded. It is written to a temporary
name and renamed: two processes compiling at once both end with a whole file.

Why not torch.compile or a PyTorch C++ extension: both need a C++ toolchain and tens of seconds of
compilation on first use; this needs a C compiler for a fraction of a second.

Threads: ``run_in_chunks`` splits a call's rows into a few chunks per thread of torch's intra-op count
and runs them on a thread pool (ctypes releases the GIL), taken as each thread frees up, so one thread
held up by another process delays one chunk, not the whole call.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Callable

import torch

DISABLE_VARIABLE = "LUNA_CONVERT_NATIVE"
CACHE_VARIABLE = "LUNA_CONVERT_CACHE_DIR"
# -ffp-contract=off: no fused multiply-adds the compiler chooses itself, so a value goes through the same
# float operations wherever the source computes it (the grid search of luna_channels.c relies on it).
FLAGS = ("-O3", "-std=c99", "-fPIC", "-shared", "-ffp-contract=off")
# Tried first: code for the CPU at hand. luna_channels.c's forward at LUNA's paper form (M = L = 8, its
# division-based grid) runs about 3x faster with AVX2 than with x86-64's baseline SSE2
# (python benchmarks/channel_kernel.py --threads 1 --form paper). Where the compiler refuses it, FLAGS
# alone. A tuned library's name also hashes the CPU (``cpu_identity``), so a cache folder shared by several
# machines never hands one machine another's build.
TUNED_FLAGS = ("-march=native",)
CHUNKS_PER_THREAD = 4

log = logging.getLogger(__name__)
_LOCK = threading.Lock()
_LIBRARIES: dict[Path, "NativeFunctions | None"] = {}
_REASONS: dict[Path, str] = {}
_POOL: ThreadPoolExecutor | None = None
_POOL_KEY: tuple[int, int] = (0, 0)  # (process, threads) the pool was made for: a forked child makes its own


# One declaration per native function: its C definition. The ctypes argument types and the names Python
# calls it with are read from the source, so they cannot drift from it, and a call that names its arguments
# cannot swap two integers silently (positional ctypes calls with hand-written type lists could).
_C_TYPES = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "int": ctypes.c_int32, "float": ctypes.c_float,
            "double": ctypes.c_double}
_POINTER_TYPEDEFS = {"produce_rows"}  # function-pointer typedefs of the sources
# An exported function definition (not static, nor behind a macro such as ALWAYS_INLINE that makes it
# static): return type, name, parameters, then the body's brace.
_DEFINITION = re.compile(r"^(?!static\b|typedef\b|#|[A-Z_]+\s)([A-Za-z_][\w \t]*?[\s*])(\w+)\(([^)]*)\)\s*\{", re.M)


@dataclass(frozen=True)
class CDeclaration:
    """A C function as its definition declares it: parameter names, their ctypes types, the return type."""

    name: str
    parameters: tuple[str, ...]
    argtypes: tuple
    restype: object


def _c_type(text: str, where: str):
    """The ctypes type of a C type as written (pointers of any kind: an address)."""
    words = text.replace("const", " ").replace("*", " * ").split()
    if "*" in words or (words and words[-1] in _POINTER_TYPEDEFS):
        return ctypes.c_void_p
    if words == ["void"]:
        return None
    if len(words) != 1 or words[0] not in _C_TYPES:
        raise TypeError(f"{where}: C type {text.strip()!r} has no ctypes type here (ops/native.py _C_TYPES)")
    return _C_TYPES[words[0]]


def declared_functions(source: Path) -> dict[str, CDeclaration]:
    """Every exported function that the C file ``source`` defines, read from its definitions."""
    return _declarations_in(source.read_text(), source.name)


@cache
def _declarations_in(text: str, file_name: str) -> dict[str, CDeclaration]:
    declarations = {}
    for match in _DEFINITION.finditer(text):
        returns, name, parameter_text = match.groups()
        where = f"{file_name}: {name}"
        names, types = [], []
        for parameter in (p.strip() for p in parameter_text.split(",")):
            if parameter in ("", "void"):
                continue
            split = re.match(r"(.*?)(\w+)$", parameter, re.S)
            names.append(split.group(2))
            types.append(_c_type(split.group(1), f"{where}({parameter})"))
        declarations[name] = CDeclaration(name, tuple(names), tuple(types), _c_type(returns, where))
    return declarations


def _declare(lib: ctypes.CDLL, source: Path) -> "NativeFunctions":
    """``lib``'s exported functions, their argument and return types set from ``source``'s definitions."""
    declarations = declared_functions(source)
    for declaration in declarations.values():
        function = getattr(lib, declaration.name)
        function.argtypes, function.restype = list(declaration.argtypes), declaration.restype
    return NativeFunctions(lib, declarations)


class NativeFunction:
    """One C function of a loaded library, called with its C parameter names as keywords."""

    def __init__(self, handle, declaration: CDeclaration):
        self._handle, self.declaration = handle, declaration

    def __call__(self, **arguments):
        declared = self.declaration.parameters
        if len(arguments) != len(declared) or not all(name in arguments for name in declared):
            missing = [name for name in declared if name not in arguments]
            unknown = [name for name in arguments if name not in declared]
            raise TypeError(f"{self.declaration.name}(): missing {missing}, unknown {unknown}; its C parameters "
                            f"are {', '.join(declared)}")
        return self._handle(*[arguments[name] for name in declared])

    @property
    def address(self) -> int:
        """The function's address (what the products take as a row maker)."""
        return ctypes.cast(self._handle, ctypes.c_void_p).value


class NativeFunctions:
    """A loaded library's exported functions, by name, each called with its C parameter names as keywords:
    ``load_library(source).product(x=..., w=..., ...)``."""

    def __init__(self, lib: ctypes.CDLL, declarations: dict[str, CDeclaration]):
        self._lib = lib  # kept loaded as long as its functions are reachable
        self._functions = {name: NativeFunction(getattr(lib, name), d) for name, d in declarations.items()}

    def __getattr__(self, name: str) -> NativeFunction:
        try:
            return self._functions[name]
        except KeyError:
            raise AttributeError(f"no exported C function {name!r}") from None


def constant_in_graphs(fn: Callable) -> Callable:
    """``torch.compiler.assume_constant_result(fn)``: torch.compile calls ``fn`` once while tracing and keeps its
    result as a constant of the graph. Set as that decorator sets it, since importing it loads torch._dynamo and
    sympy, 2.1 s of every command's start-up (``python -X importtime -c "import luna_convert.run.config"``);
    tests/test_operators.py's compiled tests fail if torch stops reading it."""
    fn._dynamo_marked_constant = True
    return fn


def cache_dir() -> Path:
    if os.environ.get(CACHE_VARIABLE):
        return Path(os.environ[CACHE_VARIABLE]) / "native"
    try:
        home_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except RuntimeError:  # no home directory to be found
        home_cache = Path(tempfile.gettempdir())
    return home_cache / "luna_convert" / "native"


def compiler() -> str | None:
    """The C compiler to use: ``$CC``, else cc, gcc or clang on PATH; None if there is none."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


# Set inside ``reference_kernels()``: every caller takes its PyTorch path, as with LUNA_CONVERT_NATIVE=0.
_REFERENCE_ONLY = contextvars.ContextVar("luna_convert_reference_only", default=False)


def disabled() -> bool:
    return _REFERENCE_ONLY.get() or os.environ.get(DISABLE_VARIABLE, "1").strip().lower() in ("0", "false", "no", "off")


@contextlib.contextmanager
def reference_kernels():
    """Within it, no native kernel runs and none is put in a traced graph: every op takes its PyTorch
    reference path. What export uses, so that an exported graph holds standard operators only."""
    token = _REFERENCE_ONLY.set(True)
    try:
        yield
    finally:
        _REFERENCE_ONLY.reset(token)


def cpu_identity() -> str:
    """What ``-march=native`` compiles for: the architecture, and the CPU's model and feature flags where
    Linux lists them (each distinct line once)."""
    lines = [platform.machine(), platform.processor()]
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        cpuinfo = []
    for line in cpuinfo:
        if line.split(":", 1)[0].strip() in ("model name", "flags", "Features", "CPU implementer", "CPU part") \
                and line not in lines:
            lines.append(line)
    return "\n".join(lines)


def _compile(source: Path, cc: str) -> Path:
    """The cached library of ``source``: built with TUNED_FLAGS where the compiler takes them, else without."""
    try:
        return _build(source, cc, FLAGS + TUNED_FLAGS, cpu_identity())
    except subprocess.CalledProcessError:
        return _build(source, cc, FLAGS, "")


def _build(source: Path, cc: str, flags: tuple[str, ...], cpu: str) -> Path:
    text = source.read_bytes()
    key = hashlib.sha256(b"\0".join([text, " ".join(flags).encode(), cc.encode(), platform.machine().encode(),
                                      cpu.encode()]))
    target = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so.partial", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, "-o", partial, str(source), "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def load_library(source: Path) -> "NativeFunctions | None":
    """The exported functions of the C file ``source``'s compiled library (built once per machine, cached), or
    None when native kernels are off or it cannot be built here (``unavailable_reason`` says why). Each takes
    its arguments by the names and types its C definition declares (``declared_functions``)."""
    if disabled():
        return None
    with _LOCK:
        if source not in _LIBRARIES:
            _LIBRARIES[source] = None
            cc = compiler()
            try:
                if cc is None:
                    raise OSError("no C compiler (set CC, or install cc, gcc or clang)")
                _LIBRARIES[source] = _declare(ctypes.CDLL(str(_compile(source, cc))), source)
            except (OSError, subprocess.SubprocessError) as error:
                _REASONS[source] = f"{source.name} not built: {_first_error(error)}"
                log.info("native kernel off, the PyTorch path is used: %s", _REASONS[source])
        return _LIBRARIES[source]


def build_variant(source: Path, flags: tuple[str, ...]) -> "NativeFunctions":
    """``source`` built with FLAGS and ``flags`` instead of TUNED_FLAGS (cached as ``load_library``'s builds are),
    loaded apart from the library that ``load_library`` hands out: for tests of the code that another CPU
    would run, e.g. ``("-mavx2", "-mfma")`` on an AVX-512 machine. Raises where it cannot be built."""
    cc = compiler()
    if cc is None:
        raise OSError("no C compiler (set CC, or install cc, gcc or clang)")
    return _declare(ctypes.CDLL(str(_build(source, cc, FLAGS + tuple(flags), ""))), source)


def status(source: Path) -> str:
    """"on" if ``source``'s library loads, else "off: <why>" (what the bench and the CLI show)."""
    return "on" if load_library(source) is not None else f"off: {unavailable_reason(source)}"


def _first_error(error: Exception) -> str:
    """The compiler's first error line (or the exception's text)."""
    lines = [line.strip() for line in (getattr(error, "stderr", None) or "").splitlines() if line.strip()]
    return next((line for line in lines if "error" in line), lines[-1] if lines else str(error))


def unavailable_reason(source: Path) -> str | None:
    """Why ``load_library(source)`` gives None (after it was called), or None if it loaded."""
    if _REFERENCE_ONLY.get():
        return "reference kernels only (ops.native.reference_kernels)"
    if disabled():
        return f"{DISABLE_VARIABLE}=0"
    return _REASONS.get(source)


def chunk_count(rows: int, min_rows: int) -> int:
    """How many chunks ``run_in_chunks`` cuts ``rows`` into: one per ``min_rows`` rows at most, and at
    most ``CHUNKS_PER_THREAD`` per intra-op thread."""
    threads = torch.get_num_threads()
    if threads <= 1:
        return 1
    return max(1, min(rows // max(min_rows, 1), CHUNKS_PER_THREAD * threads))


def run_in_chunks(call: Callable[[int, int, int], None], rows: int, chunks: int) -> None:
    """``call(first_row, end_row, chunk_index)`` over ``chunks`` equal slices of ``rows``, on the thread
    pool when there is more than one."""
    bounds = [rows * i // chunks for i in range(chunks + 1)]
    if chunks == 1:
        call(0, rows, 0)
        return
    futures = [_pool().submit(call, bounds[i], bounds[i + 1], i) for i in range(chunks)]
    for future in futures:
        future.result()


def _pool() -> ThreadPoolExecutor:
    global _POOL, _POOL_KEY
    key = (os.getpid(), torch.get_num_threads())
    with _LOCK:
        if _POOL is None or _POOL_KEY != key:
            if _POOL is not None and _POOL_KEY[0] == key[0]:
                _POOL.shutdown(wait=False)
            _POOL, _POOL_KEY = ThreadPoolExecutor(key[1], thread_name_prefix="luna-native"), key
        return _POOL


def forget() -> None:
    """Forget which libraries were loaded or failed, so the next ``load_library`` tries again (tests, or
    after installing a compiler in a running session)."""
    with _LOCK:
        _LIBRARIES.clear()
        _REASONS.clear()
