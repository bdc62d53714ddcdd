"""Native Sparse Attention: the paper's branches by literal loops, fast path against the
dense reference (values and gradients), exact limits, observers, bad input."""

import math

import pytest
import torch

import attnkit as ak
from attnkit.kernels import make_request, reference_attention
from attnkit.mechanisms import get_mechanism, native_sparse
from attnkit.mechanisms.native_sparse import CompressedCausal
from attnkit.mods import EMPTY, FULL, TileGrid
from attnkit.observe import Observer
from helpers import assert_close, qkv

SMALL = dict(compress_block=8, compress_stride=4, select_block=8, num_selected=3, window=6)


def literal_nsa(mech, q, k, v, gates):
    """Eq. (5)-(11) of arXiv 2502.11089 with mean compression, one query at a time."""
    B, Hq, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G, scale = Hq // Hkv, q.shape[-1] ** -0.5
    l, d, bs = mech.compress_block, mech.compress_stride, mech.select_block
    n_cmp = (Nk - l) // d + 1
    out = torch.zeros(B, Hq, Nq, v.shape[-1], dtype=torch.float64)
    chosen = {}

    def softmax_over(b, h, t, keys, values):
        s = torch.stack([q[b, h, t] @ kk for kk in keys]) * scale
        return torch.softmax(s, 0) @ torch.stack(values)

    for b in range(B):
        for t in range(Nq):
            pos = Nk - Nq + t
            cmp = [i for i in range(n_cmp) if i * d + l - 1 <= pos]
            k_cmp = {i: k[b, :, i * d : i * d + l].mean(1) for i in cmp}
            v_cmp = {i: v[b, :, i * d : i * d + l].mean(1) for i in cmp}
            own = pos // bs
            for g in range(Hkv):
                importance = [0.0] * (own + 1)
                for h in range(g * G, (g + 1) * G):
                    if cmp:
                        p = torch.softmax(torch.stack([q[b, h, t] @ k_cmp[i][g] for i in cmp]) * scale, 0)
                        for i, pi in zip(cmp, p.tolist()):
                            for j in range(own + 1):  # selection block j shares a token with compressed block i
                                if i * d < (j + 1) * bs and i * d + l > j * bs:
                                    importance[j] += pi
                forced = {j for j in range(own + 1) if j < mech.initial_blocks or j > own - mech.local_blocks}
                rest = sorted((j for j in range(own) if j not in forced), key=lambda j: -importance[j])
                sel = forced | set(rest[: mech.num_selected - len(forced)])
                chosen[b, g, t] = sel
                for h in range(g * G, (g + 1) * G):
                    o_cmp = softmax_over(b, h, t, [k_cmp[i][g] for i in cmp], [v_cmp[i][g] for i in cmp]) if cmp else 0
                    slc = [j for j in range(pos + 1) if j // bs in sel]
                    o_slc = softmax_over(b, h, t, [k[b, g, j] for j in slc], [v[b, g, j] for j in slc])
                    win = range(max(0, pos - mech.window + 1), pos + 1)
                    o_win = softmax_over(b, h, t, [k[b, g, j] for j in win], [v[b, g, j] for j in win])
                    gt = gates[b, h, t]
                    out[b, h, t] = gt[0] * o_cmp + gt[1] * o_slc + gt[2] * o_win
    return out, chosen


@pytest.mark.parametrize(
    "Nq,Nk,Hq,Hkv,kwargs",
    [
        (40, 40, 3, 1, {}),
        (
            30,
            44,
            4,
            2,
            dict(compress_block=8, compress_stride=8, select_block=8, num_selected=4, initial_blocks=0, local_blocks=1),
        ),
    ],
)
def test_literal_equations(Nq, Nk, Hq, Hkv, kwargs):
    q, k, v = qkv(B=1, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=4)
    mech = get_mechanism("nsa", **{**SMALL, **kwargs})
    gates = torch.rand(1, Hq, Nq, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want, chosen = literal_nsa(mech, q, k, v, gates)
    assert_close(mech.reference(q, k, v, mask=ak.causal(), gates=gates), want)
    assert_close(mech(q, k, v, mask=ak.causal(), gates=gates), want)
    k_cmp, _ = mech.compress(k, v)
    selection, _ = mech.select(q, k_cmp, None, 0.5, Nk)
    for (b, g, t), sel in chosen.items():
        assert set(selection[b, g, t].tolist()) - {-1} == sel


def test_compressed_causal_mask_tiles():
    mask = CompressedCausal(block=8, stride=4, shift=50 - 11)  # 11 compressed keys of 50 tokens
    dense = mask.dense(1, 1, 30, 11)[0, 0]
    assert torch.equal(dense, torch.arange(11) * 4 + 7 <= torch.arange(20, 50).view(-1, 1))
    grid = TileGrid(q_start=11 - 30, q_len=30, q_block=7, k_len=11, k_block=3)
    states = mask.classify(grid)[0]
    for i in range(grid.n_q):
        for j in range(grid.n_k):
            tile = dense[i * 7 : (i + 1) * 7, j * 3 : (j + 1) * 3]
            assert states[i, j] != EMPTY or not bool(tile.any())
            assert states[i, j] != FULL or bool(tile.all())


CASES = [
    (70, 70, 4, 2, 8, {}),
    (50, 83, 6, 2, 5, dict(select_block=16, num_selected=4)),  # GQA ratio 3: not a power of two
    (64, 64, 3, 3, 8, dict(compress_block=8, compress_stride=8, compress="mlp", head_dim=8, v_dim=8)),
    (33, 97, 2, 1, 7, dict(compress="mlp", head_dim=8, v_dim=7, num_heads=2)),
]


@pytest.mark.parametrize("Nq,Nk,Hq,Hkv,Dv,kwargs", CASES)
def test_fast_path_matches_reference_values_and_gradients(Nq, Nk, Hq, Hkv, Dv, kwargs):
    check_against_reference(Nq, Nk, Hq, Hkv, Dv, kwargs)


@pytest.mark.parametrize("Nq,Nk,Hq,Hkv,Dv,kwargs", CASES)
def test_fast_path_in_many_chunks_and_window_blocks(monkeypatch, Nq, Nk, Hq, Hkv, Dv, kwargs):
    """Block scoring in query chunks of 16 and the window in query blocks of 8 with a
    window of 20: chunk edges, windows starting before key 0 (masked one by one) and the
    shared band mask of the later blocks all meet the reference. The selection branch
    runs full entries of 4 rows and tail entries of 3, a few entries per call."""
    monkeypatch.setattr(native_sparse, "SELECT_Q_CHUNK", 16)
    monkeypatch.setattr(native_sparse, "WINDOW_BLOCK", 8)
    monkeypatch.setattr(native_sparse, "WINDOW_BLOCK_GRAD", 8)
    monkeypatch.setattr(native_sparse._Entries, "ROWS", 4)
    monkeypatch.setattr(native_sparse._Entries, "TAIL_ROWS", 3)
    monkeypatch.setattr(native_sparse, "CALL_ELEMENTS", 200)
    check_against_reference(Nq, Nk, Hq, Hkv, Dv, {**kwargs, "window": 20})


@pytest.mark.parametrize("rescale_above", [native_sparse.RESCALE_ABOVE, -math.inf])
def test_selection_merge_when_a_far_block_dominates(monkeypatch, rescale_above):
    """Key 0 scores ~1000 above the rest (past exp's overflow even in float64): the first
    block's partial result outweighs the own block's by far more than RESCALE_ABOVE, so
    the reference must rise (with -inf it rises on every call: the running-max merge)."""
    monkeypatch.setattr(native_sparse, "RESCALE_ABOVE", rescale_above)
    monkeypatch.setattr(native_sparse, "CALL_ELEMENTS", 200)
    q, k, v = qkv(B=1, Hq=4, Hkv=2, Nq=70, Nk=70, D=8, requires_grad=True)
    with torch.no_grad():
        q.abs_()
        k[:, :, 0] = 400.0
    check_against_reference(70, 70, 4, 2, 8, {}, (q, k, v))


def check_against_reference(Nq, Nk, Hq, Hkv, Dv, kwargs, inputs=None):
    q, k, v = inputs or qkv(B=2, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=8, Dv=Dv, requires_grad=True)
    B = q.shape[0]
    torch.manual_seed(0)
    mech = get_mechanism("nsa", **{**SMALL, **kwargs}).double()
    gates = None
    if mech.gate_logits is None:
        gates = torch.rand(B, Hq, Nq, 3, dtype=torch.float64).requires_grad_()
    out = mech(q, k, v, mask=ak.causal(), gates=gates)
    ref = mech.reference(q, k, v, mask=ak.causal(), gates=gates)
    assert_close(out, ref)
    with torch.no_grad():  # inference takes another route for the compression branch
        assert_close(mech(q, k, v, mask=ak.causal(), gates=gates), ref)
    go = torch.randn_like(out)
    wrt = [q, k, v] + ([gates] if gates is not None else []) + list(mech.parameters())
    for got, want in zip(torch.autograd.grad((out * go).sum(), wrt), torch.autograd.grad((ref * go).sum(), wrt)):
        assert_close(got, want)


def test_selection_entries_hold_every_pair_once(monkeypatch):
    """Entries of 5 rows, then tails of 2: every (row, block) pair of the selection except
    own blocks and empty slots sits in exactly one entry of its block, in query order, and
    a block pads fewer than 2 dummy rows."""
    monkeypatch.setattr(native_sparse._Entries, "ROWS", 5)
    monkeypatch.setattr(native_sparse._Entries, "TAIL_ROWS", 2)
    B, Hkv, Nq, n, n_blocks = 2, 3, 40, 4, 9
    g = torch.Generator().manual_seed(0)
    own = torch.arange(Nq) // 5
    score = torch.rand(B, Hkv, Nq, n_blocks, generator=g).masked_fill(torch.arange(n_blocks) > own.view(-1, 1), -math.inf)
    top = torch.topk(score, n, dim=-1)  # distinct blocks up to the own one, -1 past the last
    selection = top.indices.masked_fill(torch.isneginf(top.values), -1)
    entries = native_sparse._Entries(selection, own, n_blocks)
    dummy = B * Hkv * Nq
    want = sorted(
        ((b * Hkv + h) * Nq + t, (b * Hkv + h) * n_blocks + j)
        for b in range(B)
        for h in range(Hkv)
        for t in range(Nq)
        for j in set(selection[b, h, t].tolist()) - {-1, int(own[t])}
    )
    got, pads = [], {}
    for rows, blocks in entries.chunks(1):
        for entry, block in zip(rows.tolist(), blocks.tolist()):
            real = [r for r in entry if r != dummy]
            assert real == sorted(real) and real == entry[: len(real)]
            got += [(r, block) for r in real]
            pads[block] = pads.get(block, 0) + len(entry) - len(real)
    assert sorted(got) == want
    assert max(pads.values()) < 2


def test_gradcheck():
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=24, Nk=24, D=3, requires_grad=True)
    mech = get_mechanism("nsa", compress_block=4, compress_stride=2, select_block=4, num_selected=3, window=5)
    gates = torch.rand(1, 2, 24, 3, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b, c, g: mech(a, b, c, mask=ak.causal(), gates=g), (q, k, v, gates), fast_mode=True)


def test_all_blocks_selected_is_causal_softmax():
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Nq=56, Nk=72, D=8)
    mech = get_mechanism("nsa", compress_block=8, compress_stride=4, select_block=8, num_selected=9, window=4)
    only_selection = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64).view(1, 1, 1, 3).expand(1, 4, 1, 3)
    out = mech(q, k, v, mask=ak.causal(), gates=only_selection)
    want, _ = reference_attention(make_request(q, k, v, mask=ak.causal()), torch.float64)
    assert_close(out, want)
    only_window = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64).view(1, 1, 1, 3).expand(1, 4, 1, 3)
    wide = get_mechanism("nsa", compress_block=8, compress_stride=4, select_block=8, num_selected=3, window=72)
    assert_close(wide(q, k, v, mask=ak.causal(), gates=only_window), want)


