"""Neighborhood attention: NATTEN windows, fast path against the dense reference and the
neighborhood mask, relative positional bias gradients, observers, bad input."""

import itertools
import math

import pytest
import torch

import attnkit as ak
from attnkit.kernels import make_request, reference_attention
from attnkit.mechanisms import get_mechanism
from attnkit.observe import Observer
from helpers import assert_close, qkv


def natten_window(i, length, kernel, dilation=1, stride=1, causal=False):
    """Keys of query i along one axis, from NATTEN's reference kernel (get_win_start /
    get_win_end in csrc/include/natten/cuda/reference/mask.hpp), on i's dilation group."""
    group = [p for p in range(length) if p % dilation == i % dilation]
    idx, n = group.index(i), len(group)
    left, right = kernel // 2, kernel // 2 + kernel % 2 - 1
    if causal:
        leader = min((idx // stride) * stride + stride - 1, n - 1)
        start, end = max(leader - left - right, 0), min(idx + 1, n)
    else:
        leader = min((idx // stride) * stride + stride // 2, n - 1)
        start = max(leader - left, 0) + (leader + right >= n) * (n - right - leader - 1)
        end = start + kernel
    return set(group[start:end])


def dense_visibility(grid, kernel, dilation, stride, causal):
    """Visible pairs of the flattened grid, as a product of the per-axis NATTEN windows."""
    per_axis = lambda x, a: (x if isinstance(x, tuple) else (x,) * len(grid))[a]
    coords = list(itertools.product(*(range(g) for g in grid)))
    out = torch.zeros(len(coords), len(coords), dtype=torch.bool)
    for i, ci in enumerate(coords):
        for j, cj in enumerate(coords):
            out[i, j] = all(
                cj[a]
                in natten_window(
                    ci[a], grid[a], per_axis(kernel, a), per_axis(dilation, a), per_axis(stride, a), per_axis(causal, a)
                )
                for a in range(len(grid))
            )
    return out


CASES = [  # grid, kernel, dilation, stride, causal
    ((13,), 5, 2, 1, False),
    ((12,), 4, 1, 3, False),
    ((10,), 4, 2, 2, True),
    ((7, 9), 3, (2, 1), (1, 2), (False, True)),
    ((6, 8), (4, 3), 1, (3, 1), False),
    ((4, 5, 6), 3, (1, 1, 2), (1, 2, 3), (True, False, False)),
]


def test_natten_window_examples():
    # Published behaviour, small enough to check by hand: windows shift inward at borders.
    assert natten_window(0, 7, 3) == {0, 1, 2}
    assert natten_window(3, 7, 3) == {2, 3, 4}
    assert natten_window(6, 7, 3) == {4, 5, 6}
    assert natten_window(5, 9, 3, dilation=2) == {3, 5, 7}
    assert natten_window(4, 8, 3, causal=True) == {2, 3, 4}
    assert natten_window(1, 8, 3, causal=True) == {0, 1}
    assert natten_window(0, 9, 3, stride=3) == natten_window(1, 9, 3) == {0, 1, 2}  # the group shares its centre's window


@pytest.mark.parametrize("grid,kernel,dilation,stride,causal", CASES)
def test_mask_is_natten(grid, kernel, dilation, stride, causal):
    n = math.prod(grid)
    mask = ak.mods.masks.Neighborhood(grid, kernel, dilation, causal, stride)
    assert torch.equal(mask.dense(1, 1, n, n)[0, 0], dense_visibility(grid, kernel, dilation, stride, causal))


@pytest.mark.parametrize("grid,kernel,dilation,stride,causal", CASES)
def test_fast_path_matches_reference_with_bias(grid, kernel, dilation, stride, causal):
    n = math.prod(grid)
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Nq=n, Nk=n, D=8, Dv=6)
    mech = get_mechanism(
        "neighborhood",
        kernel=kernel,
        grid=grid,
        dilation=dilation,
        stride=stride,
        causal=causal,
        rpb=True,
        num_heads=4,
        tile=(3,) * len(grid),
    ).double()
    out, lse = mech(q, k, v, return_lse=True)
    ref, ref_lse = mech.reference(q, k, v, return_lse=True)
    assert_close(out, ref)
    assert_close(lse, ref_lse)


def test_reference_is_the_literal_formula():
    grid, kernel = (5, 6), 3
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=30, Nk=30, D=4)
    mech = get_mechanism("neighborhood", kernel=kernel, grid=grid, rpb=True, num_heads=2).double()
    visible = dense_visibility(grid, kernel, 1, 1, False)
    out = torch.zeros(1, 2, 30, 4, dtype=torch.float64)
    for h, i in itertools.product(range(2), range(30)):
        logits = []
        for j in range(30):
            (yi, xi), (yj, xj) = divmod(i, 6), divmod(j, 6)
            bias = mech.rpb.detach()[h, yj - yi + kernel - 1, xj - xi + kernel - 1] if visible[i, j] else 0
            logits.append(float(q[0, h, i] @ k[0, h, j]) / 2 + float(bias) if visible[i, j] else -math.inf)
        p = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
        out[0, h, i] = p @ v[0, h]
    assert_close(mech.reference(q, k, v), out)


@pytest.mark.parametrize("grid,kernel,dilation", [((40,), 7, 3), ((9, 11), (3, 5), (2, 1)), ((4, 5, 6), 3, 1)])
def test_agrees_with_neighborhood_mask_attention(grid, kernel, dilation):
    n = math.prod(grid)
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Nq=n, Nk=n, D=16, dtype=torch.float32)
    mech = get_mechanism("neighborhood", kernel=kernel, grid=grid, dilation=dilation)
    mask = ak.mods.masks.Neighborhood(grid, kernel, dilation)
    out, lse = mech(q, k, v, return_lse=True)
    want, want_lse = ak.attention(q, k, v, mask=mask, return_lse=True)
    assert_close(out, want)
    assert_close(lse, want_lse)


def test_kernel_covering_the_grid_is_full_attention():
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=35, Nk=35, D=8)
    out = get_mechanism("neighborhood", kernel=(5, 7), grid=(5, 7))(q, k, v)
    want, _ = reference_attention(make_request(q, k, v), torch.float64)
    assert_close(out, want)


