"""Property tests: ``attnkit.attention`` on every backend against a literal float64 oracle.

The oracle (attention_oracle.py) is written in the test from the formula: scores =
q k^T * scale, score mods applied literally, -inf where the mask hides a pair, softmax
with the sink logits, lse; it never runs attnkit's kernels or evaluates attnkit's mods.

What is drawn (hypothesis, derandomized, no example database: the same cases every run):

- masks: causal, window(left, right), document (ids per position or per batch row),
  prefix_lm (one or per-row prefixes), padding, composed with &, |, ~ up to two levels;
  or no mask;
- score-mod chains of 0-3 atoms in any order: alibi, softcap, temperature (scalar or per
  head), log_length_scale (causal or not), dense bias (large values, -inf entries,
  rows hidden wholly by -inf, -inf at tile boundaries), relative_bias; every tensor
  parameter learnable or not, at any position of the chain;
- memory layouts of q, k, v: contiguous, last dimension strided (x.mT.contiguous().mT,
  x[..., ::2]), (B, N, H, D) storage, storage offsets, stride-0 (expanded) batch, head
  or head-size dimension; the output gradient contiguous, strided or expanded;
- dtypes float64, float32 (values, lse and gradients), bfloat16/float16 (values);
- shapes: Nq <= Nk (bottom-right aligned), Nq = 1, GQA (1-2 key heads, 1-2 query heads
  each), Dv != D, sinks, B = 1-2, up to 40 positions with tiles of 8 x 4 so that small
  calls cross query blocks, key tiles, skipped and partly masked tiles;
- backends: reference, chunked (fused engine where it applies, tiled engine), auto
  (what the dispatcher picks), sdpa where the call reduces to it.

Checked: out, lse (rows with no visible key: zeros and lse = -inf, exactly), and the
gradients of q, k, v, sinks and every learnable mod parameter, with a random gradient
on out and on lse.

Cases per run (derandomized: the same cases every run, about 1 min for the folder on one
thread): ``test_matches_the_literal_oracle`` 500; test_nonfinite_properties.py 200
(hidden NaN/inf/huge keys and values) + 150 (NaN/inf that reaches a row is reported, at
every size) + 1 flex case; test_strided_mechanisms.py 30 (adaptive_span, hyper_attention,
nsa x float32/float64 x 5 layouts). ``ATTNKIT_PROPERTY_SCALE=8`` multiplies the drawn
cases for a soak run (passed: 4000 + 1600 + 1200 cases). Tolerances: those of
tests/helpers.py, widened by the rounding of logits of magnitude M in the call's dtype
(64 ulp x (1 + M)); gradients 8x that, times the gradient's own magnitude.

-inf in a bias is a mask: a later row scale keeps it -inf (the bare product would give
NaN for log_length_scale's factor log 1 = 0, and -inf * 0 = NaN in a learnable factor's
gradient); the oracle spells that reading out (attention_oracle.row_scale).
"""

from __future__ import annotations

import math
import os

import torch
from attention_oracle import (
    LAYOUTS,
    atom_params,
    dense_mask,
    describe_mask,
    expanded,
    oracle,
    to_attnkit_mask,
    to_attnkit_score,
    with_layout,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_tiles import tiny_tiles

import attnkit as ak
from attnkit.kernels import make_request
from attnkit.kernels.sdpa import sdpa_unsupported
from helpers import TOL

#: ATTNKIT_PROPERTY_SCALE=10 draws ten times as many cases (a soak run; CI uses 1)
SCALE = float(os.environ.get("ATTNKIT_PROPERTY_SCALE", "1"))
CASES = int(500 * SCALE)
PROPERTY_SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))

