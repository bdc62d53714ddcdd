"""Timing and memory measurement shared by every benchmark suite.

Times are medians over repeats after a warm-up, and every ratio is taken against a
baseline measured in the same run, interleaved with the candidate so that a noisy
shared machine slows both alike. Peak memory is read in a fresh subprocess (VmHWM),
as growth over the process's own state just before the measured call.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, overload

from ..kernels.machine import machine_info  # noqa: F401  (re-exported: bench.machine_info)


@dataclass
class Row:
    """One benchmark line: attnkit against a baseline, and the target it must meet."""

    suite: str
    case: str
    size: str
    attnkit_ms: float | None
    baseline: str
    baseline_ms: float | None
    target: str = ""
    ok: bool | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if self.attnkit_ms is None or not self.baseline_ms:
            return None
        return self.attnkit_ms / self.baseline_ms

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ratio"] = self.ratio
        return d


@overload
def time_pair(
    candidate: Callable[[], object], baseline: Callable[[], object], repeats: int = 5, warmup: int = 1
) -> tuple[float, float]: ...


@overload
def time_pair(candidate: Callable[[], object], baseline: None, repeats: int = 5, warmup: int = 1) -> tuple[float, None]: ...


def time_pair(
    candidate: Callable[[], object], baseline: Callable[[], object] | None, repeats: int = 5, warmup: int = 1
) -> tuple[float, float | None]:
    """Median milliseconds of candidate and baseline, run alternately."""
    for _ in range(warmup):
        candidate()
        if baseline is not None:
            baseline()
    cand, base = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        candidate()
        cand.append(time.perf_counter() - t)
        if baseline is not None:
            t = time.perf_counter()
            baseline()
            base.append(time.perf_counter() - t)
    return 1e3 * statistics.median(cand), (1e3 * statistics.median(base) if base else None)


def time_one(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    return time_pair(fn, None, repeats, warmup)[0]


_RSS_PROBE = """
import json, time
import torch
torch.manual_seed(0)

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024

{setup}
base = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the high-water mark to the current resident set
t = time.perf_counter()
{body}
elapsed = time.perf_counter() - t
peak = status("VmHWM:")
print(json.dumps({{"growth_mb": peak - base, "peak_mb": peak, "seconds": elapsed}}))
"""


def peak_rss_growth(setup: str, body: str, timeout: float = 1800) -> dict[str, Any]:
    """Run ``setup`` then ``body`` in a fresh Python; report peak RSS growth during ``body``
    (the high-water mark is reset after ``setup``, so a transient peak of the set-up, or
    memory the allocator keeps from it, cannot hide the body's own peak; Linux only).

    ``setup`` allocates inputs (counted in the baseline); ``body`` is the measured call.
    Returns {"growth_mb", "peak_mb", "seconds"} or {"error": ...}.
    """
    code = _RSS_PROBE.format(setup=textwrap.dedent(setup), body=textwrap.dedent(body))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()
        return {"error": tail[-1] if tail else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def format_table(rows: list[Row]) -> str:
    head = ["suite", "case", "size", "attnkit ms", "baseline", "baseline ms", "ratio", "target", "ok"]
    body = []
    for r in rows:
        body.append(
            [
                r.suite,
                r.case,
                r.size,
                "-" if r.attnkit_ms is None else f"{r.attnkit_ms:.1f}",
                r.baseline,
                "-" if r.baseline_ms is None else f"{r.baseline_ms:.1f}",
                "-" if r.ratio is None else f"{r.ratio:.2f}",
                r.target,
                "" if r.ok is None else ("yes" if r.ok else "NO"),
            ]
        )
        if r.note:
            body[-1][-1] += f"  ({r.note})"
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(head, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in body]
    return "\n".join(lines)


def write_json(rows: list[Row], path: str, meta: dict) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": [r.to_dict() for r in rows]}, f, indent=2)


def fwd_bwd(fn, q, k, v):
    """A timed step: clear the gradients, run ``fn(q, k, v)`` and back-propagate ones."""
    import torch

    def run():
        for t in (q, k, v):
            t.grad = None
        out = fn(q, k, v)
        out.backward(torch.ones_like(out))

    return run


Step = tuple[str, Callable[..., list[Row]]]
"""A suite's ``(label, step)``: the step is called with no arguments (``lambda n=n: ...``
binds a loop's value as a default) and returns its rows."""


def run_steps(steps: Iterable[Step], progress: Callable[[str], object] | None = None) -> list[Row]:
    """Run a suite's ``(label, step)`` pairs in order, reporting each label to ``progress``
    before it starts; each step returns a list of rows."""
    rows: list[Row] = []
    for label, step in steps:
        if progress:
            progress(label)
        rows += step()
    return rows
