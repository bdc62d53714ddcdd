"""Property tests: what NaN and inf in the inputs may and may not do, on every backend.

- Keys and values that the mask hides from every query (padding, here composed with
  causal / window / document masks) never influence the output or the gradients, whatever
  they hold: NaN, +inf, -inf, or values so large that q . k overflows. The output equals
  the literal float64 oracle run with zeros in their place; check_finite does not raise;
  gradients are finite and zero at the hidden positions. (``CASES_PADDING`` cases.)
- A NaN/inf query row that sees at least one key raises the documented ValueError naming
  q, at every size (torch's flash kernel returns zeros for such a row below ~16 rows);
  one that sees no key is harmless and returns zeros. A NaN in a key or value some query
  sees raises naming it. (``CASES_REPORTED`` cases.)
- Backends: reference, chunked (fused and tiled engines, tiny tiles), auto, sdpa where
  the call reduces to it; flex once (compiling it costs ~20 s), float32 inference.

Derandomized, no example database: the same cases every run.
"""

from __future__ import annotations

import math
import os
import re

import pytest
import torch
from attention_oracle import dense_mask, oracle, to_attnkit_mask
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_tiles import tiny_tiles

import attnkit as ak

SCALE = float(os.environ.get("ATTNKIT_PROPERTY_SCALE", "1"))  # see test_attention_properties.py
CASES_PADDING = int(200 * SCALE)
CASES_REPORTED = int(150 * SCALE)
PROPERTY_SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
BACKENDS = ["reference", "chunked_fused", "chunked_tiled", "auto"]
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def run(backend: str, q, k, v, **kw):
    if backend.startswith("chunked_"):
        with tiny_tiles(backend.split("_")[1]):
            return ak.attention(q, k, v, backend="chunked", **kw)
    with tiny_tiles():
        return ak.attention(q, k, v, backend=backend, **kw)


def poison(dtype: torch.dtype, kind: str) -> float:
    return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "huge": torch.finfo(dtype).max / 4}[kind]


@st.composite
def padded_calls(draw):
    dtype = draw(st.sampled_from([torch.float64, torch.float32]))
    B, Hkv, G = 2, draw(st.integers(1, 2)), draw(st.integers(1, 2))
    Nk = draw(st.integers(2, 40))
    Nq = draw(st.sampled_from([Nk, 1, draw(st.integers(1, Nk))]))
    lengths = [draw(st.integers(0, Nk - 1)), draw(st.integers(0, Nk))]
    other = draw(st.sampled_from([None, ("causal",), ("window", 4, 0), ("window", 3, 5), "document"]))
    if other == "document":
        other = ("document", torch.arange(Nk) // draw(st.integers(2, 9)))
    spec = ("padding", torch.tensor(lengths)) if other is None else ("and", other, ("padding", torch.tensor(lengths)))
    in_k = draw(st.sampled_from(["nan", "inf", "-inf", "huge", None]))
    in_v = draw(st.sampled_from(["nan", "inf", "-inf", "huge", None]))
    backend = draw(st.sampled_from(BACKENDS))
    sinks = draw(st.booleans())
    return dtype, B, Hkv, G, Nq, Nk, spec, in_k, in_v, backend, sinks, draw(st.integers(0, 2**20))


@settings(max_examples=CASES_PADDING, **PROPERTY_SETTINGS)
@given(padded_calls())
def test_hidden_keys_and_values_never_reach_the_output(call):
    dtype, B, Hkv, G, Nq, Nk, spec, in_k, in_v, backend, with_sinks, seed = call
    gen = torch.Generator().manual_seed(seed)
    H, D = Hkv * G, 8
    q, k, v = (
        torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        for shape in ((B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D))
    )
    visible = dense_mask(spec, B, Nq, Nk).expand(B, H, Nq, Nk)
    # keys no query of their batch row sees
    hidden = ~visible.any(dim=2).any(dim=1)  # (B, Nk)
    hidden_kv = hidden.view(B, 1, Nk, 1)
    k_bad, v_bad = k.clone(), v.clone()
    if in_k is not None:
        k_bad = k_bad.masked_fill(hidden_kv, poison(dtype, in_k))
    if in_v is not None:
        v_bad = v_bad.masked_fill(hidden_kv, poison(dtype, in_v))
    sinks = torch.randn(H, generator=gen, dtype=torch.float64).requires_grad_() if with_sinks else None
    leaves = [t.requires_grad_() for t in (q, k_bad, v_bad)]
    out, lse = run(backend, *leaves, mask=to_attnkit_mask(spec), sinks=sinks, return_lse=True)

    clean_k, clean_v = k.masked_fill(hidden_kv, 0.0), v.masked_fill(hidden_kv, 0.0)
    want, want_lse = oracle(q.detach(), clean_k, clean_v, visible=visible, sinks=None if sinks is None else sinks.detach())
    where = f"{backend} {dtype} Nq={Nq} Nk={Nk} mask={spec[0]} k={in_k} v={in_v} sinks={with_sinks}"
    tol = TOL[dtype]
    torch.testing.assert_close(out.detach().double(), want, atol=tol, rtol=tol, msg=lambda m: f"{where}\n{m}")
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite), where
    torch.testing.assert_close(lse.detach().double()[finite], want_lse[finite], atol=tol, rtol=tol)

    grads = torch.autograd.grad(out.sum(), leaves)
    for name, g in zip("qkv", grads):
        assert torch.isfinite(g).all(), f"d{name} not finite: {where}"
    for name, g in zip("kv", grads[1:]):
        assert not g.masked_select(hidden_kv).any(), f"d{name} nonzero at hidden keys: {where}"


