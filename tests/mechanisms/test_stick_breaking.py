"""Stick-breaking attention (arXiv 2410.17980) against its log-space literal formula."""

import mechanism_contract as mc
import pytest
import torch

import attnkit as ak
from attnkit.mechanisms.stick_breaking import StickBreaking, StrictlyCausal
from helpers import assert_close, qkv

MASKS = {"none": lambda nk: None, "window": mc.MASKS["window"], "document": mc.MASKS["document"]}


@pytest.mark.parametrize("attend_current", [False, True])
def test_matches_reference(attend_current):
    mc.grid(StickBreaking(attend_current), masks=MASKS)


def test_small_tiles(monkeypatch):
    with mc.small_tiles(monkeypatch):
        for name in MASKS:
            mc.matches_reference(StickBreaking(), dict(B=2, Hq=4, Hkv=2, Nq=21, Nk=37, D=8), MASKS[name](37), ak.alibi(4))


def test_gradcheck(monkeypatch):
    with mc.small_tiles(monkeypatch):
        mc.gradchecks(StickBreaking(), score=ak.softcap(2.0))


def test_low_precision_dead_rows_observers_empty():
    mc.low_precision(StickBreaking())
    mc.dead_rows(StickBreaking(attend_current=True))
    mc.observers(StickBreaking(), mask=ak.window(7), visible_mask=ak.window(7) & StrictlyCausal())
    mc.empty_sequences(StickBreaking())


def test_by_name():
    mc.by_name("stick_breaking", StickBreaking())


def test_sticks_break_from_the_nearest_key():
    """Direct product form, written independently: A_ij = b_ij * prod_{j<k<i} (1 - b_ik);
    every row's weights sum to at most 1."""
    q, k, v = qkv(B=1, Hq=1, Hkv=1, Nq=7, Nk=7, D=4)
    beta = torch.sigmoid(torch.matmul(q, k.transpose(-1, -2)) / 2.0)[0, 0]
    a = torch.zeros(7, 7, dtype=torch.float64)
    for i in range(7):
        left = 1.0
        for j in range(i - 1, -1, -1):
            a[i, j] = beta[i, j] * left
            left = left * (1 - beta[i, j])
    assert_close(StickBreaking()(q, k, v), torch.matmul(a, v[0, 0])[None, None])
    assert (a.sum(-1) <= 1 + 1e-12).all()


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="attend_current"):
        StickBreaking(attend_current=1)
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=4, Nk=4, D=4)
    with pytest.raises(ValueError, match="return_lse"):
        StickBreaking()(q, k, v, return_lse=True)
