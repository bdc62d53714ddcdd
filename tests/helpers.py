"""Shared test helpers: random inputs and tolerances justified by dtype."""

from __future__ import annotations

import torch

# Tolerances against a float64 reference, by input dtype. float64: a few hundred ulps of
# accumulated rounding in sums over <= 10^3 terms. float32: unit roundoff 6e-8 times the
# same growth. bfloat16 / float16: inputs and the output are rounded to 8 / 11 mantissa
# bits, so one output ulp (2^-8, 2^-11 relative) dominates, on outputs of magnitude ~1.
TOL = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
}


def qkv(B=2, Hq=4, Hkv=2, Nq=64, Nk=64, D=16, Dv=None, dtype=torch.float64, requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    q = torch.randn(B, Hq, Nq, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, Hkv, Nk, Dv, generator=g, dtype=torch.float64).to(dtype)
    if requires_grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v


def assert_close(actual, expected, dtype=None, msg=""):
    dtype = dtype or actual.dtype
    torch.testing.assert_close(actual.to(torch.float64), expected.to(torch.float64), **TOL[dtype], msg=msg or None)
