"""Signed (Cog) attention: sign(s) * softmax(|s|) against its literal formula."""

import mechanism_contract as mc
import pytest
import torch

import attnkit as ak
from attnkit.kernels import make_request, reference_attention
from attnkit.mechanisms.signed import Signed
from helpers import assert_close, qkv


def test_matches_reference():
    mc.grid(Signed())
    mc.matches_reference(Signed(), mc.SHAPES["bottom_right"], ak.causal(), return_lse=True)


def test_small_tiles(monkeypatch):
    with mc.small_tiles(monkeypatch):
        for name in ("none", "causal", "window", "document"):
            mc.matches_reference(
                Signed(), dict(B=2, Hq=4, Hkv=2, Nq=21, Nk=37, D=8), mc.MASKS[name](37), ak.softcap(3.0), return_lse=True
            )


def test_small_tiles_without_score_mod(monkeypatch):
    """No score mod: unmasked tiles take |s| in place."""
    with mc.small_tiles(monkeypatch):
        for shape in (mc.SHAPES["gqa"], mc.SHAPES["bottom_right"]):
            for name in ("none", "causal", "window", "document"):
                mc.matches_reference(Signed(), shape, mc.MASKS[name](shape["Nk"]), return_lse=True)


def test_gradcheck(monkeypatch):
    with mc.small_tiles(monkeypatch):
        mc.gradchecks(Signed(), mask=ak.causal())


def test_low_precision_dead_rows_observers_empty():
    mc.low_precision(Signed(), mask=ak.causal())
    mc.dead_rows(Signed())
    mc.observers(Signed(), mask=ak.document(torch.arange(26) // 5))
    mc.empty_sequences(Signed())


def test_by_name():
    mc.by_name("signed", Signed())


def test_positive_logits_are_plain_softmax():
    # all logits > 0: sign = 1 and |s| = s, so the mechanism is softmax attention
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=9, Nk=14, D=4)
    q, k = q.abs(), k.abs()
    out, lse = Signed()(q, k, v, mask=ak.causal(), return_lse=True)
    ref, ref_lse = reference_attention(make_request(q, k, v, mask=ak.causal()))
    assert_close(out, ref)
    assert_close(lse, ref_lse)


def test_negative_match_subtracts_its_value():
    # one key with logit -c: |w| sums to 1 and the strongly negative key's value is subtracted
    q = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    k = torch.tensor([[[[-20.0], [0.0]]]], dtype=torch.float64)
    v = torch.tensor([[[[1.0], [5.0]]]], dtype=torch.float64)
    out = Signed()(q, k, v, scale=1.0)
    assert_close(
        out,
        torch.tensor(
            [[[[-1.0 * (1 - torch.exp(torch.tensor(-20.0)).item() / (1 + torch.exp(torch.tensor(-20.0)).item()))]]]],
            dtype=torch.float64,
        ),
        dtype=torch.float32,
    )


def test_rejects_bad_input():
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=4, Nk=4, D=4)
    with pytest.raises(ValueError, match="backend"):
        Signed()(q, k, v, backend="flex")
