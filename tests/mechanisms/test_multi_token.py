"""Multi-token attention (arXiv 2504.00927) against the paper's code path: key-query
convolution with halo tiles, head mixing after the softmax."""

import mechanism_contract as mc
import pytest
import torch

import attnkit as ak
from attnkit.kernels import make_request, reference_attention
from attnkit.mechanisms.multi_token import MultiToken
from helpers import assert_close, qkv


def conv(cq=3, ck=5, ch=2, heads=4, seed=0):
    mech = MultiToken(heads, cq, ck, ch).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mech.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return mech


def test_matches_reference():
    mc.grid(conv(), masks={name: mc.MASKS[name] for name in ("none", "causal", "document")})
    mc.matches_reference(conv(ch=1), mc.SHAPES["bottom_right"], ak.causal(), ak.alibi(4), return_lse=True)


@pytest.mark.parametrize("cq, ck, ch, mask", [(3, 5, 2, "causal"), (4, 3, 4, "document"), (1, 1, 1, "window")])
def test_small_tiles_halos(monkeypatch, cq, ck, ch, mask):
    with mc.small_tiles(monkeypatch):
        mc.matches_reference(conv(cq, ck, ch), dict(B=1, Hq=4, Hkv=2, Nq=15, Nk=29, D=8), mc.MASKS[mask](29), ak.softcap(3.0))


def test_gradcheck(monkeypatch):
    with mc.small_tiles(monkeypatch):
        mc.gradchecks(conv(cq=2, ck=3, ch=2, heads=2), mask=ak.causal())


def test_contract():
    mc.low_precision(conv().float(), mask=ak.causal())
    mc.dead_rows(conv(heads=2))
    mc.observers(conv(), mask=ak.causal())
    mc.empty_sequences(conv(heads=2))
    mc.by_name("multi_token", conv())


def test_identity_kernels_are_softmax():
    q, k, v = qkv(B=1, Hq=4, Hkv=2, Nq=12, Nk=12, D=8)
    out = MultiToken(4).double()(q, k, v, mask=ak.causal())
    assert_close(out, reference_attention(make_request(q, k, v, mask=ak.causal()))[0])


def test_no_future_leaks_through_the_convolution():
    """Perturbing keys and values after position i must not change query i's output."""
    q, k, v = qkv(B=1, Hq=4, Hkv=4, Nq=20, Nk=20, D=8)
    mech = conv(cq=4, ck=7)
    out = mech(q, k, v, mask=ak.causal())
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 12:] += 3.0
    v2[:, :, 12:] -= 2.0
    assert_close(mech(q, k2, v2, mask=ak.causal())[:, :, :12], out[:, :, :12])


def test_rejects_bad_input():
    for kwargs in (dict(query_kernel=0), dict(key_kernel=4), dict(head_kernel=3)):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            MultiToken(4, **kwargs)
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=4, Nk=4, D=4)
    with pytest.raises(ValueError, match="no kernels"):
        MultiToken()(q, k, v)
    with pytest.raises(ValueError, match="heads"):
        MultiToken(4)(q, k, v)
    with pytest.raises(ValueError, match="return_lse"):
        MultiToken(2)(q, k, v, return_lse=True)


def test_decoding_carries_the_queries_the_convolution_looks_back_to():
    """Rows 9.. of a causal call equal a call of those queries alone against all keys when
    the cq - 1 queries before them come along as the state (and differ without it)."""
    mech = conv(cq=3, ck=5, ch=2)
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Nq=12, Nk=12, D=8)
    full = mech.reference(q, k, v, mask=ak.causal())
    _, state = mech(q[:, :, :9], k[:, :, :9], v[:, :, :9], mask=ak.causal(), return_state=True)
    assert torch.equal(state, q[:, :, 7:9])
    out, state = mech(q[:, :, 9:], k, v, mask=ak.causal(), initial_state=state, return_state=True)
    assert_close(out, full[:, :, 9:])
    assert torch.equal(state, q[:, :, 10:])
    assert (mech(q[:, :, 9:], k, v, mask=ak.causal()) - full[:, :, 9:]).abs().max() > 1e-6
    for bad in (q[:, :, :3], q[:, :2, :2], q[:, :, :2, :4]):
        with pytest.raises(ValueError, match="initial_state: expected the last m <= 2 queries"):
            mech(q[:, :, 9:], k, v, mask=ak.causal(), initial_state=bad)
