"""What a measurement ran on: Python, torch, threads, CPU capability, the accelerator.

Here, below every tool, because benchmarks (``bench/``), the arena's result files and the
GPU check all stamp their output with it.
"""

from __future__ import annotations

import functools
import platform

import torch


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def cpu_flags() -> str | None:
    """The CPU's feature flags as /proc/cpuinfo lists them (Linux), None where unknown."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def has_bf16_units(flags: str) -> bool:
    """Whether ``cpu_flags()`` name native bf16 dot products (AVX512-BF16 or AMX)."""
    return " avx512_bf16" in flags or " amx_bf16" in flags


def machine_info() -> dict:
    """Python and torch versions, intra-op threads, the CPU's vector capability, the
    architecture, and the CUDA device when one is visible (else None)."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