def test_default_gates_are_one_half():
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=40, Nk=40, D=4)
    mech = get_mechanism("nsa", **SMALL)
    half = torch.full((1, 2, 40, 3), 0.5, dtype=torch.float64)
    assert_close(ak.attention(q, k, v, mask=ak.causal(), mechanism=mech), mech(q, k, v, mask=ak.causal(), gates=half))


class Collect(Observer):
    def begin(self, call):
        self.weights = torch.zeros(call.batch, call.heads, call.q_len, call.k_len, dtype=torch.float64)

    def update(self, tile):
        self.weights[:, :, tile.q_pos.view(-1, 1) - (tile.call.k_len - tile.call.q_len), tile.k_pos.view(1, -1)] += tile.weights


def test_observed_weights_make_the_output_with_mean_compression():
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Nq=45, Nk=60, D=8)
    gates = torch.rand(2, 4, 45, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    meter = Collect()
    out = get_mechanism("nsa", **SMALL)(q, k, v, mask=ak.causal(), gates=gates, observers=[meter])
    assert_close(torch.matmul(meter.weights, v.repeat_interleave(2, 1)), out)
    assert bool((meter.weights[:, :, :, 60 - 45 + 1 :].triu() == 0).all())  # causal: no weight on future keys


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(compress_block=6, compress_stride=4), "compress_block"),
        (dict(select_block=6, compress_stride=4), "select_block"),
        (dict(num_selected=2, initial_blocks=1, local_blocks=2), "num_selected"),
        (dict(compress="max"), "compress"),
        (dict(compress="mlp"), "head_dim"),
        (dict(window=0), "window"),
        (dict(local_blocks=0), "local_blocks"),
    ],
)
def test_invalid_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_mechanism("nsa", **kwargs)