def test_one_dimensional_without_grid_uses_the_sequence():
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=50, Nk=50, D=8)
    out = ak.attention(q, k, v, mechanism=get_mechanism("neighborhood", kernel=9, dilation=2))
    want = ak.attention(q, k, v, mask=ak.neighborhood_1d(9, 2), backend="reference")
    assert_close(out, want)


@pytest.mark.parametrize("grid,kernel,dilation,stride,causal", [CASES[2], CASES[3], CASES[5]])
def test_gradients_match_reference(grid, kernel, dilation, stride, causal):
    n = math.prod(grid)
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Nq=n, Nk=n, D=8, Dv=6, requires_grad=True)
    mech = get_mechanism(
        "neighborhood",
        kernel=kernel,
        grid=grid,
        dilation=dilation,
        stride=stride,
        causal=causal,
        rpb=True,
        num_heads=4,
        tile=(2,) * len(grid),
    ).double()
    g = torch.Generator().manual_seed(1)
    go, gl = torch.randn(2, 4, n, 6, generator=g, dtype=torch.float64), torch.randn(2, 4, n, generator=g, dtype=torch.float64)

    def grads(fn):
        out, lse = fn(q, k, v, return_lse=True)
        return torch.autograd.grad((out * go).sum() + (lse * gl).sum(), (q, k, v, mech.rpb))

    for got, want in zip(grads(mech), grads(mech.reference)):
        assert_close(got, want)


def test_gradcheck_with_bias():
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=12, Nk=12, D=3, requires_grad=True)
    mech = get_mechanism("neighborhood", kernel=3, grid=(3, 4), stride=(1, 2), rpb=True, num_heads=2, tile=(2, 2)).double()
    table = mech.rpb
    assert torch.autograd.gradcheck(lambda a, b, c, t: mech(a, b, c, return_lse=True), (q, k, v, table), fast_mode=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lower_precision_within_tolerance_of_float64(dtype):
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=64, Nk=64, D=16)
    mech = get_mechanism("neighborhood", kernel=5, grid=(8, 8), rpb=True, num_heads=2).double()
    want = mech.reference(q, k, v)
    got = mech.float()(q.to(dtype), k.to(dtype), v.to(dtype))
    assert got.dtype == dtype
    assert_close(got, want, dtype=dtype)


class Collect(Observer):
    def __init__(self, n):
        self.weights = None
        self.seen = None
        self.n = n

    def begin(self, call):
        self.weights = torch.zeros(call.batch, call.heads, self.n, self.n, dtype=torch.float64)
        self.seen = torch.zeros(self.n, self.n, dtype=torch.long)

    def update(self, tile):
        q, kk = tile.q_pos.view(-1, 1), tile.k_pos.view(1, -1)
        self.weights[:, :, q, kk] += tile.weights.to(torch.float64)
        self.seen[q, kk] += 1


def test_observers_see_every_pair_once_with_softmax_weights():
    grid = (6, 7)
    q, k, v = qkv(B=2, Hq=2, Hkv=1, Nq=42, Nk=42, D=8)
    mech = get_mechanism("neighborhood", kernel=3, grid=grid, dilation=(1, 2), rpb=True, num_heads=2, tile=(4, 4)).double()
    meter = Collect(42)
    out = mech(q, k, v, observers=[meter])
    visible = dense_visibility(grid, 3, (1, 2), 1, False)
    assert int(meter.seen[visible].min()) == 1 and int(meter.seen.max()) == 1
    assert torch.equal(meter.weights[0, 0] > 0, visible)
    assert_close(torch.matmul(meter.weights, v.repeat_interleave(2, 1)), out)  # the weights make the output


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(kernel=5, grid=(4, 4)), "exceeds grid"),
        (dict(kernel=3, grid=(8,), stride=4), "stride"),
        (dict(kernel=3, grid=(8, 8, 8, 8)), "grid"),
        (dict(kernel=3, rpb=True), "num_heads"),
        (dict(kernel=0), "kernel"),
        (dict(kernel=3, num_heads=2), "num_heads"),
    ],
)
def test_invalid_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_mechanism("neighborhood", **kwargs)


