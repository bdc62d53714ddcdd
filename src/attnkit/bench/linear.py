"""Linear-attention benchmarks (fp32, causal, B=1, H=8, D=64), ratios from the same run.

Targets:
- chunked forward at N=16384 at least 10x faster than torch SDPA causal;
- time at N=32768 at most 2.3x the time at N=16384 (linear in N);
- recurrent decoding: per-token time at position 32k within 1.2x of position 1k;
- forward+backward at N=65536 with peak RSS growth at most 1 GiB.
``quick`` runs the same rows at a quarter of the sizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..mechanisms import get_mechanism
from ..mods import causal
from .harness import Row, peak_rss_growth, run_steps, time_pair

B, H, D = 1, 8, 64
STEPS = 4
#: sum rule; fixed decay; diagonal gates; delta rule; gated delta rule
MECHANISMS = ("linear_elu", "retnet", "gla", "deltanet", "gated_deltanet")


def _inputs(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=g) for _ in range(3)]


def _forward(mech, q, k, v):
    return lambda: mech(q, k, v, mask=causal(), backend="chunked")


def speed_rows(n: int, repeats: int) -> list[Row]:
    q, k, v = _inputs(n)
    rows = []
    with torch.no_grad():
        for name in MECHANISMS:
            mech = get_mechanism(name)
            a, b = time_pair(
                _forward(mech, q, k, v), lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), repeats=repeats
            )
            rows.append(Row("linear", f"{name} chunked fwd", f"N={n}", a, "sdpa causal", b, ">= 10x faster", a * 10 <= b))
    return rows


def scaling_rows(n: int, repeats: int) -> list[Row]:
    short, long = _inputs(n), _inputs(2 * n)
    rows = []
    with torch.no_grad():
        for name in MECHANISMS:
            mech = get_mechanism(name)
            a, b = time_pair(_forward(mech, *long), _forward(mech, *short), repeats=repeats)
            rows.append(
                Row("linear", f"{name} chunked fwd, 2N vs N", f"N={2 * n}", a, f"same at N={n}", b, "<= 2.3x", a <= 2.3 * b)
            )
    return rows


def decode_rows(near: int, far: int, steps: int) -> list[Row]:
    """Per-token decoding time after a prefill of ``near`` and of ``far`` tokens."""
    rows = []
    with torch.no_grad():
        for name in MECHANISMS:
            mech = get_mechanism(name)
            states = {}
            for n in (near, far):
                q, k, v = _inputs(n)
                states[n] = mech(q, k, v, mask=causal(), return_state=True)[1]
            q1, k1, v1 = (t[:, :, :1] for t in _inputs(1, seed=1))

            def step(n, mech=mech, states=states, q1=q1, k1=k1, v1=v1):
                return lambda: mech(q1, k1, v1, mask=causal(), initial_state=states[n], return_state=True)

            a, b = time_pair(step(far), step(near), repeats=steps, warmup=10)
            rows.append(
                Row(
                    "linear",
                    f"{name} decode 1 token",
                    f"pos={far}",
                    a,
                    f"same at pos={near}",
                    b,
                    "<= 1.2x",
                    a <= 1.2 * b,
                    note=f"{a * 1e3:.0f} us/token",
                )
            )
    return rows


def memory_rows(n: int) -> list[Row]:
    rows = []
    for name in ("retnet", "gated_deltanet"):
        setup = f"""
from attnkit.mechanisms import get_mechanism
from attnkit import causal
mech = get_mechanism({name!r})
q, k, v = (torch.randn({B}, {H}, {n}, {D}).requires_grad_() for _ in range(3))
mech(q[:, :, :2], k[:, :, :2], v[:, :, :2], mask=causal())  # materialise lazy gate weights
"""
        body = "out = mech(q, k, v, mask=causal(), backend='chunked'); out.backward(torch.ones_like(out))"
        res = peak_rss_growth(setup, body)
        if "error" in res:
            rows.append(
                Row("linear", f"{name} fwd+bwd peak RSS growth", f"N={n}", None, "-", None, "<= 1024 MB", False, res["error"])
            )
            continue
        rows.append(
            Row(
                "linear",
                f"{name} fwd+bwd peak RSS growth",
                f"N={n}",
                res["seconds"] * 1e3,
                "-",
                None,
                "<= 1024 MB",
                res["growth_mb"] <= 1024,
                f"{res['growth_mb']:.0f} MB growth",
                extra={"growth_mb": res["growth_mb"]},
            )
        )
    return rows


def run(quick: bool = False, progress=None) -> list[Row]:
    scale = 4 if quick else 1
    repeats = 3
    steps = [
        (f"chunked vs sdpa N={16384 // scale}", lambda: speed_rows(16384 // scale, repeats)),
        (f"scaling N={16384 // scale} -> {32768 // scale}", lambda: scaling_rows(16384 // scale, repeats)),
        (f"decoding at {1024 // scale} and {32768 // scale}", lambda: decode_rows(1024 // scale, 32768 // scale, 200)),
        (f"memory N={65536 // scale}", lambda: memory_rows(65536 // scale)),
    ]
    return run_steps(steps, progress)
