"""Every meter against its quantity computed on the dense float64 attention matrix."""

import pytest
import torch
from dense_meters import (
    CASE_IDS,
    CASES,
    dense,
    distance_bin_mass,
    distance_matrix,
    entropy_rows,
    first_k_mass,
    logit_stats,
    observe,
    qkv,
    rows_mean,
    sink_score,
    span_mass,
)

import attnkit
from attnkit.observe import DistanceProfile, Entropy, LogitStats, Observer, SinkMass, SpanMass, TopKeys
from attnkit.observe.distance import bin_label
from helpers import TOL

F64 = TOL[torch.float64]


def all_meters():
    return [
        SinkMass(first=3, positions=(5, -1)),
        Entropy(per_query=True),
        DistanceProfile(),
        LogitStats(),
        TopKeys(k=4),
        SpanMass({"head": (0, 10), "middle": (60, 130)}),
    ]


def check_all(got, layer, tol, p, vis, s, pos):
    """Compare the rows of ``all_meters()`` for ``layer`` with the dense quantities."""
    B, H, R, Nk = p.shape
    close = lambda a, b: torch.testing.assert_close(float(a), float(b), **tol)  # noqa: E731
    # sinks
    seen = vis[..., 0].expand(p.shape[:3]).sum(dim=(0, 2))
    for h in range(H):
        close(got[(layer, h, "sink.first3")], first_k_mass(p, 3)[h])
        close(got[(layer, h, "sink.pos5")], rows_mean(p[..., 5])[h])
        close(got[(layer, h, "sink.pos-1")], rows_mean(p[..., -1])[h])
        assert ((layer, h, "sink.score") in got) == bool(seen[h] > 0)
        if seen[h] > 0:
            close(got[(layer, h, "sink.score")], sink_score(p, vis)[h])
    # entropy
    ent, n, live = entropy_rows(p, vis)
    for h in range(H):
        e, lv, nn = ent[:, h], live[:, h], n[:, h]
        close(got[(layer, h, "entropy.mean")], e[lv].mean())
        close(got[(layer, h, "entropy.min")], e[lv].min())
        close(got[(layer, h, "entropy.max")], e[lv].max())
        multi = lv & (nn >= 2)
        close(got[(layer, h, "entropy.norm")], (e[multi] / torch.log(nn[multi])).mean())
    # distance: every bin up to the largest possible distance, and the mean
    d = distance_matrix(pos, Nk)
    labels = [m for (lay, _, m) in got if lay == layer and m.startswith("distance.") and m != "distance.mean"]
    n_bins = len(set(labels))
    assert n_bins == (Nk - 1).bit_length() + 1  # bins 0, 1, 2-3, ... up to the one holding Nk - 1
    edges = [0] + [2**i for i in range(n_bins)]
    for h in range(H):
        close(got[(layer, h, "distance.mean")], rows_mean((p * d).sum(-1))[h])
        for b in range(n_bins):
            close(
                got[(layer, h, f"distance.{bin_label(edges[b], edges[b + 1])}")],
                distance_bin_mass(p, pos, edges[b], edges[b + 1])[h],
            )
    # spans
    for name, (a, b) in {"head": (0, 10), "middle": (60, 130)}.items():
        mass, uniform = span_mass(p, vis, a, b)
        for h in range(H):
            close(got[(layer, h, f"span.{name}")], mass[h])
            close(got[(layer, h, f"span.{name}.uniform")], uniform[h])
    # logits: over visible pairs only
    for h in range(H):
        mx, mn, mean, std = logit_stats(s, vis, h)
        close(got[(layer, h, "logit.max")], mx)
        close(got[(layer, h, "logit.min")], mn)
        close(got[(layer, h, "logit.mean")], mean)
        close(got[(layer, h, "logit.std")], std)
    # top keys: mean of the largest weight and of the top-4 mass (masked keys never count)
    top = p.masked_fill(~vis.expand(p.shape), float("-inf")).topk(min(4, Nk), dim=-1).values
    top = torch.where(torch.isfinite(top), top, 0.0)
    for h in range(H):
        close(got[(layer, h, "topkeys.top1")], rows_mean(top[..., 0])[h])
        close(got[(layer, h, "topkeys.top4")], rows_mean(top.sum(-1))[h])


def small_tiles(monkeypatch):
    """Tiles of 32 queries x 48 keys: rows cut across many key tiles, so every merge path runs
    (by default a short input is a single tile)."""
    import attnkit.kernels.observe_pass as op

    for name, value in (
        ("OBSERVE_Q_BLOCK", 32),
        ("OBSERVE_K_BLOCK", 48),
        ("OBSERVE_MAX_FULL_SPAN", 48),
        ("OBSERVE_TILE_WEIGHTS", 1),
    ):
        monkeypatch.setattr(op, name, value)


