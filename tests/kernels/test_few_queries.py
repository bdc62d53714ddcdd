"""The dense few-query path (decoding steps) of non-softmax mechanisms: sigmoid attention
with GQA, masks, score mods and bottom-right alignment equals its literal reference."""

import math

import pytest
import torch

import attnkit as ak
from attnkit.kernels.few_queries import SMALL_QUERIES
from attnkit.mechanisms import get_mechanism
from helpers import assert_close, qkv

MASKS = {
    "none": None,
    "causal window": ak.causal() & ak.window(6),
    "padding": ak.padding(torch.tensor([29, 17])),
    "document": ak.causal() & ak.document(torch.arange(29) // 7),
}


@pytest.mark.parametrize("nq", [1, 5, SMALL_QUERIES])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sigmoid_decoding_steps_equal_the_reference(mask, nq, dtype):
    sigmoid = get_mechanism("sigmoid")
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Nq=nq, Nk=29, D=8, Dv=6, dtype=dtype, seed=nq)
    for score in (None, ak.alibi(4)):
        got = sigmoid(q, k, v, mask=MASKS[mask], score=score)
        want = sigmoid.reference(q.double(), k.double(), v.double(), mask=MASKS[mask], score=score)
        assert_close(got, want, dtype)


def test_a_nan_in_a_hidden_value_stays_out_of_a_sigmoid_step():
    sigmoid = get_mechanism("sigmoid")
    q, k, v = qkv(B=2, Hq=2, Hkv=2, Nq=1, Nk=20, D=8)
    v_bad = v.clone()
    v_bad[1, :, 15] = math.nan  # row 1 is padded from 12 on
    mask = ak.padding(torch.tensor([20, 12]))
    assert_close(sigmoid(q, k, v_bad, mask=mask), sigmoid.reference(q, k, v, mask=mask), torch.float64)
