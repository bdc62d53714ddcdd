"""Benchmark suites behind ``attnkit bench`` and ``benchmarks/``.

A suite is a module ``attnkit.bench.<name>`` with ``STEPS`` (how many progress steps it
reports) and ``run(quick: bool, progress) -> list[Row]``. Register it in ``SUITES``.
"""

import importlib

from .harness import Row, format_table, machine_info, peak_rss_growth, time_pair, write_json

SUITES = (
    "kernels",
    "hf",
    "inspect",
    "linear",
    "sparse",
    "mechanisms",
    "probes",
    "steer",
    "kv",
    "distributed",
    "diffusion",
    "sweeps",
    "vision",
)


def suite_module(name: str):
    if name not in SUITES:
        raise ValueError(f"suite: expected one of {', '.join(SUITES)}, got {name!r}")
    return importlib.import_module(f"{__name__}.{name}")


def run_suite(name: str, quick: bool, progress=None) -> list[Row]:
    return suite_module(name).run(quick=quick, progress=progress)


__all__ = [
    "Row",
    "SUITES",
    "format_table",
    "machine_info",
    "peak_rss_growth",
    "run_suite",
    "suite_module",
    "time_pair",
    "write_json",
]