# every case with the pass's own tiling, and all but the long one (already cut into key
# segments) with small tiles
TILED = [
    (case, tiling) for case in CASES for tiling in ("tiles", "small-tiles") if not (case[0] == "long" and tiling == "small-tiles")
]


@pytest.mark.parametrize("case,tiling", TILED, ids=[f"{c[0]}-{t}" for c, t in TILED])
def test_every_meter_matches_dense_float64(case, tiling, monkeypatch):
    name, shape, call = case
    if tiling == "small-tiles":
        small_tiles(monkeypatch)
    q, k, v = qkv(*shape)
    meters = all_meters()
    got = observe(q, k, v, meters, layer=3, **call)
    p, vis, s, pos = dense(q, k, v, **call)
    check_all(got, 3, F64, p, vis, s, pos)
    # per-query arrays: top-key positions and weights, entropy per row
    arrays = {}
    for m in meters:
        arrays.update(m.arrays())
    ent, _, _ = entropy_rows(p, vis)
    ref = p.masked_fill(~vis.expand(p.shape), float("-inf")).topk(min(4, p.shape[-1]), dim=-1)
    for h in range(shape[1]):
        tk = arrays["top_keys"][(3, h)]
        found = tk["index"] >= 0
        assert torch.equal(found, torch.isfinite(ref.values[:, h]))
        assert torch.equal(tk["index"][found].long(), ref.indices[:, h][found])
        torch.testing.assert_close(tk["weight"][found].double(), ref.values[:, h][found], **TOL[torch.float32])
        assert tk["q_start"] == shape[4] - shape[3]
        torch.testing.assert_close(arrays["entropy"][(3, h)]["values"].double(), ent[:, h], **TOL[torch.float32])


@pytest.mark.parametrize("name,shape,call", [CASES[1], CASES[5]], ids=[CASE_IDS[1], CASE_IDS[5]])
def test_every_meter_on_float32_inputs(name, shape, call):
    q, k, v = qkv(*shape, dtype=torch.float32)
    got = observe(q, k, v, all_meters(), layer=0, **call)
    # float32 tiles, float64 reference on the same (rounded) inputs: float32 tolerance,
    # on sums of at most a few hundred weights of magnitude <= 1
    check_all(got, 0, TOL[torch.float32], *dense(q.double(), k.double(), v.double(), **call))


def test_learnable_sinks_take_their_share_of_the_mass():
    q, k, v = qkv(1, 4, 4, 64, 64)
    sinks = torch.tensor([0.0, 2.0, -1.0, 5.0], dtype=torch.float64)
    import attnkit as ak

    got = observe(q, k, v, [SinkMass(), DistanceProfile()], sinks=sinks, mask=ak.causal())
    p, _, _, pos = dense(q, k, v, sinks=sinks, mask=ak.causal())
    for h in range(4):
        close_bins = sum(v for (lay, hh, m), v in got.items() if hh == h and m.startswith("distance.") and m != "distance.mean")
        torch.testing.assert_close(close_bins, rows_mean(p.sum(-1))[h].item(), **F64)  # < 1: the sink keeps the rest
        torch.testing.assert_close(got[(0, h, "sink.first4")], first_k_mass(p, 4)[h].item(), **F64)


@pytest.mark.parametrize("observed", [True, False], ids=["observed", "unobserved"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name,shape,call", [c for c in CASES if c[0].startswith("decode")], ids=lambda c: str(c))
def test_a_dense_few_query_call_gives_the_tile_engines_output_and_lse(name, shape, call, dtype, observed):
    """A decoding step observed or with a score mod is computed densely, its output from
    the weights the observers see (kernels/dense_rows.py); the tile engine (asked for by
    name) gives the same values."""
    q, k, v = qkv(*shape, dtype=dtype)
    seen = []

    class Record(Observer):
        def update(self, tile):
            seen.append(tile.weights)

    out, lse = attnkit.attention(q, k, v, return_lse=True, observers=[Record()] if observed else None, **call)
    ref_out, ref_lse = attnkit.attention(q, k, v, return_lse=True, backend="chunked", **call)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    live = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), live)
    torch.testing.assert_close(lse[live], ref_lse[live].to(lse.dtype), **TOL[dtype])
    if observed:
        p, _, _, _ = dense(q.double(), k.double(), v.double(), **call)
        assert len(seen) == 1  # one tile: every head, row and key of the call
        torch.testing.assert_close(seen[0].double(), p, **TOL[dtype])