@st.composite
def reported_calls(draw):
    Nk = draw(st.integers(1, 40))
    Nq = draw(st.sampled_from([Nk, 1, draw(st.integers(1, Nk))]))
    mask = draw(st.sampled_from([None, "causal", "first_rows_blind"]))
    backend = draw(st.sampled_from(BACKENDS + ["sdpa"]))
    where = draw(st.sampled_from(["q", "k", "v"]))
    # an infinite key component gives logits of +-inf: -inf merely hides the key, so only
    # NaN surely reaches the rows that see it
    value = draw(st.sampled_from([math.nan] if where == "k" else [math.nan, math.inf, -math.inf]))
    row = draw(st.integers(0, (Nq if where == "q" else Nk) - 1))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    return Nq, Nk, mask, backend, where, value, row, dtype, draw(st.integers(0, 2**20))


@settings(max_examples=CASES_REPORTED, **PROPERTY_SETTINGS)
@given(reported_calls())
def test_nonfinite_that_reaches_a_row_is_reported_at_every_size(call):
    Nq, Nk, mask_kind, backend, where, value, row, dtype, seed = call
    gen = torch.Generator().manual_seed(seed)
    B, H, D = 1, 2, 8
    q, k, v = (
        torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        for shape in ((B, H, Nq, D), (B, H, Nk, D), (B, H, Nk, D))
    )
    if mask_kind is None:
        mask, spec = None, None
    elif mask_kind == "causal":
        mask, spec = ak.causal(), ("causal",)
    else:  # the first query rows see nothing: a NaN query there is harmless
        blind = Nk - Nq + Nq // 2
        spec = None
        mask = lambda b, h, qi, ki: qi >= blind  # noqa: E731
    if backend == "sdpa" and not (mask is None or (mask_kind == "causal" and Nq in (1, Nk))):
        backend = "auto"
    target = {"q": q, "k": k, "v": v}[where]
    target[0, 1, row, 3] = value
    if mask_kind == "first_rows_blind":
        visible = (torch.arange(Nk - Nq, Nk) >= blind).view(1, 1, Nq, 1).expand(B, H, Nq, Nk)
    elif spec is not None:
        visible = dense_mask(spec, B, Nq, Nk).expand(B, H, Nq, Nk)
    else:
        visible = torch.ones(B, H, Nq, Nk, dtype=torch.bool)
    if where == "q":
        reaches = bool(visible[0, 1, row].any())
    else:
        reaches = bool(visible[0, 1, :, row].any())
    if reaches:
        with pytest.raises(ValueError, match=re.escape(f"{where}: contains NaN or inf")):
            run(backend, q, k, v, mask=mask)
        raw = run(backend, q, k, v, mask=mask, check_finite=False)
        assert raw.shape == (B, H, Nq, D)
    else:
        out = run(backend, q, k, v, mask=mask)
        want, _ = oracle(q, k.nan_to_num(0.0, 0.0, 0.0), v.nan_to_num(0.0, 0.0, 0.0), visible=visible)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.slow
def test_flex_keeps_hidden_nonfinite_out_and_reports_a_nan_query():
    pytest.importorskip("torch.nn.attention.flex_attention")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 40, 8, generator=gen) for _ in range(3))
    mask_spec = ("padding", torch.tensor([40, 29]))
    mask = to_attnkit_mask(mask_spec)
    want, _ = oracle(q, k, v, visible=dense_mask(mask_spec, 2, 40, 40).expand(2, 2, 40, 40))
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[1, :, 33] = math.nan
    v_bad[1, :, 30] = math.inf
    v_bad[1, :, 35] = math.nan
    got = ak.attention(q, k_bad, v_bad, mask=mask, backend="flex")
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    q_bad = q.clone()
    q_bad[0, 1, 4, 2] = math.nan
    with pytest.raises(ValueError, match=re.escape("q: contains NaN or inf")):
        ak.attention(q_bad, k, v, mask=mask, backend="flex")
