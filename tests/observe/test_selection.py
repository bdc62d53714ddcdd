"""Restricting meters to layers, heads and query ranges: the numbers, and the work done."""

import pytest
import torch
from dense_meters import dense, distance_bin_mass, entropy_rows, first_k_mass, qkv, rows_mean

import attnkit as ak
from attnkit.kernels import make_request
from attnkit.kernels.observe_pass import call_info, softmax_tiles
from attnkit.observe import CallInfo, DistanceProfile, Entropy, Observer, Selection, SinkMass, feed
from helpers import TOL

F64 = TOL[torch.float64]


class Spy(Observer):
    """Records what the pass computed: head indices and query positions of each tile."""

    def __init__(self, selection):
        self.selection, self.tiles, self.calls = selection, [], 0

    def wants(self, call):
        return self.selection

    def begin(self, call):
        self.calls += 1

    def update(self, tile):
        self.tiles.append((tile.head_index.tolist(), int(tile.q_pos[0]), int(tile.q_pos[-1]), tile.weights.shape))


def test_restricted_meters_match_dense_on_their_heads_and_queries():
    q, k, v = qkv(2, 4, 2, 300, 300)
    call = {"mask": ak.causal()}
    a = SinkMass(heads=[1, 3], queries=(-7, None), layers=[2])
    b = Entropy(heads=[0], queries=range(10, 140))
    c = DistanceProfile(queries=5)  # one query, at position 5
    for layer in (1, 2):
        ak.attention(q, k, v, observers=[a, b, c], layer=layer, **call)
    p, vis, _, pos = dense(q, k, v, **call)
    rows_a = {(lay, h, m): x for lay, h, m, x in a.rows()}
    assert {(lay, h) for lay, h, _ in rows_a} == {(2, 1), (2, 3)}
    for h in (1, 3):
        torch.testing.assert_close(rows_a[(2, h, "sink.first4")], first_k_mass(p[:, :, -7:], 4)[h].item(), **F64)
    rows_b = {(lay, h, m): x for lay, h, m, x in b.rows()}
    assert {(lay, h) for lay, h, _ in rows_b} == {(1, 0), (2, 0)}
    ent, _, _ = entropy_rows(p[:, :, 10:140], vis[..., 10:140, :])
    torch.testing.assert_close(rows_b[(1, 0, "entropy.mean")], ent[:, 0].mean().item(), **F64)
    rows_c = {(lay, h, m): x for lay, h, m, x in c.rows()}
    for h in range(4):
        torch.testing.assert_close(
            rows_c[(2, h, "distance.4-7")], distance_bin_mass(p[:, :, 5:6], pos[5:6], 4, 8)[h].item(), **F64
        )
        torch.testing.assert_close(rows_c[(2, h, "distance.0")], rows_mean(p[:, :, 5:6, 5])[h].item(), **F64)


def test_the_pass_computes_only_the_union_of_what_is_wanted():
    q, k, v = qkv(1, 8, 2, 400, 400)
    first = Spy(Selection(heads=(1, 6), q_range=(390, 400)))
    second = Spy(Selection(heads=(3,), q_range=(380, 385)))
    ak.attention(q, k, v, mask=ak.causal(), observers=[first, second], layer=0)
    assert first.tiles == second.tiles and first.tiles
    for heads, q0, q1, shape in first.tiles:
        assert heads == [1, 3, 6] and shape[1] == 3
        assert 380 <= q0 and q1 < 400  # only the block holding rows 380..399, trimmed


