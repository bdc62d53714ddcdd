"""A decoding step (at most SMALL_QUERIES queries) with any mask runs on torch SDPA with the
mask as an Nq x Nk boolean tensor, and equals the float64 reference: GQA, bottom-right
alignment, batch-dependent masks, rows that see no key, NaN in hidden keys."""

import math

import pytest
import torch

import attnkit as ak
from attnkit.kernels.few_queries import SMALL_QUERIES
from helpers import assert_close

MASKS = {
    "window": lambda nk: ak.causal() & ak.window(7),
    "two-sided window": lambda nk: ak.window(3, 2),
    "padding": lambda nk: ak.padding(torch.tensor([20, nk])),
    "document": lambda nk: ak.causal() & ak.document(torch.arange(nk) // 9),
    "per-row documents": lambda nk: ak.document(torch.stack([torch.arange(nk) // 9, torch.arange(nk) // 4])),
    "dilated": lambda nk: ak.dilated(4, 2, causal=True),
    "a callable": lambda nk: lambda b, h, q, k: (k % (h + 2)) == 0,
}


@pytest.mark.parametrize("nq", [1, 5, SMALL_QUERIES])
@pytest.mark.parametrize("name", list(MASKS))
def test_small_query_calls_run_on_sdpa_and_equal_the_reference(name, nq):
    g = torch.Generator().manual_seed(nq)
    q = torch.randn(2, 4, nq, 8, generator=g)
    k, v = (torch.randn(2, 2, 40, 8, generator=g) for _ in range(2))
    mask = MASKS[name](40)
    assert ak.explain(q, k, v, mask=mask).startswith("backend: sdpa")
    want = ak.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
    assert_close(ak.attention(q, k, v, mask=mask), want, torch.float32)


def test_rows_that_see_no_key_are_zero_and_hidden_nan_stays_out():
    q = torch.randn(2, 2, 3, 8)
    k, v = torch.randn(2, 2, 30, 8), torch.randn(2, 2, 30, 8)
    k[1, :, 25], v[1, :, 27] = math.nan, math.inf  # hidden by row 1's padding
    mask = ak.padding(torch.tensor([30, 20])) & ak.window(0, 0)  # queries at 27..29 see only themselves
    got = ak.attention(q, k, v, mask=mask)
    want = ak.attention(
        q.double(), k.nan_to_num(0, 0, 0).double(), v.nan_to_num(0, 0, 0).double(), mask=mask, backend="reference"
    )
    assert_close(got, want, torch.float32)
    assert bool((got[1] == 0).all())  # row 1 sees nothing: its keys 27..29 are padding


def test_more_queries_or_training_keep_the_tiled_path():
    q, k, v = torch.randn(1, 2, SMALL_QUERIES + 1, 8), torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    assert not ak.explain(q, k, v, mask=ak.window(3, 2)).startswith("backend: sdpa")
    assert not ak.explain(q[:, :, :1].requires_grad_(), k, v, mask=ak.window(3, 2)).startswith("backend: sdpa")


@pytest.mark.parametrize("mask", [None, ak.causal()])
def test_a_plain_decoding_step_still_names_a_nan_input(mask):
    """The plain step goes straight to SDPA; a NaN query or a NaN key it sees comes back as
    NaN or (torch's flash kernel) a zero row, and the full path then names the input."""
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 50, 8), torch.randn(1, 2, 50, 8)
    q_bad, k_bad = q.clone(), k.clone()
    q_bad[0, 3, 0, 5] = math.nan
    k_bad[0, 1, 7, 0] = math.nan
    with pytest.raises(ValueError, match=r"q: contains NaN or inf \(first at index \[0, 3, 0, 5\]\)"):
        ak.attention(q_bad, k, v, mask=mask)
    with pytest.raises(ValueError, match=r"k: contains NaN or inf \(first at index \[0, 1, 7, 0\]\)"):
        ak.attention(q, k_bad, v, mask=mask)
    out = ak.attention(q_bad, k, v, mask=mask, check_finite=False)
    assert torch.isfinite(out[0, :3]).all()
    assert_close(
        ak.attention(q, k, v, mask=mask),
        ak.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference"),
        torch.float32,
    )
