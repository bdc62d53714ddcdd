"""The float64 contract over every registered mechanism, found through
``attnkit.mechanisms.available()`` (a new mechanism is held to it without a line here):
the fast path equals the mechanism's own literal ``reference`` in value and in every
gradient (q, k, v and learned parameters), with GQA, Nq != Nk and Nq = 1, without and
with a causal mask; and ``backend="reference"`` runs the reference.

The per-family test files go further (masks, score mods, tiny tiles, gradcheck, dtypes,
observers). A mechanism leaves this check only through ``OPT_OUT``, which says why."""

import decoding_contract as dc
import pytest
import torch
from mechanism_contract import SHAPES, matches_reference

import attnkit as ak
from attnkit.mechanisms import available, build_mechanism
from helpers import assert_close, qkv

#: name -> why the check above does not apply (each is held to its own reference elsewhere)
OPT_OUT: dict[str, str] = {}

MASKS = {"none": None, "causal": ak.causal()}

#: name -> why it needs a causal mask (without one it must refuse the call, naming mask)
CAUSAL_ONLY: dict[str, str] = {
    "block_sparse": "MInference's patterns are estimated for causal prefill (arXiv 2407.02490)",
    "nsa": "NSA's compressed and selected branches are defined for causal attention (arXiv 2502.11089)",
}


def mechanism(name: str, shape: dict):
    mech = build_mechanism(
        name, dict(dc.PARAMS.get(name, {})), shape["Hq"], shape["D"], shape["Hkv"], shape.get("Dv", shape["D"]), dc.CONTEXT
    ).double()
    dc.perturb(mech)  # parts that start as the identity take part
    return mech


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("name", [n for n in available() if n not in OPT_OUT])
def test_fast_path_equals_reference_in_float64(name, mask, shape):
    mech = mechanism(name, SHAPES[shape])
    if name in CAUSAL_ONLY and MASKS[mask] is None:
        q, k, v = qkv(**SHAPES[shape], dtype=torch.float64)
        with pytest.raises(ValueError, match="^mask: "):
            mech(q, k, v)
        return
    matches_reference(mech, SHAPES[shape], mask=MASKS[mask])


@pytest.mark.parametrize("name", [n for n in available() if n not in OPT_OUT])
def test_reference_backend_runs_the_reference(name):
    shape = SHAPES["gqa"]
    mech = mechanism(name, shape)
    q, k, v = qkv(**shape, dtype=torch.float64)
    with torch.no_grad():
        assert_close(mech(q, k, v, mask=ak.causal(), backend="reference"), mech.reference(q, k, v, mask=ak.causal()))


def test_opt_outs_name_registered_mechanisms_and_say_why():
    for table in (OPT_OUT, CAUSAL_ONLY):
        assert set(table) <= set(available())
        assert all(isinstance(why, str) and len(why) > 20 for why in table.values())
