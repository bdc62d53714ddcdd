"""Talking-heads attention (arXiv 2003.02436) against the paper's listing."""

import mechanism_contract as mc
import pytest
import torch

import attnkit as ak
from attnkit.kernels import make_request, reference_attention
from attnkit.mechanisms.talking_heads import TalkingHeads
from helpers import assert_close, qkv


def mixed(pre=True, post=True, heads=4, seed=0):
    mech = TalkingHeads(heads, pre, post).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mech.parameters():
            p.add_(0.4 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return mech


@pytest.mark.parametrize("pre, post", [(True, True), (True, False), (False, True)])
def test_matches_reference(pre, post):
    mc.grid(mixed(pre, post), return_lse=not post) if not post else mc.grid(mixed(pre, post))


def test_small_tiles(monkeypatch):
    with mc.small_tiles(monkeypatch):
        for name in ("causal", "document"):
            mc.matches_reference(mixed(), dict(B=1, Hq=4, Hkv=2, Nq=15, Nk=29, D=8), mc.MASKS[name](29), ak.alibi(4))


def test_gradcheck(monkeypatch):
    with mc.small_tiles(monkeypatch):
        mc.gradchecks(mixed(heads=2), mask=ak.causal(), score=ak.softcap(2.0))


def test_contract():
    mc.low_precision(mixed().float(), mask=ak.causal())
    mc.dead_rows(mixed(heads=2))
    mc.observers(mixed(), mask=ak.causal() & ak.window(8))
    mc.empty_sequences(mixed(heads=2))
    mc.by_name("talking_heads", mixed())


def test_identity_matrices_are_softmax():
    q, k, v = qkv(B=1, Hq=4, Hkv=2, Nq=12, Nk=12, D=8)
    out = TalkingHeads(4).double()(q, k, v, mask=ak.causal())
    assert_close(out, reference_attention(make_request(q, k, v, mask=ak.causal()))[0])


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="num_heads"):
        TalkingHeads(0)
    with pytest.raises(ValueError, match="pre, post"):
        TalkingHeads(4, pre=False, post=False)
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=4, Nk=4, D=4)
    with pytest.raises(ValueError, match="no mixing matrices"):
        TalkingHeads()(q, k, v)
    with pytest.raises(ValueError, match="heads"):
        TalkingHeads(4)(q, k, v)
    with pytest.raises(ValueError, match="return_lse"):
        TalkingHeads(2)(q, k, v, return_lse=True)
