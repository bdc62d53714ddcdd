"""Masks against literal per-pair definitions, and tile classification against dense evaluation."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit as ak
from attnkit.mods import EMPTY, FULL, TileGrid


def dense(mask, Nq, Nk, B=1, H=1):
    return mask.dense(B, H, Nq, Nk).expand(B, H, Nq, Nk)


def literal(pred, Nq, Nk, B=1, H=1):
    """Evaluate a plain-Python predicate pred(b, h, qpos, kpos) on every pair."""
    out = torch.zeros(B, H, Nq, Nk, dtype=torch.bool)
    for b, h, i, j in itertools.product(range(B), range(H), range(Nq), range(Nk)):
        out[b, h, i, j] = bool(pred(b, h, Nk - Nq + i, j))
    return out


def natten_window(i, length, kernel, dilation, causal):
    """NATTEN's 1-D neighbourhood of index i, by explicit enumeration of its sub-grid."""
    group = [p for p in range(length) if p % dilation == i % dilation]
    idx = group.index(i)
    if causal:
        return set(group[max(0, idx - kernel + 1) : idx + 1])
    start = min(max(idx - kernel // 2, 0), len(group) - kernel)
    return set(group[start : start + kernel])


CASES = [
    ("causal", ak.causal(), lambda b, h, i, j: j <= i),
    ("window(3)", ak.window(3), lambda b, h, i, j: i - 3 <= j <= i),
    ("window(2,4)", ak.window(2, 4), lambda b, h, i, j: i - 2 <= j <= i + 4),
    ("window(None,0)", ak.window(None, 0), lambda b, h, i, j: j <= i),
    ("prefix_lm(5)", ak.prefix_lm(5), lambda b, h, i, j: j < 5 or j <= i),
    ("dilated", ak.dilated(6, 2), lambda b, h, i, j: abs(i - j) <= 6 and (i - j) % 2 == 0),
    ("dilated causal", ak.dilated(6, 3, causal=True), lambda b, h, i, j: 0 <= i - j <= 6 and (i - j) % 3 == 0),
    ("~causal", ~ak.causal(), lambda b, h, i, j: j > i),
    ("causal|window", ak.window(0, 2) | ak.causal(), lambda b, h, i, j: j <= i + 2),
]


@pytest.mark.parametrize("name,mask,pred", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("Nq,Nk", [(12, 12), (5, 12)])
def test_structured_masks_match_literal_definition(name, mask, pred, Nq, Nk):
    assert torch.equal(dense(mask, Nq, Nk), literal(pred, Nq, Nk))


def test_document_per_row_and_per_batch():
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
    got = dense(ak.document(ids), 10, 10)
    assert torch.equal(got, literal(lambda b, h, i, j: int(ids[i]) == int(ids[j]), 10, 10))
    ids2 = torch.stack([ids, torch.arange(10) // 5])
    got = dense(ak.document(ids2), 10, 10, B=2)
    assert torch.equal(got, literal(lambda b, h, i, j: int(ids2[b, i]) == int(ids2[b, j]), 10, 10, B=2))


def test_padding_and_per_batch_prefix():
    got = dense(ak.padding([3, 7]), 7, 7, B=2)
    assert torch.equal(got, literal(lambda b, h, i, j: j < [3, 7][b], 7, 7, B=2))
    got = dense(ak.prefix_lm(torch.tensor([2, 5])), 7, 7, B=2)
    assert torch.equal(got, literal(lambda b, h, i, j: j < [2, 5][b] or j <= i, 7, 7, B=2))


@pytest.mark.parametrize(
    "kernel,dilation,causal", [(3, 1, False), (4, 1, False), (5, 2, False), (3, 3, False), (4, 2, True), (1, 1, False)]
)
def test_neighborhood_1d_is_natten(kernel, dilation, causal):
    n = 13
    got = dense(ak.neighborhood_1d(kernel, dilation, causal), n, n)
    want = literal(lambda b, h, i, j: j in natten_window(i, n, kernel, dilation, causal), n, n)
    assert torch.equal(got, want)
    if not causal:  # NATTEN's defining property: every query sees exactly `kernel` keys
        assert (got.sum(-1) == kernel).all()


def test_neighborhood_2d_and_3d_are_products_of_axes():
    grid, kernel, dilation = (5, 11), (3, 5), (1, 2)
    got = dense(ak.neighborhood_2d(grid, kernel, dilation), 55, 55)

    def pred(b, h, i, j):
        (ri, ci), (rj, cj) = divmod(i, 11), divmod(j, 11)
        return rj in natten_window(ri, 5, 3, 1, False) and cj in natten_window(ci, 11, 5, 2, False)

    assert torch.equal(got, literal(pred, 55, 55))
    grid3 = (3, 4, 5)
    got3 = dense(ak.neighborhood_3d(grid3, 3, causal=(True, False, False)), 60, 60)

    def pred3(b, h, i, j):
        a = (i // 20, (i // 5) % 4, i % 5)
        c = (j // 20, (j // 5) % 4, j % 5)
        return (
            c[0] in natten_window(a[0], 3, 3, 1, True)
            and c[1] in natten_window(a[1], 4, 3, 1, False)
            and c[2] in natten_window(a[2], 5, 3, 1, False)
        )

    assert torch.equal(got3, literal(pred3, 60, 60))


def test_user_callable_mask_and_head_dependence():
    mask = ak.causal() & (lambda b, h, q, k: (q - k) % (h + 2) == 0)
    got = dense(mask, 9, 9, H=3)
    assert torch.equal(got, literal(lambda b, h, i, j: j <= i and (i - j) % (h + 2) == 0, 9, 9, H=3))
    assert "causal()" in repr(mask) and "<lambda>" in repr(mask)


def test_reprs_are_readable():
    assert repr(ak.window(256)) == "window(left=256, right=0)"
    assert repr(ak.causal() & ak.window(8)) == "causal() & window(left=8, right=0)"
    assert repr(~(ak.causal() | ak.prefix_lm(4))) == "~(causal() | prefix_lm(4))"
    assert "neighborhood_2d(grid=(8, 8), kernel=3" in repr(ak.neighborhood_2d((8, 8), 3))
    assert repr(ak.document(torch.tensor([0, 0, 1]))) == "document(2 ids over 3 positions)"


# ------------------------------------------------------------ tile classification


def _check_classification(mask, B, Nq, Nk, qb, kb, H=1):
    grid = TileGrid(q_start=Nk - Nq, q_len=Nq, q_block=qb, k_len=Nk, k_block=kb)
    states = mask.classify(grid)
    vis = dense(mask, Nq, Nk, B=B, H=H).any(dim=1)  # (B, Nq, Nk)
    assert states.shape[1:] == (grid.n_q, grid.n_k) and states.shape[0] in (1, B)
    for b, i, j in itertools.product(range(B), range(grid.n_q), range(grid.n_k)):
        tile = vis[b, i * qb : (i + 1) * qb, j * kb : (j + 1) * kb]
        state = int(states[min(b, states.shape[0] - 1), i, j])
        if state == FULL:
            assert tile.all(), (mask, b, i, j)
        if state == EMPTY:
            assert not tile.any(), (mask, b, i, j)


MASKS = st.sampled_from(
    [
        ak.causal(),
        ak.window(5),
        ak.window(3, 7),
        ak.prefix_lm(9),
        ak.dilated(8, 2),
        ak.dilated(9, 1),
        ak.causal() & ak.window(6),
        ~ak.window(4),
        ak.window(2) | ak.prefix_lm(3),
        ak.neighborhood_1d(5, length=40),
        ak.neighborhood_1d(3, 2, length=40),
        ak.neighborhood_1d(7, causal=True, length=40),
        ak.neighborhood_2d((5, 8), (3, 5)),
        ak.neighborhood_2d((8, 5), 2, dilation=2),
    ]
)


@settings(max_examples=60, deadline=None)
@given(mask=MASKS, qb=st.integers(1, 9), kb=st.integers(1, 9), nq=st.integers(1, 40))
def test_classify_never_claims_full_or_empty_wrongly(mask, qb, kb, nq):
    nk = 40
    _check_classification(mask, 1, nq if "neighborhood" not in repr(mask) else nk, nk, qb, kb)


@settings(max_examples=30, deadline=None)
@given(qb=st.integers(1, 8), kb=st.integers(1, 8), lens=st.lists(st.integers(0, 30), min_size=2, max_size=2))
def test_classify_batch_dependent_masks(qb, kb, lens):
    ids = torch.stack([torch.arange(30) // 7, torch.tensor(sorted(torch.randint(0, 4, (30,)).tolist()))])
    for mask in (ak.document(ids), ak.padding(lens), ak.causal() & ak.document(ids), ak.prefix_lm(torch.tensor(lens))):
        _check_classification(mask, 2, 30, 30, qb, kb)


def test_classification_skips_tiles():
    grid = TileGrid(q_start=0, q_len=1024, q_block=128, k_len=1024, k_block=128)
    causal_states = ak.causal().classify(grid)
    assert int((causal_states == EMPTY).sum()) == 28 and int((causal_states == FULL).sum()) == 28
    window_states = ak.window(100).classify(grid)
    assert int((window_states == EMPTY).sum()) == 64 - 8 - 7


# ------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "make,fragment",
    [
        (lambda: ak.window(-1), "window: left"),
        (lambda: ak.window(2.5), "window: left"),
        (lambda: ak.dilated(4, 0), "dilated(dilation)"),
        (lambda: ak.document(torch.rand(5)), "document(ids)"),
        (lambda: ak.padding([[1, 2]]), "padding(lengths)"),
        (lambda: ak.prefix_lm(-3), "prefix_lm(prefix_len)"),
        (lambda: ak.neighborhood_2d((4, 4), 5), "kernel[0] * dilation[0] = 5 exceeds grid[0] = 4"),
        (lambda: ak.neighborhood_2d((4,), 3), "neighborhood_2d: grid"),
        (lambda: ak.neighborhood_1d(0), "neighborhood_1d(kernel)"),
    ],
)
def test_bad_mask_arguments_are_named(make, fragment):
    with pytest.raises(
        ValueError,
        match=fragment.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]").replace("*", r"\*"),
    ):
        make()


@pytest.mark.parametrize(
    "mask,fragment",
    [
        (ak.document(torch.arange(10)), "ids has 10 positions but the keys have Nk=12"),
        (ak.document(torch.zeros(3, 12, dtype=torch.long)), "has 3 batch rows but the call has B=2"),
        (ak.padding([4, 5, 6]), "has 3 batch rows but the call has B=2"),
        (ak.padding([4, 13]), "exceeds the key length Nk=12"),
        (ak.neighborhood_2d((3, 3), 3), "expected Nq == Nk == 9"),
    ],
)
def test_masks_check_call_sizes(mask, fragment):
    q = torch.randn(2, 2, 12, 4)
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        ak.attention(q, q, q, mask=mask)


BANDS = [
    (ak.causal(), (None, 0)),
    (ak.window(5), (-5, 0)),
    (ak.window(3, 2), (-3, 2)),
    (ak.window(None, 4), (None, 4)),
    (ak.window(6, None), (-6, None)),
    (ak.causal() & ak.window(4, 3), (-4, 0)),
    (ak.window(2, 9) & ak.window(7, 1), (-2, 1)),
]


@pytest.mark.parametrize("mask,band", BANDS, ids=[repr(m) for m, _ in BANDS])
def test_band_is_the_exact_diagonal_band(mask, band):
    """band() feeds fused kernels a key range per query: it must equal the mask everywhere."""
    assert mask.band() == band
    lo, hi = band
    Nq, Nk = 9, 13  # bottom-right aligned: query i sits at position Nk - Nq + i
    want = literal(lambda b, h, qp, kp: (lo is None or kp - qp >= lo) and (hi is None or kp - qp <= hi), Nq, Nk)
    assert torch.equal(dense(mask, Nq, Nk), want)


@pytest.mark.parametrize(
    "mask",
    [
        ak.document(torch.tensor([0, 0, 1, 1])),
        ak.causal() | ak.window(None, 2),
        ~ak.causal(),
        ak.causal() & ak.prefix_lm(2),
        ak.dilated(4, 2),
    ],
    ids=repr,
)
def test_band_is_none_for_other_masks(mask):
    assert mask.band() is None
    assert ak.mods.band_of(mask) is None


def test_no_mask_is_the_unbounded_band():
    assert ak.mods.band_of(None) == (None, None)
    assert ak.mods.band_of(ak.window(3, 1)) == (-3, 1)
