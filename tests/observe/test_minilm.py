"""Every meter inside the real all-MiniLM-L6-v2, against the dense attention of the same
model run by transformers' eager formula in float64.

The model runs in float32 under attnkit; each layer's inputs then differ from the
reference's by float32 rounding carried through the earlier layers, so the comparison
is at the float32 tolerance (relative to logits up to ~100)."""

import pytest
import torch
from dense_meters import record_dense
from test_meters_dense import all_meters, check_all

import attnkit.hf as akhf
from attnkit.inspection import sample_text
from helpers import TOL


@pytest.fixture(scope="module")
def minilm():
    return akhf.load_default_model()


def test_meters_match_dense_attention_of_minilm(minilm):
    model, tok = minilm
    enc = tok(sample_text(), return_tensors="pt")
    meters = all_meters()
    with torch.no_grad(), akhf.use(model, observers=meters):
        model(**enc)
    got = {(layer, h, m): v for meter in meters for layer, h, m, v in meter.rows()}
    dense = record_dense(model, **enc)
    assert sorted(dense) == list(range(6)) and {layer for layer, _, _ in got} == set(range(6))
    n = enc["input_ids"].shape[1]
    for layer, (p, vis, s) in dense.items():
        check_all(got, layer, TOL[torch.float32], p, vis, s, torch.arange(n))
