"""What a measurement ran on: Python, torch, threads, CPU capability, the accelerator.

Here, below every tool, because benchmarks (``bench/``), the arena's result files and the
GPU check all stamp their output with it.
"""

from __future__ import annotations

import platform

import torch


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