def test_weights_of_a_head_subset_equal_the_dense_ones():
    q, k, v = qkv(1, 6, 3, 200, 200)
    req = make_request(q, k, v, mask=ak.window(50), score=ak.alibi(6), return_lse=True)
    _, lse = ak.attention(q, k, v, mask=ak.window(50), score=ak.alibi(6), return_lse=True)
    p, _, _, _ = dense(q, k, v, mask=ak.window(50), score=ak.alibi(6))
    got = torch.zeros_like(p)
    heads = (0, 4, 5)
    for t in softmax_tiles(req, lse, call_info(req), Selection(heads=heads, q_range=(20, 150))):
        for i, h in enumerate(t.heads.tolist()):
            got[t.batch[:, None, None], h, t.q_pos[:, None], t.k_pos[None, :]] = t.weights[:, i]
    torch.testing.assert_close(got[:, list(heads), 20:150], p[:, list(heads), 20:150], **F64)
    assert got[:, [1, 2, 3]].abs().sum() == 0 and got[:, :, :20].abs().sum() == 0


@pytest.mark.parametrize("padded", [True, False], ids=["causal-and-padding", "causal"])
def test_a_key_range_gives_one_tile_per_row_block_with_the_rows_visible_keys(padded):
    """Tiles cut to a selection's keys: the dense weights on those keys, every row block
    once, and each row's visible keys over the whole call (padding, causal, GQA, a head
    subset, a query range, a call with cached keys before its queries)."""
    q, k, v = qkv(2, 6, 3, 260, 300)
    mask = ak.causal() & ak.padding(torch.tensor([300, 211])) if padded else ak.causal()
    req = make_request(q, k, v, mask=mask, score=ak.alibi(6), return_lse=True)
    _, lse = ak.attention(q, k, v, mask=mask, score=ak.alibi(6), return_lse=True)
    p, vis, _, _ = dense(q, k, v, mask=mask, score=ak.alibi(6))
    heads, (lo, hi) = (1, 4), (70, 190)
    got = torch.full_like(p, float("nan"))
    counts = torch.full(p.shape[:3], float("nan"), dtype=torch.float64)
    blocks = []
    for t in softmax_tiles(req, lse, call_info(req), Selection(heads=heads, q_range=(60, 280), k_range=(lo, hi))):
        assert t.k_pos.tolist() == list(range(lo, hi))
        blocks.append((t.batch.tolist(), t.q_pos.tolist()))
        for i, h in enumerate(t.heads.tolist()):
            got[t.batch[:, None, None], h, t.q_pos[:, None] - 40, t.k_pos[None, :]] = t.weights[:, i]
            counts[t.batch[:, None], h, t.q_pos[None, :] - 40] = t.row_visible[:, 0].expand(len(t.batch), -1)
    pairs = [(b, r) for bs, qs in blocks for b in bs for r in qs]
    assert sorted(pairs) == sorted({(b, r) for b in (0, 1) for r in range(60, 280)})  # every row once
    h, rs = list(heads), slice(20, 240)
    torch.testing.assert_close(got[:, h, rs, lo:hi], p[:, h, rs, lo:hi], **F64)
    torch.testing.assert_close(counts[:, h, rs], vis[:, h, rs].sum(-1, dtype=torch.float64), rtol=0, atol=0)
    assert torch.isnan(got[:, :, :, :lo]).all() and torch.isnan(got[:, :, :, hi:]).all()  # no other key computed


def test_nothing_is_computed_when_no_observer_wants_the_call():
    def tiles():
        raise AssertionError("tiles were computed")
        yield  # pragma: no cover

    call = CallInfo(1, 2, 4, 4, 0, layer=0)
    skip = SinkMass(layers=[5])
    feed([skip], call, tiles())  # layer 0 not wanted: generator never started
    progress = Spy(Selection(heads=()))
    feed([progress], call, tiles())  # begin/end only
    assert progress.calls == 1 and not progress.tiles


def test_selection_union():
    u = Selection.union([Selection((1,), (5, 9)), Selection((0, 1), (2, 6)), Selection(())])
    assert u == Selection((0, 1), (2, 9))
    assert Selection.union([Selection((1,), (5, 9)), Selection()]) == Selection()
    assert Selection.union([Selection(())]) == Selection(())
    assert Selection.union([Selection(None, None, (4, 9)), Selection(None, None, (7, 12))]) == Selection(None, None, (4, 12))
    assert Selection.union([Selection(None, None, (4, 9)), Selection()]).k_range is None