def test_invalid_calls():
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=16, Nk=16, D=4)
    mech = get_mechanism("neighborhood", kernel=3, grid=(4, 4))
    with pytest.raises(ValueError, match="grid"):
        mech(*qkv(B=1, Hq=2, Hkv=2, Nq=15, Nk=15, D=4))
    with pytest.raises(ValueError, match="Nq"):
        mech(q[:, :, :8], k, v)
    with pytest.raises(ValueError, match="mask"):
        mech(q, k, v, mask=ak.causal())
    with pytest.raises(ValueError, match="score"):
        mech(q, k, v, score=ak.softcap(5.0))
    with pytest.raises(ValueError, match="backend"):
        mech(q, k, v, backend="sdpa")
    with pytest.raises(ValueError, match="rpb"):
        get_mechanism("neighborhood", kernel=3, grid=(4, 4), rpb=True, num_heads=3).double()(q, k, v)


def test_a_causal_neighbourhood_accepts_the_causal_mask_it_implies():
    """A decoder (attnkit.hf, attnkit.nn) always passes causal(); a causal neighbourhood
    already hides every later token, so the call equals the one without the mask."""
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=16, Nk=16, D=4, dtype=torch.float64)
    for grid in ((16,), (4, 4)):
        mech = get_mechanism("neighborhood", kernel=3, grid=grid, causal=True)
        assert_close(mech(q, k, v, mask=ak.causal()), mech(q, k, v))
    with pytest.raises(ValueError, match="mask"):
        get_mechanism("neighborhood", kernel=3, causal=True)(q, k, v, mask=ak.window(2))


@pytest.mark.parametrize("dilation", [1, 2])
def test_causal_1d_window_decodes_takes_padding_and_short_sequences(dilation):
    """A 1-D causal neighbourhood with stride 1 is a dilated sliding window: query i sees
    keys i, i - d, ..., i - (kernel - 1) d (those that exist and are not padding), with
    bias rpb[h, kernel - 1 - (i - j) / d]. Written out per row; the call's queries are
    the last Nq positions (decoding against a cache)."""
    kernel, nq, nk = 3, 4, 11
    q, k, v = qkv(B=2, Hq=2, Hkv=1, Nq=nq, Nk=nk, D=4)
    mech = get_mechanism("neighborhood", kernel=kernel, dilation=dilation, causal=True, rpb=True, num_heads=2).double()
    lengths = [11, 9]
    want = torch.zeros(2, 2, nq, 4, dtype=torch.float64)
    for b, h, r in itertools.product(range(2), range(2), range(nq)):
        i = nk - nq + r
        keys = [i - t * dilation for t in range(kernel) if 0 <= i - t * dilation < lengths[b]]
        if not keys:
            continue
        logits = torch.stack([q[b, h, r] @ k[b, 0, j] / 2 + mech.rpb.detach()[h, kernel - 1 - (i - j) // dilation] for j in keys])
        want[b, h, r] = torch.softmax(logits, 0) @ v[b, 0, keys]
    got = mech(q, k, v, mask=ak.causal() & ak.padding(lengths))
    assert_close(got, want)
    assert_close(mech.reference(q, k, v, mask=ak.causal() & ak.padding(lengths)), want)
    # Rows of batch row 0 (no padding) are the last rows of the full-grid fast path.
    full_q = torch.cat([torch.zeros(2, 2, nk - nq, 4, dtype=torch.float64), q], dim=2)
    assert_close(mech(full_q, k, v, mask=ak.causal())[:1, :, nk - nq :], want[:1])
    # Fewer tokens than kernel * dilation: every query sees what exists.
    short = mech(q[:, :, :2], k[:, :, :2], v[:, :, :2], mask=ak.causal())
    assert short.shape == (2, 2, 2, 4) and bool(torch.isfinite(short).all())
    # Other neighbourhoods depend on the grid's end: no cache.
    with pytest.raises(ValueError, match="only a 1-D causal neighbourhood with stride 1 decodes"):
        get_mechanism("neighborhood", kernel=3)(q, k, v)


def test_observers_of_the_decoding_path():
    """Nq < Nk: the observed weights cover exactly the window (keys i-2..i for kernel 3)
    and reproduce the output."""
    import mechanism_contract as mc

    mech = get_mechanism("neighborhood", kernel=3, causal=True).double()
    mc.observers(mech, mask=ak.causal(), visible_mask=ak.causal() & ak.window(2))
