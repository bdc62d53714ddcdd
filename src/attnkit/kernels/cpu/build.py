"""Build and load the CPU operators (the ``attnkit::`` namespace of torch.ops).

The C++ sources beside this file compile with ``torch.utils.cpp_extension.load`` into
torch's extension cache (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``):
torch rebuilds only when a source or a flag changes, and its file lock makes concurrent
first uses (several processes, pytest workers) build once and wait for that build. The
README's set-up command builds it ahead (``build.main()``);
otherwise the first call that could use an operator builds it.

Threads come from torch's intra-op pool (``at::parallel_for``). The CPU wheels run it on
GNU OpenMP, whose thread pool does not survive ``fork``: in a forked child the first
parallel region of any torch op waits forever for the parent's threads. So, once the
operators load, a forked child starts on one thread (``os.register_at_fork``; the same
thing DataLoader does in its workers); it may raise the count again only by starting
fresh processes (spawn) instead.

``ATTNKIT_NATIVE=0`` turns the operators off: every caller runs its PyTorch tiles, which
compute the same values. Where the build or the load fails the same happens, and the
first call that falls back warns once with the reason (``status()`` keeps it, and
``attnkit.explain()`` and ``attnkit doctor`` print it).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..compile_constant import constant_for_compile

HERE = Path(__file__).parent
#: the translation units: the loops (no torch headers, quick to compile), the matrix
#: products, and one binding file per family of operators
SOURCES = [
    "loops_pointwise.cpp",
    "loops_fused.cpp",
    "loops_mixed.cpp",
    "loops_sparse.cpp",
    "gemm.cpp",
    "pointwise.cpp",
    "fused.cpp",
    "mixed.cpp",
    "sparse.cpp",
    "kv.cpp",
    "kv_attention.cpp",
]
HEADERS = ["common.h", "parallel.h", "binding.h"]
# -fopenmp: at::parallel_for is an OpenMP pragma in torch's headers, compiled into this
# library; without the flag it runs every part on one thread. Linked with -fopenmp, the
# library needs libgomp.so.1, the soname torch already loaded from its own lib/, so its
# pragmas use torch's thread pool (one runtime: torch.set_num_threads governs both).
OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") and "OpenMP" in torch.__config__.parallel_info() else []
LDFLAGS = OPENMP


def target_arch() -> str:
    """The ``-march`` of the build: ``native`` (this CPU's every instruction) unless
    ``ATTNKIT_MARCH`` names another, e.g. ``x86-64-v3`` (AVX2 + FMA) or ``x86-64-v2`` (no
    AVX): how the suite checks, on an AVX-512 host, the code paths an AVX2 CPU runs."""
    arch = os.environ.get("ATTNKIT_MARCH", "native")
    if not arch or not all(c.isalnum() or c in "-_." for c in arch):
        raise ValueError(f"ATTNKIT_MARCH: expected a -march value such as native or x86-64-v3, got {arch!r}")
    return arch


#: the sanitizers ``ATTNKIT_SANITIZE`` may name (comma-separated), for scripts/asan.sh
SANITIZERS = ("address", "undefined")


def sanitizers() -> list[str]:
    """The ``-fsanitize`` values of the build (``ATTNKIT_SANITIZE``, e.g. ``address``), none
    by default. A sanitized build is an extension of its own name; it loads only in a
    process that preloads the sanitizer's runtime (``LD_PRELOAD=$(c++ -print-file-name=libasan.so)``)."""
    given = os.environ.get("ATTNKIT_SANITIZE", "")
    names = sorted({n.strip() for n in given.split(",") if n.strip()})
    unknown = [n for n in names if n not in SANITIZERS]
    if unknown:
        raise ValueError(f"ATTNKIT_SANITIZE: expected a comma-separated subset of {', '.join(SANITIZERS)}, got {given!r}")
    return names


def _sanitize_flags() -> list[str]:
    names = sanitizers()
    return [f"-fsanitize={','.join(names)}", "-fno-omit-frame-pointer", "-g"] if names else []


def flags() -> list[str]:
    opt = "-O1" if sanitizers() else "-O3"  # a sanitized build keeps its frames readable
    return [opt, f"-march={target_arch()}", "-std=c++17", *OPENMP, *_sanitize_flags()]


def ldflags() -> list[str]:
    return [*LDFLAGS, *_sanitize_flags()]


@dataclass(frozen=True)
class Status:
    """Whether the operators run, and if not, why."""

    available: bool
    reason: str  # "built" / "loaded" details, or why not
    seconds: float = 0.0  # time spent building or loading in this process

    def describe(self) -> str:
        return f"C++ operators: {'available' if self.available else 'unavailable'} ({self.reason})"


def _cpu_signature() -> bytes:
    """The CPU's model name and flags: a -march=native build is valid on that CPU only."""
    try:
        lines = Path("/proc/cpuinfo").read_bytes().splitlines()
    except OSError:
        lines = []
    first: dict[bytes, bytes] = {}
    for line in lines:
        key = line.split(b":")[0].strip()
        if key in (b"model name", b"flags", b"Features") and key not in first:
            first[key] = line
    return b"".join(first.values()) + torch.backends.cpu.get_cpu_capability().encode()


def extension_name() -> str:
    """The extension's name, keyed by the CPU (so a shared cache never serves one CPU's
    -march=native build to another), the target architecture and torch's version."""
    digest = hashlib.sha256(_cpu_signature() + target_arch().encode() + torch.__version__.encode()).hexdigest()[:12]
    suffix = "".join(f"_{n}" for n in sanitizers())
    return f"attnkit_cpu_{digest}{suffix}"


_lock = threading.Lock()
_status: Status | None = None


def disabled() -> bool:
    return os.environ.get("ATTNKIT_NATIVE", "1") == "0"


def _load(verbose: bool = False) -> Status:
    if disabled():
        return Status(False, "turned off by ATTNKIT_NATIVE=0")
    start = time.perf_counter()
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(
            name=extension_name(),
            sources=[str(HERE / s) for s in SOURCES],
            extra_cflags=flags(),
            extra_ldflags=ldflags(),
            extra_include_paths=[str(HERE)],
            is_python_module=False,
            verbose=verbose,
        )
        torch.ops.attnkit._gemm_mode  # the library registered its operators  # noqa: B018
        from . import fused, kv, mixed, pointwise, sparse

        for family in (pointwise, fused, mixed, sparse, kv):
            family.register()
        _guard_fork()
    except Exception as err:  # a missing compiler, a failed build, a library that does not load: all fall back
        first = str(err).strip().splitlines()
        detail = first[-1] if first else type(err).__name__
        return Status(False, f"build or load failed: {type(err).__name__}: {detail[:300]}", time.perf_counter() - start)
    sanitized = f", -fsanitize={','.join(sanitizers())}" if sanitizers() else ""
    return Status(True, f"torch extension {extension_name()}, -march={target_arch()}{sanitized}", time.perf_counter() - start)


def _single_thread_child() -> None:
    torch.set_num_threads(1)


_fork_guarded = False


def _guard_fork() -> None:
    """A forked child runs on one thread: GNU OpenMP's pool is the parent's and is gone."""
    global _fork_guarded
    if not _fork_guarded and hasattr(os, "register_at_fork") and "OpenMP" in torch.__config__.parallel_info():
        os.register_at_fork(after_in_child=_single_thread_child)
        _fork_guarded = True


def status() -> Status:
    """Build (first use) or load the operators once per process; never raises."""
    global _status
    if _status is None:
        with _lock:
            if _status is None:
                _status = _load()
    return _status


@constant_for_compile  # torch.compile reads it once, as a constant (no lock in the graph)
def available() -> bool:
    return status().available


_warned = False


def warn_fallback() -> None:
    """One warning per process at the first call that runs PyTorch tiles because the
    operators are unavailable (not when ATTNKIT_NATIVE=0 asked for that)."""
    global _warned
    st = status()
    if _warned or st.available or disabled():
        return
    _warned = True
    warnings.warn(
        f"attnkit: the C++ CPU operators are unavailable ({st.reason}); running the PyTorch tiles, "
        "which compute the same values 1.3-3.4x slower. `attnkit doctor` shows the build status.",
        RuntimeWarning,
        stacklevel=3,
    )


@functools.cache
def compiler() -> str:
    """The C++ compiler cpp_extension uses, with its version line, or why there is none."""
    import shutil
    import subprocess

    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx)
    if path is None:
        return f"{cxx}: not found"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError) as err:
        return f"{path}: {err}"
    return f"{path} ({out[0] if out else 'unknown version'})"


def main() -> int:
    """Build ahead (the set-up command): prints what happened and how long it took."""
    st = _load(verbose="--verbose" in sys.argv)
    print(f"attnkit: {st.describe()} in {st.seconds:.1f} s")
    return 0 if st.available or disabled() else 1


if __name__ == "__main__":
    sys.exit(main())
