"""Benchmark suites behind ``attnkit bench`` and ``benchmarks/``."""

from .harness import Row, format_table, machine_info, peak_rss_growth, time_pair, write_json

SUITES = ("kernels",)


def run_suite(name: str, quick: bool, progress=None) -> list[Row]:
    if name == "kernels":
        from .kernels import run
    else:
        raise ValueError(f"suite: expected one of {SUITES}, got {name!r}")
    return run(quick=quick, progress=progress)


__all__ = ["Row", "SUITES", "format_table", "machine_info", "peak_rss_growth", "run_suite", "time_pair", "write_json"]
