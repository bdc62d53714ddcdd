"""Layouts, global-position masks and the pair plan, in one process (no group needed)."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.distributed import layout_for
from attnkit.distributed.comm import Group
from attnkit.distributed.offset import ShiftedMask, pair_state
from attnkit.distributed.ring import RingPlan
from attnkit.mods import TileGrid


@pytest.mark.parametrize("n,world", [(11, 2), (14, 4), (3, 4), (0, 2), (64, 8)])
@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
def test_every_position_is_held_exactly_once(n, world, kind):
    lay = layout_for(n, world, kind)
    held = torch.cat([lay.positions(r) for r in range(world)])
    assert sorted(held.tolist()) == list(range(n))
    lengths = [lay.local_length(r) for r in range(world)]
    assert max(lengths) - min(lengths) <= (2 if kind == "zigzag" else 1)


def test_zigzag_balances_causal_work():
    n, world = 64, 4
    for kind, balanced in (("zigzag", True), ("contiguous", False)):
        lay = layout_for(n, world, kind)
        # visible causal pairs per rank: a query at position p sees p + 1 keys
        work = [int((lay.positions(r) + 1).sum()) for r in range(world)]
        assert (max(work) == min(work)) == balanced, (kind, work)


def test_layout_rejects_unknown_names():
    with pytest.raises(ValueError, match="layout: expected 'zigzag' or 'contiguous'"):
        layout_for(8, 2, "striped")


def _global_dense(mask, B, H, n):
    return mask.dense(B, H, n, n).expand(B, H, n, n)


@pytest.mark.parametrize(
    "mask",
    [
        ak.causal(),
        ak.window(3),
        ak.window(2, 1) & ak.causal(),
        ak.causal() & ak.document(torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3], [0] * 7 + [1] * 7])),
    ],
)
def test_shifted_mask_is_the_global_mask_on_the_pair(mask):
    """Evaluated and classified on local indices, the shifted mask equals the slice of the
    dense global mask; its tile states never contradict the dense slice."""
    B, H, n = 2, 1, 14
    mask = mask.bind(B, H, n, n)
    whole = _global_dense(mask, B, H, n)
    for qs, ql, ks, kl in [(0, 4, 0, 4), (6, 3, 2, 5), (10, 4, 3, 2), (2, 5, 9, 5), (7, 1, 0, 14)]:
        m = ShiftedMask(mask, qs - (kl - ql), ks)
        piece = m.dense(B, H, ql, kl).expand(B, H, ql, kl)
        assert torch.equal(piece, whole[:, :, qs : qs + ql, ks : ks + kl])
        grid = TileGrid(q_start=kl - ql, q_len=ql, q_block=2, k_len=kl, k_block=2)
        states = m.classify(grid).expand(B, -1, -1)
        for i in range(grid.n_q):
            for j in range(grid.n_k):
                tile = piece[:, 0, i * 2 : i * 2 + 2, j * 2 : j * 2 + 2]
                for b in range(B):
                    if states[b, i, j] == 0:
                        assert not tile[b].any()
                    if states[b, i, j] == 2:
                        assert tile[b].all()
        state = pair_state(mask, qs, ql, ks, kl)
        assert state != "empty" or not piece.any()
        assert state != "full" or piece.all()


def test_a_window_reads_only_neighbouring_ranks():
    n, world = 64, 4
    lay = layout_for(n, world, "contiguous")
    mask = ak.window(5).bind(1, 1, n, n)
    for r in range(world):
        plan = RingPlan(Group(None, r, world), lay, "softmax", mask, None, 1.0, "auto", None)
        assert {s for s, need in plan.need_from.items() if need} == {r, r - 1} - {-1}
        assert {d for d, need in plan.need_by.items() if need} == {r, r + 1} - {world}


def test_documents_read_only_the_ranks_they_span():
    n, world = 16, 4
    ids = torch.tensor([0] * 4 + [1] * 8 + [2] * 4)  # document 1 spans ranks 1 and 2
    lay = layout_for(n, world, "contiguous")
    mask = ak.document(ids).bind(1, 1, n, n)
    reads = [
        {
            s
            for s, need in RingPlan(Group(None, r, world), lay, "softmax", mask, None, 1.0, "auto", None).need_from.items()
            if need
        }
        for r in range(world)
    ]
    assert reads == [{0}, {1, 2}, {1, 2}, {3}]
