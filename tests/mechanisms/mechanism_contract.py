"""Checks every chunked mechanism must pass against its own literal reference.

- values and gradients (q, k, v, learned parameters, extra inputs) against ``reference``
  in float64, with GQA, Nq != Nk (bottom-right) and Nq = 1, masks and score mods;
- the same with tiles forced tiny (``small_tiles``), so that multi-block plans, carries
  across tiles and halos are exercised at sizes where the reference is cheap;
- ``torch.autograd.gradcheck`` of the fast path in float64;
- float32 / bfloat16 inputs against the float64 reference, within the dtype's tolerance;
- rows that see no key: zeros, finite gradients;
- observers: tiles cover every visible pair exactly once and their weights reproduce
  the output (out = W V), with weight 0 on hidden pairs;
- the mechanism by name through ``attnkit.attention``, and ``backend="reference"``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import attnkit as ak
from attnkit.kernels.engine import EngineTiling, TileKernel
from attnkit.observe import Observer
from helpers import assert_close, qkv

SHAPES = {
    "gqa": dict(B=2, Hq=4, Hkv=2, Nq=24, Nk=24, D=8),
    "bottom_right": dict(B=1, Hq=4, Hkv=1, Nq=11, Nk=29, D=8, Dv=6),
    "one_query": dict(B=2, Hq=4, Hkv=4, Nq=1, Nk=17, D=8),
}
MASKS = {
    "none": lambda nk: None,
    "causal": lambda nk: ak.causal(),
    "window": lambda nk: ak.causal() & ak.window(5),
    "document": lambda nk: ak.document(torch.arange(nk) // 7),
}
SCORES = {
    "none": lambda: None,
    "alibi": lambda: ak.alibi(4),
    "softcap": lambda: ak.softcap(3.0),
}
TINY = EngineTiling(q_block=4, k_block=4, tile_k=8, single_tile=0)


@contextlib.contextmanager
def small_tiles(monkeypatch, *extra):
    """Force 4 x 8 tiles on every engine kernel (and on ``extra`` (module, name) tilings)."""
    kernels = [TileKernel]
    while kernels:
        kind = kernels.pop()
        if "tiling" in vars(kind):
            monkeypatch.setattr(kind, "tiling", TINY)
        kernels += kind.__subclasses__()
    for module, name in extra:
        monkeypatch.setattr(module, name, TINY)
    yield


def _tensors(mech, extra: dict) -> list[torch.Tensor]:
    params = [p for p in mech.parameters() if p.requires_grad]
    return params + [t for t in extra.values() if isinstance(t, torch.Tensor) and t.requires_grad]


def matches_reference(mech, shape: dict, mask=None, score=None, seed=0, extra: dict | None = None, dtype=torch.float64, **call):
    """Fast path == reference, in value and in every gradient."""
    extra = extra or {}
    q, k, v = qkv(**shape, dtype=dtype, requires_grad=True, seed=seed)
    out = mech(q, k, v, mask=mask, score=score, **extra, **call)
    ref = mech.reference(q, k, v, mask=mask, score=score, **extra, **call)
    outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
    for a, b in zip(outs, refs):
        assert_close(a, b, msg=f"{mech.name} value {shape} mask={mask!r} score={score!r}")
    wanted = [q, k, v, *_tensors(mech, extra)]
    g = torch.randn_like(outs[0])
    got = torch.autograd.grad(outs[0], wanted, g, allow_unused=True)
    exp = torch.autograd.grad(refs[0], wanted, g, allow_unused=True)
    for i, (a, b) in enumerate(zip(got, exp)):
        if b is None:
            assert a is None or not a.abs().any()
            continue
        assert a is not None, f"{mech.name}: no gradient for input {i}"
        assert_close(a, b, dtype=dtype, msg=f"{mech.name} grad {i} {shape} mask={mask!r} score={score!r}")


def grid(mech, masks=MASKS, scores=SCORES, shapes=SHAPES, extra_fn=None, **call):
    """Every shape with every mask; score mods taken in turn, so each meets several of both."""
    score_list = list(scores.values())
    for i, (shape, mask) in enumerate((s, m) for s in shapes.values() for m in masks.values()):
        extra = extra_fn(shape) if extra_fn else None
        matches_reference(mech, shape, mask(shape["Nk"]), score_list[i % len(score_list)](), extra=extra, **call)


def gradchecks(mech, shape=None, mask=None, extra: dict | None = None, **call):
    shape = shape or dict(B=1, Hq=2, Hkv=1, Nq=5, Nk=7, D=3, Dv=2)
    q, k, v = qkv(**shape, dtype=torch.float64, requires_grad=True, seed=3)
    extra = extra or {}
    inputs = [q, k, v, *[t for t in extra.values() if isinstance(t, torch.Tensor) and t.requires_grad]]

    def fn(*xs):
        kw = dict(extra)
        names = [n for n, t in extra.items() if isinstance(t, torch.Tensor) and t.requires_grad]
        kw.update(zip(names, xs[3:]))
        out = mech(xs[0], xs[1], xs[2], mask=mask, **kw, **call)
        return out[0] if isinstance(out, tuple) else out

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, fast_mode=True)


def low_precision(mech, mask=None, extra: dict | None = None, dtypes=(torch.float32, torch.bfloat16)):
    """The fast path on float32 / bfloat16 inputs against the float64 reference."""
    shape = dict(B=1, Hq=4, Hkv=2, Nq=20, Nk=20, D=8)
    q, k, v = qkv(**shape, dtype=torch.float64)
    ref = mech.reference(q, k, v, mask=mask, **(extra or {}))
    for dtype in dtypes:
        low = {n: (t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in (extra or {}).items()}
        with torch.no_grad():
            out = mech(q.to(dtype), k.to(dtype), v.to(dtype), mask=mask, **low)
        assert out.dtype == dtype
        # bfloat16 / float16 inputs: the inputs themselves are rounded, so compare with the
        # reference on the rounded inputs, within one output ulp (TOL).
        ref_low = mech.reference(q.to(dtype).double(), k.to(dtype).double(), v.to(dtype).double(), mask=mask, **(extra or {}))
        assert_close(out, ref_low if dtype != torch.float32 else ref, dtype=dtype, msg=f"{mech.name} {dtype}")


def hides_rows(b, h, q_idx, kv_idx):
    """Every third query sees no key at all; the others see the causal past."""
    return (q_idx % 3 != 0) & (kv_idx <= q_idx)


def dead_rows(mech, extra: dict | None = None, **call):
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=12, Nk=12, D=4, dtype=torch.float64, requires_grad=True)
    out = mech(q, k, v, mask=hides_rows, **(extra or {}), **call)
    out = out[0] if isinstance(out, tuple) else out
    dead = torch.arange(12) % 3 == 0
    assert torch.equal(out[:, :, dead], torch.zeros_like(out[:, :, dead]))
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert not q.grad[:, :, dead].abs().gt(1e-30).any()


class Collect(Observer):
    """Dense weights and a coverage count rebuilt from the tiles (small sizes only)."""

    def begin(self, call):
        self.call = call
        self.w = torch.zeros(call.batch, call.heads, call.q_len, call.k_len, dtype=torch.float64)
        self.count = torch.zeros_like(self.w)

    def update(self, tile):
        rows = tile.q_pos - self.call.q_start
        idx = (
            tile.batch.view(-1, 1, 1, 1),
            tile.head_index.view(1, -1, 1, 1),
            rows.view(1, 1, -1, 1),
            tile.k_pos.view(1, 1, 1, -1),
        )
        self.w.index_put_(idx, tile.weights.double(), accumulate=True)
        self.count.index_put_(idx, torch.ones_like(tile.weights, dtype=torch.float64), accumulate=True)


def observers(mech, mask=None, extra: dict | None = None, name: str | None = None, visible_mask=None, **call):
    """Tiles cover every pair at most once, every visible pair exactly once (``visible_mask``:
    the pairs the mechanism itself can see, if narrower than ``mask``), and W V = out."""
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Nq=19, Nk=26, D=8, dtype=torch.float64)
    meter = Collect()
    out = mech(q, k, v, mask=mask, observers=[meter], layer=3, **(extra or {}), **call)
    out = out[0] if isinstance(out, tuple) else out
    assert meter.call.layer == 3 and meter.call.mechanism == (name or mech.name)
    assert meter.count.max() <= 1
    visible_mask = mask if visible_mask is None else visible_mask
    if visible_mask is not None:
        visible = ak.kernels.make_request(q, k, v, mask=visible_mask).mask.dense(2, 4, 19, 26).expand(2, 4, 19, 26)
        assert torch.equal(meter.count.bool() | ~visible, torch.ones_like(visible))
        assert not meter.w[~visible].any()
    values = v.repeat_interleave(2, dim=1)
    assert_close(torch.matmul(meter.w, values), out, msg=f"{mech.name}: observed weights do not reproduce the output")


def by_name(name: str, mech, sinks_allowed: bool = False, **call):
    """``attnkit.attention(mechanism=...)`` runs the mechanism; backend="reference" runs its reference."""
    q, k, v = qkv(B=1, Hq=4, Hkv=2, Nq=10, Nk=10, D=8, dtype=torch.float64)
    direct = mech(q, k, v, mask=ak.causal(), **call)
    via_api = ak.attention(q, k, v, mask=ak.causal(), mechanism=mech)
    assert_close(via_api, direct)
    assert_close(mech(q, k, v, mask=ak.causal(), backend="reference", **call), mech.reference(q, k, v, mask=ak.causal(), **call))
    with pytest.raises(ValueError, match="backend"):
        mech(q, k, v, backend="sdpa")
    if not sinks_allowed:
        with pytest.raises(ValueError, match="sinks"):
            mech(q, k, v, sinks=torch.zeros(4, dtype=torch.float64))
    assert name in ak.mechanisms.available()


def empty_sequences(mech, extra_fn=None, **call):
    for nq, nk in ((0, 5), (3, 0)):
        q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=nq, Nk=nk, D=4, dtype=torch.float64, requires_grad=True)
        extra = extra_fn(nk) if extra_fn else {}
        out = mech(q, k, v, **extra, **call)
        out = out[0] if isinstance(out, tuple) else out
        assert out.shape == (1, 2, nq, 4) and not out.abs().any()
        out.sum().backward()
