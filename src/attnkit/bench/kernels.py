"""Kernel benchmarks: attnkit against torch SDPA on this machine (B=1, H=8, D=64).

Targets are the project's kernel goals; ``ok`` says whether this run met them. The
``quick`` suite uses smaller sizes so it finishes in about a minute on 2 cores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import api
from .. import mods as M
from ..kernels import chunked_attention, make_request
from .harness import Row, Step, fwd_bwd, peak_rss_growth, run_steps, time_pair

B, H, D = 1, 8, 64
STEPS = 6


def _inputs(n: int, dtype=torch.float32, grad: bool = False):
    g = torch.Generator().manual_seed(n)
    qkv = [torch.randn(B, H, n, D, generator=g, dtype=torch.float32).to(dtype) for _ in range(3)]
    if grad:
        qkv = [t.requires_grad_() for t in qkv]
    return qkv


def _ratio_row(case, n, cand, base, baseline_name, limit, repeats, faster=False, note=""):
    a, b = time_pair(cand, base, repeats=repeats)
    ratio = a / b
    target = f"<= {limit:g}x" if not faster else f">= {1 / limit:g}x faster"
    return Row("kernels", case, f"N={n}", a, baseline_name, b, target, ratio <= limit, note)


def dense_cases(n: int, repeats: int) -> list[Row]:
    rows = []
    q, k, v = _inputs(n)
    with torch.no_grad():
        rows.append(
            _ratio_row(
                "full fwd fp32",
                n,
                lambda: api.attention(q, k, v, backend="chunked"),
                lambda: F.scaled_dot_product_attention(q, k, v),
                "sdpa",
                1.3,
                repeats,
            )
        )
        rows.append(
            _ratio_row(
                "causal fwd fp32",
                n,
                lambda: api.attention(q, k, v, mask=M.causal(), backend="chunked"),
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                "sdpa causal",
                1.3,
                repeats,
            )
        )
        req = make_request(q, k, v, mask=M.causal())
        rows.append(
            _ratio_row(
                "causal fwd fp32, tiled engine",
                n,
                lambda: chunked_attention(req, engine="tiled"),
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                "sdpa causal",
                2.5,
                repeats,
                note="the engine for non-affine mods: band masks run its C loop",
            )
        )
        rows.append(
            _ratio_row(
                "alibi causal fwd fp32",
                n,
                lambda: api.attention(q, k, v, mask=M.causal(), score=M.alibi(H)),
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                "sdpa causal, no mod",
                1.5,
                repeats,
            )
        )
        rows.append(
            _ratio_row(
                "softcap causal fwd fp32",
                n,
                lambda: api.attention(q, k, v, mask=M.causal(), score=M.softcap(30.0)),
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                "sdpa causal, no mod",
                1.5,
                repeats,
                note="non-affine mod: the tiled engine's C loop",
            )
        )
        qb, kb, vb = (t.bfloat16() for t in (q, k, v))
        rows.append(
            _ratio_row(
                "causal fwd bf16",
                n,
                lambda: api.attention(qb, kb, vb, mask=M.causal(), backend="chunked"),
                lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True),
                "sdpa causal bf16",
                1.0,
                repeats,
                note="bf16 matmul tiles need AVX512-BF16/AMX; else the fused op",
            )
        )
    qg, kg, vg = _inputs(n, grad=True)
    bwd_repeats = max(1, repeats - 2)
    rows.append(
        _ratio_row(
            "full fwd+bwd fp32",
            n,
            fwd_bwd(lambda a, b, c: api.attention(a, b, c, backend="chunked"), qg, kg, vg),
            fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c), qg, kg, vg),
            "sdpa",
            1.5,
            bwd_repeats,
        )
    )
    rows.append(
        _ratio_row(
            "causal fwd+bwd fp32",
            n,
            fwd_bwd(lambda a, b, c: api.attention(a, b, c, mask=M.causal(), backend="chunked"), qg, kg, vg),
            fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), qg, kg, vg),
            "sdpa causal",
            1.5,
            bwd_repeats,
        )
    )
    return rows


def sparse_cases(n: int, repeats: int) -> list[Row]:
    rows = []
    q, k, v = _inputs(n)
    with torch.no_grad():
        rows.append(
            _ratio_row(
                "window 256 causal fwd",
                n,
                lambda: api.attention(q, k, v, mask=M.window(256)),
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                "sdpa causal",
                1 / 8,
                repeats,
                faster=True,
            )
        )
        ids = torch.arange(n) // (n // 8)
        dense = (ids[:, None] == ids[None, :])[None, None]
        rows.append(
            _ratio_row(
                "document (8 docs) fwd",
                n,
                lambda: api.attention(q, k, v, mask=M.document(ids)),
                lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
                "sdpa + dense bool mask",
                1 / 4,
                repeats,
                faster=True,
            )
        )
    return rows


def tiny_cases(repeats: int) -> list[Row]:
    n = 128
    q, k, v = _inputs(n)
    window = M.window(32)
    dense = window.dense(B, H, n, n)
    with torch.no_grad():
        return [
            _ratio_row(
                "tiny causal call",
                n,
                lambda: api.attention(q, k, v, mask=M.causal()),
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                "sdpa causal",
                2.0,
                repeats * 20,
            ),
            _ratio_row(
                "tiny window call",
                n,
                lambda: api.attention(q, k, v, mask=window),
                lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
                "sdpa + dense bool mask",
                2.0,
                repeats * 20,
            ),
        ]


def _calls(fn, n: int):
    """n calls of fn as one timed unit: a decoding step is tens of microseconds."""

    def many():
        for _ in range(n):
            fn()

    return many


def decode_cases(sizes: list[int], repeats: int) -> list[Row]:
    """One-token decoding steps (q: 1 query of 8 heads) against Nk cached keys: the cost
    of attnkit's validation, planning and dispatch on the smallest call a model makes."""
    from ..mechanisms import get_mechanism

    rows = []
    sigmoid = get_mechanism("sigmoid")
    for nk in sizes:
        g = torch.Generator().manual_seed(nk)
        q = torch.randn(B, H, 1, D, generator=g)
        k, v = (torch.randn(B, H, nk, D, generator=g) for _ in range(2))
        kg, vg = (torch.randn(B, 2, nk, D, generator=g) for _ in range(2))
        window = M.causal() & M.window(256)
        seen = (torch.arange(nk) >= nk - 1 - 256).view(1, 1, 1, nk)
        calls = max(2, 4096 // max(1, nk // 64))  # ~ tens of ms per timed unit
        cases = (
            ("decode step softmax", lambda: api.attention(q, k, v), lambda: F.scaled_dot_product_attention(q, k, v), "sdpa", 1.1),
            (
                "decode step GQA 8/2",
                lambda: api.attention(q, kg, vg),
                lambda: F.scaled_dot_product_attention(q, kg, vg, enable_gqa=True),
                "sdpa gqa",
                1.1,
            ),
            (
                "decode step window 256",
                lambda: api.attention(q, k, v, mask=window),
                lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=seen),
                "sdpa + bool mask",
                1.2,
            ),
            (
                "decode step sigmoid",
                lambda: api.attention(q, k, v, mechanism=sigmoid),
                lambda: F.scaled_dot_product_attention(q, k, v),
                "sdpa softmax",
                1.2,
            ),
        )
        with torch.no_grad():
            for case, ours, base, name, limit in cases:
                a, b = time_pair(_calls(ours, calls), _calls(base, calls), repeats=repeats)
                rows.append(
                    Row(
                        "kernels",
                        case,
                        f"Nk={nk}",
                        a / calls,
                        name,
                        b / calls,
                        f"<= {limit:g}x",
                        a / b <= limit,
                        f"per call, medians of {repeats} x {calls} calls",
                    )
                )
    return rows