EPS = {torch.float64: 2.0**-52, torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


# ----------------------------------------------------------------------------- strategies


@st.composite
def mask_leaf(draw, B: int, Nk: int):
    kind = draw(st.sampled_from(["causal", "window", "document", "prefix_lm", "padding"]))
    if kind == "causal":
        return ("causal",)
    if kind == "window":
        return ("window", draw(st.one_of(st.none(), st.integers(0, 10))), draw(st.one_of(st.none(), st.integers(0, 6))))
    if kind == "document":
        rows = []
        for _ in range(B if draw(st.booleans()) else 1):
            starts = draw(st.lists(st.booleans(), min_size=Nk, max_size=Nk))
            rows.append(torch.tensor([0] + [int(x) for x in starts[1:]]).cumsum(0))
        return ("document", rows[0] if len(rows) == 1 else torch.stack(rows))
    if kind == "prefix_lm":
        if draw(st.booleans()):
            return ("prefix_lm", draw(st.integers(0, Nk)))
        return ("prefix_lm", torch.tensor(draw(st.lists(st.integers(0, Nk), min_size=B, max_size=B))))
    return ("padding", torch.tensor(draw(st.lists(st.integers(0, Nk), min_size=B, max_size=B))))


@st.composite
def mask_spec(draw, B: int, Nk: int, depth: int = 0):
    if depth < 2 and draw(st.integers(0, 2)) == 0:
        op = draw(st.sampled_from(["and", "or", "not"]))
        if op == "not":
            return ("not", draw(mask_spec(B, Nk, depth + 1)))
        return (op, draw(mask_spec(B, Nk, depth + 1)), draw(mask_spec(B, Nk, depth + 1)))
    return draw(mask_leaf(B, Nk))


@st.composite
def score_atoms(draw, B: int, H: int, Nq: int, Nk: int, gen: torch.Generator, low_precision: bool):
    kinds = draw(
        st.lists(st.sampled_from(["alibi", "softcap", "temperature", "log_length_scale", "bias", "relative_bias"]), max_size=3)
    )
    learns = [draw(st.booleans()) for _ in kinds]
    atoms = []
    for i, kind in enumerate(kinds):
        learn = learns[i]
        if kind == "alibi":
            atoms.append(("alibi", _param(torch.rand(H, generator=gen, dtype=torch.float64) * 0.5 + 0.05, learn)))
        elif kind == "softcap":
            atoms.append(("softcap", draw(st.sampled_from([2.0, 5.0, 20.0]))))
        elif kind == "temperature":
            if draw(st.booleans()) and not learn:
                atoms.append(("temperature", draw(st.sampled_from([0.3, 0.7, 1.9]))))
            else:
                atoms.append(("temperature", _param(torch.rand(H, generator=gen, dtype=torch.float64) * 1.5 + 0.4, learn)))
        elif kind == "log_length_scale":
            causal = draw(st.booleans())
            if draw(st.booleans()) and not learn:
                atoms.append(("log_length_scale", draw(st.sampled_from([0.3, 1.0])), causal))
            else:
                atoms.append(("log_length_scale", _param(torch.rand(H, generator=gen, dtype=torch.float64) + 0.2, learn), causal))
        elif kind == "bias":
            shape = (draw(st.sampled_from([1, B])), draw(st.sampled_from([1, H])), Nq, Nk)
            magnitude = 1.0 if low_precision else draw(st.sampled_from([1.0, 1.0, 50.0]))
            b = torch.randn(shape, generator=gen, dtype=torch.float64) * magnitude
            # -inf acts as a mask, also before row scales (log 1 = 0, learnable factors)
            if draw(st.booleans()):
                b = _with_neg_inf(draw, b)
            atoms.append(("bias", _param(b, learn)))
        else:
            bidirectional = draw(st.booleans())
            nb = draw(st.sampled_from([4, 8, 12]))
            exact = (nb // 2 if bidirectional else nb) // 2
            max_distance = draw(st.integers(exact + 1, exact + 20))
            table = torch.randn(nb, H, generator=gen, dtype=torch.float64)
            atoms.append(("relative_bias", _param(table, learn), max_distance, bidirectional))
    return atoms


def _param(t: torch.Tensor, learn: bool) -> torch.Tensor:
    return t.requires_grad_(learn)


def _with_neg_inf(draw, b: torch.Tensor) -> torch.Tensor:
    """-inf at random entries, on whole rows, and at tile boundaries (rows and columns that
    are multiples of the tiny tiles' 8 x 4)."""
    Nq, Nk = b.shape[-2:]
    b = b.clone()
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.sampled_from(["entry", "row", "boundary"]))
        i = draw(st.integers(0, Nq - 1))
        j = draw(st.integers(0, Nk - 1))
        if where == "row":
            b[..., i, :] = -math.inf
        elif where == "boundary":
            b[..., min(8 * (i // 8), Nq - 1), min(4 * (j // 4), Nk - 1)] = -math.inf
        else:
            b[..., i, j] = -math.inf
    return b


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from([torch.float64] * 6 + [torch.float32] * 3 + [torch.bfloat16, torch.float16]))
    low = dtype in (torch.bfloat16, torch.float16)
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.integers(1, 2))
    H = Hkv * G
    Nk = draw(st.integers(1, 40))
    Nq = draw(st.sampled_from([Nk, Nk, 1, draw(st.integers(1, Nk))]))
    D = draw(st.sampled_from([4, 8]))
    Dv = draw(st.sampled_from([D, D, 3]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**20)))
    mask = draw(st.one_of(st.none(), mask_spec(B, Nk)))
    atoms = draw(score_atoms(B, H, Nq, Nk, gen, low))
    sinks = torch.randn(H, generator=gen, dtype=torch.float64) if draw(st.booleans()) else None
    layouts = [draw(st.sampled_from(LAYOUTS + ("expand_batch", "expand_heads", "expand_last"))) for _ in range(3)]
    grad_layout = draw(st.sampled_from(["contiguous", "last_dim_strided", "expand_batch"]))
    backend = draw(st.sampled_from(["reference", "chunked_fused", "chunked_tiled", "auto", "sdpa"]))
    return_lse = draw(st.booleans())
    grads = not low and draw(st.booleans())
    return dict(
        dtype=dtype,
        B=B,
        Hkv=Hkv,
        H=H,
        Nq=Nq,
        Nk=Nk,
        D=D,
        Dv=Dv,
        gen=gen,
        mask=mask,
        atoms=atoms,
        sinks=sinks,
        layouts=layouts,
        grad_layout=grad_layout,
        backend=backend,
        return_lse=return_lse,
        grads=grads,
    )


# ----------------------------------------------------------------------------- helpers


def laid_out(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "expand_batch":
        return expanded(x, 0)
    if layout == "expand_heads":
        return expanded(x, 1)
    if layout == "expand_last":  # stride 0 in the head dimension itself
        return expanded(x, 3)
    return with_layout(x, layout)


def tolerance(dtype: torch.dtype, magnitude: float) -> dict:
    """tests/helpers.py's tolerance for the dtype, widened by the rounding of logits of
    this magnitude in that dtype."""
    base = TOL[dtype]["atol"]
    tol = max(base, 64 * EPS[dtype] * (1.0 + magnitude))
    return dict(atol=tol, rtol=tol)


def run_attnkit(backend: str, q, k, v, **kw):
    if backend in ("chunked_fused", "chunked_tiled"):
        with tiny_tiles(backend.split("_")[1]):
            return ak.attention(q, k, v, backend="chunked", **kw)
    with tiny_tiles():
        return ak.attention(q, k, v, backend=backend, **kw)


def describe(case) -> str:
    atoms = " >> ".join(a[0] + ("*" if any(p.requires_grad for p in atom_params(a)) else "") for a in case["atoms"]) or "-"
    mask = describe_mask(case["mask"]) if case["mask"] is not None else "-"
    return (
        f"{case['backend']} {case['dtype']} B={case['B']} H={case['H']}/{case['Hkv']} Nq={case['Nq']} Nk={case['Nk']} "
        f"D={case['D']} Dv={case['Dv']} mask={mask} score={atoms} sinks={case['sinks'] is not None} "
        f"layouts={case['layouts']} grad_layout={case['grad_layout']}"
    )


# ----------------------------------------------------------------------------- the property


@settings(max_examples=CASES, **PROPERTY_SETTINGS)
@given(cases())
def test_matches_the_literal_oracle(case):
    dtype, gen = case["dtype"], case["gen"]
    B, H, Hkv, Nq, Nk, D, Dv = (case[n] for n in ("B", "H", "Hkv", "Nq", "Nk", "D", "Dv"))
    leaves = [
        torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(case["grads"])
        for shape in ((B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, Dv))
    ]
    q, k, v = (laid_out(x, lay) for x, lay in zip(leaves, case["layouts"]))
    sinks = case["sinks"]
    if sinks is not None:
        sinks = sinks.clone().requires_grad_(case["grads"])
    atoms = case["atoms"]
    mask_obj = None if case["mask"] is None else to_attnkit_mask(case["mask"])
    score_obj = to_attnkit_score(atoms)
    kw = dict(mask=mask_obj, score=score_obj, sinks=sinks, return_lse=True)
    backend = case["backend"]
    if backend == "sdpa" and sdpa_unsupported(make_request(q, k, v, **kw)) is not None:
        backend = "auto"

    visible = None if case["mask"] is None else dense_mask(case["mask"], B, Nq, Nk).expand(B, H, Nq, Nk)
    want_out, want_lse = oracle(q, k, v, visible=visible, atoms=atoms, sinks=sinks)
    finite = torch.isfinite(want_lse)
    magnitude = float(want_lse.detach()[finite].abs().max()) if bool(finite.any()) else 0.0
    tol = tolerance(dtype, magnitude)
    where = describe(case)

    out, lse = run_attnkit(backend, q, k, v, **kw)
    assert out.dtype == dtype and out.shape == (B, H, Nq, Dv), where
    torch.testing.assert_close(out.detach().double(), want_out.detach(), **tol, msg=lambda m: f"out: {where}\n{m}")
    assert torch.equal(torch.isneginf(lse), ~finite), f"rows with no visible key: {where}"
    assert torch.equal(out.detach()[~finite], torch.zeros_like(out.detach()[~finite])), where
    torch.testing.assert_close(
        lse.detach().double()[finite], want_lse.detach()[finite], **tol, msg=lambda m: f"lse: {where}\n{m}"
    )

    if not case["grads"]:
        return
    wrt = leaves + ([sinks] if sinks is not None else []) + [p for a in atoms for p in atom_params(a) if p.requires_grad]
    g_out = laid_out(torch.randn(B, H, Nq, Dv, generator=gen, dtype=torch.float64).to(dtype), case["grad_layout"])
    g_lse = torch.randn(B, H, Nq, generator=gen, dtype=torch.float64).masked_fill(~finite, 0.0)
    lse_term = lambda l: (torch.where(finite, l, torch.zeros_like(l)).double() * g_lse).sum()
    got = torch.autograd.grad([out, lse_term(lse)], wrt, [g_out, None], allow_unused=True)
    want = torch.autograd.grad([want_out, lse_term(want_lse)], wrt, [g_out.double(), None], allow_unused=True)
    names = (
        ["q", "k", "v"]
        + (["sinks"] if sinks is not None else [])
        + [f"param{i}" for i in range(len(wrt) - 3 - (sinks is not None))]
    )
    for name, a, b, x in zip(names, got, want, wrt):
        a = torch.zeros_like(x) if a is None else a
        b = torch.zeros_like(x) if b is None else b
        scale = 1.0 + float(b.detach().abs().max()) if b.numel() else 1.0
        gtol = tolerance(dtype if dtype == torch.float64 else torch.float32, magnitude)
        gtol = dict(atol=gtol["atol"] * scale * (1 if dtype == torch.float64 else 8), rtol=gtol["rtol"] * 8)
        torch.testing.assert_close(a.double(), b.double(), **gtol, msg=lambda m: f"d{name}: {where}\n{m}")