def test_invalid_calls():
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=32, Nk=32, D=4)
    mech = get_mechanism("nsa", **SMALL)
    with pytest.raises(ValueError, match="causal"):
        mech(q, k, v)
    with pytest.raises(ValueError, match="return_lse"):
        mech(q, k, v, mask=ak.causal(), return_lse=True)
    with pytest.raises(ValueError, match="Nq <= Nk"):
        mech(q, k[:, :, :16], v[:, :, :16], mask=ak.causal())
    with pytest.raises(ValueError, match="gates"):
        mech(q, k, v, mask=ak.causal(), gates=torch.rand(1, 2, 32, 2))
    with pytest.raises(ValueError, match="gate_logits"):
        get_mechanism("nsa", **SMALL, num_heads=3)(q, k, v, mask=ak.causal())
    assert math.isfinite(float(mech(q, k, v, mask=ak.causal()).sum()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_precision_within_tolerance_of_float64(dtype):
    q, k, v = (t.to(dtype).double() for t in qkv(B=1, Hq=4, Hkv=2, Nq=64, Nk=64, D=16))
    mech = get_mechanism("nsa", **SMALL)
    got = mech(q.to(dtype), k.to(dtype), v.to(dtype), mask=ak.causal())
    assert got.dtype == dtype
    assert_close(got, mech.reference(q, k, v, mask=ak.causal()), dtype=dtype)


# ------------------------------------------------------------------ C loops (kernels/cpu/loops_sparse.cpp)

from attnkit.kernels import cpu  # noqa: E402

needs_c = pytest.mark.skipif(not cpu.available(), reason="no C++ operators here (ATTNKIT_NATIVE=0 or no compiler)")

C_CASES = [  # Nq, Nk, Hq, Hkv, D, Dv, mechanism arguments
    (70, 70, 4, 2, 8, 8, {}),
    (50, 83, 6, 2, 8, 5, dict(select_block=16, num_selected=4)),  # Nq < Nk, GQA 3, Dv != D, odd lengths
    (37, 37, 2, 2, 8, 8, dict(initial_blocks=0, local_blocks=1, window=9)),
    (5, 6, 2, 1, 8, 8, {}),  # shorter than a compressed block: no compressed key at all
    (29, 101, 4, 1, 16, 16, dict(compress_block=8, compress_stride=8, select_block=8, num_selected=5)),
]


def _c_ran(monkeypatch):
    calls = []
    forward = cpu.nsa_forward
    monkeypatch.setattr(cpu, "nsa_forward", lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    return calls


def _small_c_tiles(monkeypatch):
    """Scoring chunks of 16 queries, tiles of 6 (query, head) rows in spans of 24, window
    blocks of 8: chunk and span edges, blocks cut into several tiles, windows that start
    before key 0."""
    monkeypatch.setattr(native_sparse, "SELECT_Q_CHUNK", 16)
    monkeypatch.setattr(native_sparse, "SELECTED_TILE_ROWS", 6)
    monkeypatch.setattr(native_sparse, "SELECTED_SPAN_ROWS", 24)
    monkeypatch.setattr(native_sparse, "WINDOW_BLOCK_NATIVE", 8)


@needs_c
@pytest.mark.parametrize("small_tiles", [False, True])
@pytest.mark.parametrize("Nq,Nk,Hq,Hkv,D,Dv,kwargs", C_CASES)
def test_c_loops_match_pytorch_path_and_reference(monkeypatch, Nq, Nk, Hq, Hkv, D, Dv, kwargs, small_tiles):
    """float32 inference through the C loops against the PyTorch path (same selection, which
    the C scoring pass also returns) and against the float64 reference, gates per token."""
    if small_tiles:
        _small_c_tiles(monkeypatch)
    q, k, v = qkv(B=2, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, Dv=Dv, dtype=torch.float32, seed=4)
    gates = torch.rand(2, Hq, Nq, 3, generator=torch.Generator().manual_seed(5))
    mech = get_mechanism("nsa", **{**SMALL, **kwargs})
    calls = _c_ran(monkeypatch)
    with torch.no_grad():
        fast = mech(q, k, v, mask=ak.causal(), gates=gates)
        assert calls
        with monkeypatch.context() as patch:
            patch.setattr(cpu, "fused_usable", lambda *tensors: False)
            slow = mech(q, k, v, mask=ak.causal(), gates=gates)
        k_cmp, v_cmp = mech.compress(k, v)
        req = make_request(q, k, v, mask=ak.causal())
        _, chosen, *_ = mech._native_forward(q, k, v, k_cmp, v_cmp, gates, req)
        want_chosen, _ = mech.select(q, k_cmp, None, req.scale, Nk)
    assert torch.equal(chosen.sort(-1).values, want_chosen.sort(-1).values)
    assert_close(fast, slow, torch.float32)
    ref = mech.reference(q.double(), k.double(), v.double(), mask=ak.causal(), gates=gates.double())
    assert_close(fast, ref.float(), torch.float32)


@needs_c
@pytest.mark.parametrize("rescale_above", [native_sparse.RESCALE_ABOVE, -math.inf])
def test_c_selection_merge_when_a_far_block_dominates(monkeypatch, rescale_above):
    """As test_selection_merge_when_a_far_block_dominates, in float32 through the C loops:
    key 0 scores ~1000 above the rest, far past exp's range from the own block's max."""
    monkeypatch.setattr(native_sparse, "RESCALE_ABOVE", rescale_above)
    _small_c_tiles(monkeypatch)
    q, k, v = qkv(B=1, Hq=4, Hkv=2, Nq=70, Nk=70, D=8, dtype=torch.float32)
    q.abs_()
    k[:, :, 0] = 400.0
    mech = get_mechanism("nsa", **SMALL)
    calls = _c_ran(monkeypatch)
    with torch.no_grad():
        got = mech(q, k, v, mask=ak.causal())
    assert calls
    assert_close(got, mech.reference(q.double(), k.double(), v.double(), mask=ak.causal()).float(), torch.float32)


@needs_c
def test_c_loops_feed_observers():
    """The C loops' branch lse give observers the weights that make the output."""
    q, k, v = qkv(B=1, Hq=4, Hkv=2, Nq=45, Nk=60, D=8, dtype=torch.float32)
    gates = torch.rand(1, 4, 45, 3, generator=torch.Generator().manual_seed(1))
    meter = Collect()
    with torch.no_grad():
        out = get_mechanism("nsa", **SMALL)(q, k, v, mask=ak.causal(), gates=gates, observers=[meter])
    assert_close(torch.matmul(meter.weights.float(), v.repeat_interleave(2, 1)), out, torch.float32)


@needs_c
def test_c_loops_skip_gates_that_want_gradients(monkeypatch):
    """Gates that autograd tracks keep the branches apart (the PyTorch path)."""
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=40, Nk=40, D=8, dtype=torch.float32)
    gates = torch.rand(1, 2, 40, 3).requires_grad_()
    calls = _c_ran(monkeypatch)
    out = get_mechanism("nsa", **SMALL)(q, k, v, mask=ak.causal(), gates=gates)
    assert not calls and out.requires_grad