def memory_cases(fwd_n: int, bwd_n: int) -> list[Row]:
    setup = f"""
import attnkit
q, k, v = (torch.randn(1, {H}, N, {D}) for _ in range(3))
"""
    rows = []
    for label, n, grad, limit in (("fwd", fwd_n, False, 1024), ("fwd+bwd", bwd_n, True, 2048)):
        s = setup.replace("N", str(n))
        if grad:
            s += "\nfor t in (q, k, v): t.requires_grad_()\n"
            body = (
                "out = attnkit.attention(q, k, v, mask=attnkit.causal(), backend='chunked'); out.backward(torch.ones_like(out))"
            )
        else:
            body = "with torch.no_grad(): out = attnkit.attention(q, k, v, mask=attnkit.causal(), backend='chunked')"
        res = peak_rss_growth(s, body)
        if "error" in res:
            rows.append(
                Row(
                    "kernels",
                    f"peak RSS growth, causal {label}",
                    f"N={n}",
                    None,
                    "-",
                    None,
                    f"<= {limit} MB",
                    False,
                    res["error"],
                )
            )
            continue
        rows.append(
            Row(
                "kernels",
                f"peak RSS growth, causal {label}",
                f"N={n}",
                res["seconds"] * 1e3,
                "-",
                None,
                f"<= {limit} MB",
                res["growth_mb"] <= limit,
                f"{res['growth_mb']:.0f} MB growth",
                extra={"growth_mb": res["growth_mb"]},
            )
        )
    return rows


def run(quick: bool = False, progress=None) -> list[Row]:
    sizes = [1024, 2048] if quick else [4096, 16384]
    repeats = 3 if quick else 5
    steps: list[Step] = [(f"dense N={n}", lambda n=n: dense_cases(n, repeats)) for n in sizes]
    steps.append((f"sparse N={sizes[-1]}", lambda: sparse_cases(sizes[-1], repeats)))
    steps.append(("tiny", lambda: tiny_cases(repeats)))
    steps.append(("decode", lambda: decode_cases([512, 4096] if quick else [512, 4096, 32768], repeats + 4)))
    steps.append(("memory", lambda: memory_cases(16384 if quick else 65536, 4096 if quick else 32768)))
    return run_steps(steps, progress)
