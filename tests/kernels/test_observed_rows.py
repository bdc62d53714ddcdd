"""An observed call of a few query rows that see every key (a decoding step) runs in one
C++ operator that gives the output, the logits, the weights and the log-normalisers
(kernels/dense_rows.observed_rows); its observers see them as one tile."""

import math

import pytest
import torch

import attnkit
from attnkit.kernels import dense_rows
from attnkit.kernels.cpu import kv as native_kv
from attnkit.observe import Observer
from helpers import TOL

pytestmark = pytest.mark.skipif(not native_kv.available(), reason="the C++ operators are not built")


def reference(q, k, v, scale):
    """(out, logits, weights, lse) of softmax attention in float64, GQA by repeating heads."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = q.double() @ kk.transpose(-1, -2) * scale
    w = s.softmax(-1)
    return w @ vv, s, w, torch.logsumexp(s, -1)


def inputs(B, Hq, Hkv, Nq, Nk, D, Dv, dtype, seed=0):
    """q, and keys and values as views into larger storage (a cache's rooms)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, Nk + 7, D, generator=g, dtype=dtype)[:, :, :Nk]
    v = torch.randn(B, Hkv, Nk + 7, Dv, generator=g, dtype=dtype)[:, :, :Nk]
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1, 45, 32, 24), (1, 4, 4, 3, 70, 16, 16), (1, 6, 1, 5, 9, 8, 12)])
def test_operator_equals_float64_attention(shape, dtype):
    q, k, v = inputs(*shape, dtype=dtype)
    out, s, w, lse, clean = native_kv.rows_attention(q, k, v, 0.3)
    assert clean
    for got, want in zip((out, s, w, lse), reference(q, k, v, 0.3)):
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, **TOL[dtype])


@pytest.mark.parametrize(
    "spoil",
    [
        lambda q, k, v: q[0, 1, 0].__setitem__(2, math.inf),
        lambda q, k, v: k[0, 0, 4].__setitem__(0, math.nan),
        lambda q, k, v: v[0, 1, 7].__setitem__(3, math.nan),
    ],
    ids=["inf-query", "nan-key", "nan-value"],
)
def test_operator_reports_a_non_finite_logit_or_output(spoil):
    q, k, v = inputs(1, 4, 2, 1, 12, 8, 8, torch.float32)
    spoil(q, k, v)
    assert not native_kv.rows_attention(q, k, v, 0.3)[4]


class Record(Observer):
    def __init__(self):
        self.tiles = []

    def update(self, tile):
        self.tiles.append(tile)


def count_operator_calls(monkeypatch) -> list:
    calls = []
    real = native_kv.rows_attention

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(native_kv, "rows_attention", spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "shape,mask",
    [((2, 8, 2, 1, 40, 16, 16), "causal"), ((1, 4, 4, 3, 30, 16, 8), None)],
    ids=["decoding-step", "rows-without-mask"],
)
def test_observed_call_takes_the_operator_and_shows_the_dense_weights(shape, mask, dtype, monkeypatch):
    q, k, v = inputs(*shape, dtype=dtype)
    calls = count_operator_calls(monkeypatch)
    record = Record()
    m = attnkit.causal() if mask else None
    out = attnkit.attention(q, k, v, mask=m, observers=[record], layer=2)
    assert len(calls) == 1
    want_out, s, w, lse = reference(q, k, v, q.shape[-1] ** -0.5)
    torch.testing.assert_close(out.double(), want_out, **TOL[dtype])
    torch.testing.assert_close(out, attnkit.attention(q, k, v, mask=m, backend="chunked"), **TOL[dtype])
    (tile,) = record.tiles
    assert tile.call.layer == 2 and tile.call.q_start == shape[4] - shape[3] and tile.all_visible
    assert tile.starts == (shape[4] - shape[3], 0, 0)
    assert torch.equal(tile.q_pos, torch.arange(shape[4] - shape[3], shape[4])) and torch.equal(
        tile.k_pos, torch.arange(shape[4])
    )
    for got, want in ((tile.weights, w), (tile.scores, s), (tile.log_norm, lse)):
        torch.testing.assert_close(got.double(), want, **TOL[dtype])


@pytest.mark.parametrize(
    "call",
    [
        dict(mask=attnkit.causal(), q_len=3),  # a causal call of several rows: not every key is visible
        dict(mask=None, return_lse=True),
        dict(mask=None, score=attnkit.softcap(5.0)),
    ],
    ids=["causal-rows", "lse-asked", "score-mod"],
)
def test_other_observed_calls_keep_their_path(call, monkeypatch):
    call = dict(call)
    q, k, v = inputs(1, 4, 2, call.pop("q_len", 1), 20, 8, 8, torch.float32)
    calls = count_operator_calls(monkeypatch)
    attnkit.attention(q, k, v, observers=[Record()], **call)
    assert not calls


def test_non_finite_input_raises_as_the_unobserved_call_does():
    q, k, v = inputs(1, 4, 2, 1, 12, 8, 8, torch.float32)
    q[0, 0, 0, 0] = math.nan
    with pytest.raises(ValueError) as unobserved:
        attnkit.attention(q, k, v, mask=attnkit.causal())
    record = Record()
    with pytest.raises(ValueError) as observed:
        attnkit.attention(q, k, v, mask=attnkit.causal(), observers=[record])
    assert str(observed.value) == str(unobserved.value)


def test_without_the_operators_the_dense_path_gives_the_same_tile(monkeypatch):
    q, k, v = inputs(1, 4, 2, 1, 25, 8, 8, torch.float64)
    fast, slow = Record(), Record()
    out = attnkit.attention(q, k, v, mask=attnkit.causal(), observers=[fast])
    monkeypatch.setattr(dense_rows.native_kv, "available", lambda: False)
    ref = attnkit.attention(q, k, v, mask=attnkit.causal(), observers=[slow])
    torch.testing.assert_close(out, ref, **TOL[torch.float64])
    torch.testing.assert_close(fast.tiles[0].weights, slow.tiles[0].weights, **TOL[torch.float64])
    torch.testing.assert_close(fast.tiles[0].scores, slow.tiles[0].scores, **TOL[torch.float64])
