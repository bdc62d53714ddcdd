"""Meters on tiles of mechanisms that are not softmax: unnormalised or signed weights,
no logits (fed through ``feed`` as a mechanism would)."""

import pytest
import torch
from dense_meters import distance_bin_mass, entropy_rows, rows_mean

from attnkit.observe import AttentionTile, CallInfo, DistanceProfile, Entropy, LogitStats, SinkMass, TopKeys, feed
from helpers import TOL

F64 = TOL[torch.float64]


def tiles_of(w, call, q_block=16, k_block=24, scores=None):
    """Cut a dense (B, H, N, N) weight matrix (and its logits, if given) into tiles."""
    B, H, N, _ = w.shape
    for q0 in range(0, N, q_block):
        for k0 in range(0, N, k_block):
            q_pos, k_pos = torch.arange(q0, min(q0 + q_block, N)), torch.arange(k0, min(k0 + k_block, N))
            s = None if scores is None else scores[:, :, q_pos][..., k_pos]
            yield AttentionTile(call, torch.arange(B), q_pos, k_pos, w[:, :, q_pos][..., k_pos], s)


def test_meters_on_signed_weights_without_logits():
    B, H, N = 2, 3, 70
    g = torch.Generator().manual_seed(1)
    causal = torch.ones(N, N).tril().bool()
    # gated, signed weights (a differential-attention-like row): not a distribution
    w = (torch.sigmoid(torch.randn(B, H, N, N, generator=g, dtype=torch.float64)) - 0.3) * causal
    call = CallInfo(B, H, N, N, 0, layer=0, mechanism="signed")
    meters = [SinkMass(), Entropy(), DistanceProfile(), LogitStats(), TopKeys(k=3)]
    feed(meters, call, tiles_of(w, call))
    got = {(lay, h, m): x for meter in meters for lay, h, m, x in meter.rows()}
    assert not any(m.startswith("logit.") for _, _, m in got)  # no logits were given
    ent, n, live = entropy_rows(w, causal)  # of |w| normalised per row
    pos = torch.arange(N)
    top = w.masked_fill(w <= 0, float("-inf")).topk(3, dim=-1).values  # top keys are the attended ones: weight > 0
    top = torch.where(torch.isfinite(top), top, 0.0)
    for h in range(H):
        torch.testing.assert_close(got[(0, h, "sink.first4")], rows_mean(w[..., :4].sum(-1))[h].item(), **F64)
        torch.testing.assert_close(got[(0, h, "entropy.mean")], ent[:, h].mean().item(), **F64)
        multi = n[:, h] >= 2
        torch.testing.assert_close(
            got[(0, h, "entropy.norm")], (ent[:, h][multi] / torch.log(n[:, h][multi])).mean().item(), **F64
        )
        torch.testing.assert_close(got[(0, h, "distance.8-15")], distance_bin_mass(w, pos, 8, 16)[h].item(), **F64)
        torch.testing.assert_close(got[(0, h, "topkeys.top3")], rows_mean(top.sum(-1))[h].item(), **F64)


def test_tile_positions_are_read_once_and_must_be_ranges():
    """``AttentionTile.starts``: the producer's origin when it gave one, else the first
    position of each range, checked (a gap is refused) and kept for the next reader."""
    call = CallInfo(2, 1, 3, 5, 2, 0)
    w = torch.zeros(2, 1, 3, 5)
    tile = AttentionTile(call, torch.arange(2), torch.arange(2, 5), torch.arange(5), w)
    assert tile.starts == (2, 0, 0)
    assert tile.starts is tile.starts  # computed once
    given = AttentionTile(call, torch.arange(2), torch.tensor([0, 7, 9]), torch.arange(5), w, origin=(2, 0, 0))
    assert given.starts == (2, 0, 0)  # the producer's word, not re-read
    gap = AttentionTile(call, torch.arange(2), torch.tensor([2, 3, 5]), torch.arange(5), w)
    with pytest.raises(ValueError, match="query positions"):
        gap.starts  # noqa: B018
