"""Mechanism benchmarks: every mechanism against attnkit softmax attention, same run.

fp32, causal, B=1, H=8, D=64 at N = 4096 and 16384 (``quick``: N = 512, one repeat, and
the memory of one mechanism at N = 1024 and 4096). Targets: sigmoid at most 1.0x softmax time, forward and
forward+backward; every other mechanism at most 2x forward and 2.5x forward+backward;
peak memory of forward+backward growing linearly in N (4x the tokens: at most ~5x the
MB; measured in a fresh process as the growth of the resident set's high-water mark,
reset just before the call). Top-k and Top-theta also report the fraction of (query, key) pairs they kept and the
relative error of their output against exact softmax attention.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import api
from .. import mods as M
from ..mechanisms import get_mechanism
from ..mechanisms.topk import TopTheta, calibrate_top_theta
from .harness import Row, fwd_bwd, peak_rss_growth, time_pair

B, H, D = 1, 8, 64
SUITE = "mechanisms"
NAMES = (
    "sigmoid",
    "signed",
    "stick_breaking",
    "selective",
    "forgetting",
    "adaptive_span",
    "topk",
    "top_theta",
    "multi_token",
    "differential",
    "talking_heads",
)
PARAMS: dict[str, dict[str, Any]] = {
    "forgetting": {"num_heads": H},
    "adaptive_span": {"num_heads": H, "max_span": 1024, "init": 0.5},
    "topk": {"k": 64},
    "multi_token": {"num_heads": H},
    "talking_heads": {"num_heads": H},
}
STEPS = len(NAMES) + 3


def _inputs(n: int, seed: int = 0, grad: bool = False):
    g = torch.Generator().manual_seed(seed + n)
    qkv = [torch.randn(B, H, n, D, generator=g) for _ in range(3)]
    return [t.requires_grad_() for t in qkv] if grad else qkv


def build(name: str, n: int):
    """The benchmarked configuration of each mechanism (Top-theta: thresholds calibrated
    on other samples to keep 64 logits per row)."""
    if name == "top_theta":
        q, k, _ = _inputs(n, seed=1)
        return TopTheta(calibrate_top_theta(q, k, 64, mask=M.causal(), per_position=True))
    return get_mechanism(name, **PARAMS.get(name, {}))


def timing_rows(name: str, n: int, repeats: int) -> list[Row]:
    mech = build(name, n)
    limit_fwd, limit_bwd = (1.0, 1.0) if name == "sigmoid" else (2.0, 2.5)
    softmax = lambda a, b, c: api.attention(a, b, c, mask=M.causal())
    candidate = lambda a, b, c: mech(a, b, c, mask=M.causal())
    rows = []
    q, k, v = _inputs(n)
    with torch.no_grad():
        a, b = time_pair(lambda: candidate(q, k, v), lambda: softmax(q, k, v), repeats=repeats)
    rows.append(Row(SUITE, f"{name} fwd", f"N={n}", a, "attnkit softmax", b, f"<= {limit_fwd:g}x", a / b <= limit_fwd))
    qg, kg, vg = _inputs(n, grad=True)
    a, b = time_pair(fwd_bwd(candidate, qg, kg, vg), fwd_bwd(softmax, qg, kg, vg), repeats=max(1, repeats - 1))
    rows.append(Row(SUITE, f"{name} fwd+bwd", f"N={n}", a, "attnkit softmax", b, f"<= {limit_bwd:g}x", a / b <= limit_bwd))
    return rows


def peak_growth(name: str, n: int) -> float | str:
    """MB the resident set peaks above where it stood before one causal forward+backward,
    in a fresh process (Top-theta with fixed thresholds: calibration has its own peak)."""
    made = (
        f"TopTheta(torch.linspace(1.0, 2.0, {H}))"
        if name == "top_theta"
        else f"get_mechanism({name!r}, **{PARAMS.get(name, {})!r})"
    )
    setup = f"""
import attnkit
from attnkit.mechanisms import get_mechanism
from attnkit.mechanisms.topk import TopTheta
mech = {made}
q, k, v = (torch.randn(1, {H}, {n}, {D}).requires_grad_() for _ in range(3))
"""
    res = peak_rss_growth(setup, "out = mech(q, k, v, mask=attnkit.causal()); out.backward(torch.ones_like(out))", timeout=3600)
    return res["error"] if "error" in res else res["growth_mb"]


def memory_rows(name: str, sizes: list[int]) -> list[Row]:
    growth: dict[int, float] = {}
    for n in sizes:
        got = peak_growth(name, n)
        if isinstance(got, str):
            return [Row(SUITE, f"{name} peak RSS, fwd+bwd", f"N={n}", None, "-", None, "linear in N", False, got)]
        growth[n] = got
    small, large = sizes
    ratio = growth[large] / max(growth[small], 1.0)
    linear = ratio <= 1.25 * large / small
    note = f"{growth[small]:.0f} MB at N={small}, {growth[large]:.0f} MB at N={large} ({ratio:.1f}x for {large // small}x tokens)"
    return [
        Row(
            SUITE,
            f"{name} peak RSS, fwd+bwd",
            f"N={small},{large}",
            None,
            "-",
            None,
            "linear in N",
            linear,
            note,
            extra={"growth_mb": growth},
        )
    ]


def sparsity_rows(n: int) -> list[Row]:
    """Kept fraction and output error against exact softmax of top-k and Top-theta."""
    q, k, v = _inputs(n)
    rows = []
    with torch.no_grad():
        exact = api.attention(q, k, v, mask=M.causal())
        q_cal, k_cal, _ = _inputs(n, seed=1)
        theta = calibrate_top_theta(q_cal, k_cal, 64, mask=M.causal(), per_position=True)
        variants = [("topk k=64", get_mechanism("topk", k=64))]
        variants += [
            (f"top_theta keep=64, {c}", TopTheta(theta, compensation=c)) for c in ("none", "denominator", "denominator+vmean")
        ]
        for label, mech in variants:
            out = mech(q, k, v, mask=M.causal())
            err = float((out - exact).norm() / exact.norm())
            rows.append(
                Row(
                    SUITE,
                    f"{label}: kept fraction / rel. error",
                    f"N={n}",
                    None,
                    "exact softmax",
                    None,
                    "report",
                    None,
                    f"kept {mech.kept_fraction:.4f} of visible pairs, relative output error {err:.3g}",
                    extra={"kept_fraction": mech.kept_fraction, "relative_error": err},
                )
            )
    return rows


def run(quick: bool = False, progress=None) -> list[Row]:
    sizes = [512] if quick else [4096, 16384]
    rows: list[Row] = []
    for name in NAMES:
        if progress:
            progress(f"{name}")
        for n in sizes:
            rows += timing_rows(name, n, repeats=(1 if quick else 3 if n <= 4096 else 1))
    if progress:
        progress("sparsity")
    rows += sparsity_rows(sizes[0])
    if progress:
        progress("memory")
    for name in ("sigmoid",) if quick else NAMES:
        rows += memory_rows(name, [1024, 4096] if quick else sizes)
    if progress:
        progress("done")
    return rows
