"""The CPU operators (kernels/cpu/, ``torch.ops.attnkit``) against float64 PyTorch, and
the tile loops that use them against their own PyTorch path (operators disabled)."""

from __future__ import annotations

import math
import os

import pytest
import torch
from tests.helpers import assert_close, qkv

import attnkit
from attnkit import mods as M
from attnkit.kernels import chunked_attention, cpu, make_request
from attnkit.kernels.cpu import mixed as cpu_mixed
from attnkit.mechanisms import get_mechanism

# exp(x) in float32 carries the rounding of its argument, |x| * 2^-24 relative, plus a few
# ulps of the polynomial: inputs below stay within |x| <= 40, so 40 * 6e-8 + 1e-6 < 4e-6.
EXP_RTOL = 4e-6


@pytest.fixture(autouse=True, scope="module")
def built():
    if os.environ.get("ATTNKIT_NATIVE") == "0":
        pytest.skip("ATTNKIT_NATIVE=0: the C loops are switched off, the PyTorch paths run instead")
    if cpu.build.compiler().endswith("not found"):
        pytest.skip("no C++ compiler on this machine: the PyTorch paths run instead")
    assert cpu.available(), f"a C++ compiler is present but the operators did not build: {cpu.status().reason}"


def logits(seed=0, shape=(3, 5, 67)):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(shape, generator=g) * 8
    s[0, 0, :5] = -math.inf  # masked logits
    s[1, 2, :] = -math.inf  # a row with no visible key in this tile
    return s


def test_sigmoid_matches_float64():
    s = logits()
    got = cpu.sigmoid_(s.clone(), -3.0)
    want = torch.sigmoid(s.double() - 3.0)
    torch.testing.assert_close(got.double(), want, rtol=EXP_RTOL, atol=0)
    assert bool((got[1, 2] == 0).all()) and bool((got[0, 0, :5] == 0).all())


def test_sigmoid_extremes_and_nan():
    s = torch.tensor([1e4, -1e4, 88.0, -88.0, 0.0, math.nan, math.inf, -math.inf, 1.0])
    got = cpu.sigmoid_(s.clone(), 0.0)
    assert got[0] == 1.0 and got[6] == 1.0 and got[1] == 0.0 and got[7] == 0.0 and got[4] == 0.5
    assert math.isnan(got[5])
    torch.testing.assert_close(got[[2, 3, 8]].double(), torch.sigmoid(s[[2, 3, 8]].double()), rtol=EXP_RTOL, atol=1e-38)


def test_softcap_matches_float64():
    s = logits().clamp(min=-60)
    got = cpu.softcap_(s.clone(), 30.0)
    want = 30.0 * torch.tanh(s.double() / 30.0)
    # |cap * tanh| <= 30: absolute error of a few float32 ulps of 30
    torch.testing.assert_close(got.double(), want, rtol=0, atol=30 * EXP_RTOL)
    big = cpu.softcap_(torch.tensor([1e6, -1e6, -math.inf, math.nan]), 5.0)
    assert big[0] == 5.0 and big[1] == -5.0 and big[2] == -5.0 and math.isnan(big[3])


def test_abs_boost_matches_float64():
    """PAI's s + t |s| in one pass: one rounding of the result (the C loop's fused
    multiply-add), -inf kept (hidden keys stay hidden), NaN kept."""
    s = logits()
    s[2, 1, 3] = math.nan
    t = torch.rand(3, 67, generator=torch.Generator().manual_seed(1)) * 2
    t[:, :10] = 0.0  # keys the boost leaves alone
    got = cpu.abs_boost_(s.clone(), t)
    want = torch.where(torch.isneginf(s), s, s.double() + t.double().unsqueeze(1) * s.double().abs())
    torch.testing.assert_close(got.double(), want, rtol=2**-24, atol=0, equal_nan=True)
    torch.testing.assert_close(got[..., :10], s[..., :10], rtol=0, atol=0, equal_nan=True)  # t = 0: bit for bit
    assert bool(torch.isneginf(got[0, 0, :5]).all()) and bool(torch.isneginf(got[1, 2]).all()) and math.isnan(got[2, 1, 3])


def test_online_softmax_step_matches_float64():
    s = logits(1)
    m = torch.full(s.shape[:-1], -math.inf)
    m[0] = 4.0  # rows with a running max from earlier tiles
    l = torch.zeros(s.shape[:-1])
    l[0] = 2.5
    m0, l0 = m.double().clone(), l.double().clone()
    p = s.clone()
    alpha = cpu.online_softmax_step_(p, m, l)

    m_new = torch.maximum(m0, s.double().amax(-1))
    live = ~torch.isneginf(m_new)
    m_safe = torch.where(live, m_new, 0.0)
    p_want = torch.exp(s.double() - m_safe[..., None])
    assert torch.equal(m.double(), m_new)
    torch.testing.assert_close(p.double(), p_want, rtol=EXP_RTOL, atol=0)
    torch.testing.assert_close(alpha[live].double(), torch.exp(m0 - m_safe)[live], rtol=EXP_RTOL, atol=0)
    torch.testing.assert_close(l.double(), l0 * torch.exp(m0 - m_safe) + p_want.sum(-1), rtol=1e-5, atol=0)
    # the row that has seen no key keeps m = -inf, l = 0 and contributes nothing
    assert torch.isneginf(m[1, 2]) and l[1, 2] == 0 and bool((p[1, 2] == 0).all())


def test_stick_breaking_matches_float64():
    z = logits(2)
    z[2, 1, 40:] = 30.0  # beta rounds to 1 in float32: 1 - beta must still be sigmoid(-z)
    carry = torch.rand(z.shape[:-1], generator=torch.Generator().manual_seed(4))
    c0 = carry.double().clone()
    a = cpu.stick_breaking_(z.clone(), carry)
    zd = z.double()
    # literal, in float64: A_j = sigmoid(z_j) * c0 * prod_{k > j} sigmoid(-z_k)
    rest = torch.sigmoid(-zd)
    after = torch.cat([rest.flip(-1).cumprod(-1).flip(-1)[..., 1:], torch.ones_like(rest[..., :1])], dim=-1)
    want = torch.sigmoid(zd) * after * c0[..., None]
    # products of up to 67 factors, each within ~2 ulp (2.4e-7): about 1e-5 relative at most
    torch.testing.assert_close(a.double(), want, rtol=1e-5, atol=1e-30)
    torch.testing.assert_close(carry.double(), c0 * rest.prod(-1), rtol=1e-5, atol=1e-30)
    assert bool((a[0, 0, :5] == 0).all()) and bool((a[1, 2] == 0).all())  # hidden keys take nothing


@pytest.mark.parametrize("shape,kernel", [((1, 3, 20, 150), (6, 11)), ((2, 2, 7, 64), (1, 1)), ((1, 1, 5, 9), (5, 9))])
def test_depthwise_conv2d_matches_float64(shape, kernel):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(shape, generator=g)
    w = torch.randn(shape[1], *kernel, generator=g)
    want = torch.nn.functional.conv2d(x.double(), w.double().unsqueeze(1), groups=shape[1])
    # sums of cq * ck <= 66 products of unit-scale terms: float32 rounding ~ 66 * 6e-8 * |term|
    torch.testing.assert_close(cpu.depthwise_conv2d(x, w).double(), want, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("mask", [None, M.causal(), M.window(37), M.window(20, 15)], ids=repr)
@pytest.mark.parametrize("cap", [0.0, 5.0])
@pytest.mark.parametrize("boosted", [False, True], ids=["", "abs-boost"])
def test_softmax_attention_matches_reference(mask, cap, boosted):
    """The C softmax forward: GQA, Nq != Nk (bottom-right), Dv != D, band masks, softcap,
    PAI's abs boost (per batch row, head and key; zero on some keys)."""
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Nq=150, Nk=333, D=8, Dv=24, dtype=torch.float32, seed=2)
    table = None
    if boosted:
        table = torch.rand(2, 4, 333, generator=torch.Generator().manual_seed(3)) * (torch.arange(333) % 3 > 0)
    band = (None, None) if mask is None else mask.band()
    out, lse = cpu.softmax_attention(q, k, v, 0.3, 333 - 150, band, cap, boost=table)
    parts = ([M.softcap(cap)] if cap else []) + ([M.abs_boost(table.double())] if boosted else [])
    score = M.as_score(parts) if parts else None
    want, want_lse = attnkit.attention(
        q.double(), k.double(), v.double(), mask=mask, score=score, scale=0.3, backend="reference", return_lse=True
    )
    assert_close(out, want, torch.float32)
    assert_close(lse, want_lse, torch.float32)


def test_softmax_attention_head_maps_and_dead_rows():
    """Explicit query -> key / value head maps; queries whose band holds no key get zeros
    and lse = -inf."""
    q, k, v = qkv(B=1, Hq=3, Hkv=2, Nq=40, Nk=40, D=8, dtype=torch.float32, seed=4)
    kmap, vmap = torch.tensor([1, 0, 1]), torch.tensor([0, 0, 1])
    out, lse = cpu.softmax_attention(q, k, v, 0.5, 0, (-30, -10), k_heads=kmap, v_heads=vmap)
    for j in range(3):
        want, want_lse = attnkit.attention(
            q[:, j : j + 1].double(),
            k[:, kmap[j] : kmap[j] + 1].double(),
            v[:, vmap[j] : vmap[j] + 1].double(),
            mask=lambda b, h, qi, ki: (ki - qi >= -30) & (ki - qi <= -10),
            scale=0.5,
            backend="reference",
            return_lse=True,
        )
        assert_close(out[:, j : j + 1], want, torch.float32)
        assert_close(lse[:, j : j + 1, 10:], want_lse[..., 10:], torch.float32)
    assert bool((out[:, :, :10] == 0).all()) and bool(torch.isneginf(lse[:, :, :10]).all())


@pytest.mark.parametrize("cols,k", [(4096, 64), (300, 7), (70, 64), (64, 64), (100, 1), (1000, 250)])
def test_topk_rows_matches_torch(cols, k):
    """The k largest of every row, as a set: same values as torch.topk, distinct columns that
    hold them; rows with masked tails (the causal diagonal), fully masked groups, ties."""
    g = torch.Generator().manual_seed(cols + k)
    s = torch.randn(6, 5, cols, generator=g)
    s[0, :, cols // 3 :] = -math.inf  # most of the row masked: fewer visible than k in some rows
    s[1, 0] = 1.0  # every entry tied
    s[2, :, -min(cols - k, 127) :] = -math.inf
    values, columns = cpu.topk_rows(s, k)
    want = s.topk(k, dim=-1).values
    assert torch.equal(values.sort(dim=-1, descending=True).values, want)
    assert torch.equal(s.gather(-1, columns), values)
    assert all(len(set(row.tolist())) == k for row in columns.reshape(-1, k))


def test_usable_only_for_untracked_contiguous_float32():
    x = torch.zeros(4, 8)
    assert cpu.usable(x)
    assert not cpu.usable(x.double())
    assert not cpu.usable(x.t())
    assert not cpu.usable(x.requires_grad_())
    with torch.no_grad():
        assert cpu.usable(x)


# ---------------------------------------------------------------- callers, with and without


def _mixed(name):
    mech = get_mechanism(name, num_heads=4)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in mech.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))  # away from the identity
    return mech


CASES = {  # name: (mechanism, mask, score, engine or None)
    "tiled softcap": ("softmax", M.causal() & M.window(200), M.softcap(5.0), "tiled"),
    "sigmoid": ("sigmoid", M.causal(), None, None),
    "signed (engine online softmax)": ("signed", M.causal(), M.softcap(5.0), None),
    "talking heads (head mixing)": ("talking_heads", M.causal(), None, None),
    "multi-token (two-pass softmax)": ("multi_token", M.causal(), None, None),
    "stick-breaking": ("stick_breaking", M.window(150), None, None),
}


def _run(name, dtype=torch.float32, backend="auto"):
    mech, mask, score, engine = CASES[name]
    q, k, v = qkv(B=1, Hq=4, Hkv=2, Nq=300, Nk=300, D=16, dtype=dtype, seed=3)
    if engine is not None and backend != "reference":
        return chunked_attention(make_request(q, k, v, mask=mask, score=score), engine=engine)[0]
    if mech in ("talking_heads", "multi_token"):
        mech = _mixed(mech)
    return attnkit.attention(q, k, v, mask=mask, score=score, mechanism=mech, backend=backend)


@pytest.mark.parametrize("name", list(CASES))
def test_callers_agree_with_their_pytorch_path(name, monkeypatch):
    with torch.no_grad():
        fast = _run(name)
        monkeypatch.setattr(cpu, "usable", lambda *tensors: False)
        slow = _run(name)
    assert_close(fast, slow, torch.float32)


@pytest.mark.parametrize("name", list(CASES))
def test_callers_match_reference(name):
    with torch.no_grad():
        got = _run(name)
        want = _run(name, torch.float64, backend="reference")
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize("mask", [M.causal(), M.window(150)], ids=repr)
@pytest.mark.parametrize("mechanism", ["stick_breaking", "talking_heads"])
def test_gradients_through_c_loops_match_reference(mechanism, mask, monkeypatch):
    """float32 forward and backward through the C loops (stick-breaking's tiles, the head
    mixing and its input gradient) against float64 autograd of the reference, and against
    the PyTorch path; mixing matrices get their gradients too."""
    q, k, v = qkv(B=1, Hq=4, Hkv=2, Nq=300, Nk=300, D=16, dtype=torch.float32, seed=8)
    go = torch.randn(1, 4, 300, 16, generator=torch.Generator().manual_seed(9))

    def grads(dtype, backend, operators_on=True):
        with monkeypatch.context() as patch:
            if not operators_on:
                patch.setattr(cpu, "usable", lambda *tensors: False)
            mech = _mixed(mechanism).to(dtype) if mechanism == "talking_heads" else mechanism
            ins = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
            out = attnkit.attention(*ins, mask=mask, mechanism=mech, backend=backend)
            params = list(mech.parameters()) if mechanism == "talking_heads" else []
            return torch.autograd.grad(out, ins + params, go.to(dtype))

    fast, slow, want = grads(torch.float32, "auto"), grads(torch.float32, "auto", False), grads(torch.float64, "reference")
    # q, k, v. Stick-breaking's weights are exp of a running sum of up to 300 log(1 - sigmoid)
    # terms of size ~1: float32 rounds that exponent to ~300 * 6e-8 * 1 ~ 2e-5, and the
    # gradients add up 300 such weights, so 2e-4 relative; head mixing sums no such chain
    tol = dict(rtol=2e-4, atol=2e-4) if mechanism == "stick_breaking" else dict(rtol=2e-5, atol=2e-5)
    for f, s_, w in list(zip(fast, slow, want))[:3]:
        torch.testing.assert_close(f.double(), w, **tol)
        torch.testing.assert_close(f, s_, **tol)
    for f, s_, w in list(zip(fast, slow, want))[3:]:  # the mixing matrices
        # Each entry sums 300 x 300 products whose size is that of the largest entries, so
        # one that cancels to ~1e-4 is known only to float32 rounding at the tensor's scale
        # (how the sum is ordered, e.g. AVX2 against no vectorisation, moves it by ~3e-5)
        scale = float(w.abs().max())
        torch.testing.assert_close(f.double(), w, rtol=2e-5, atol=2e-5 * scale)
        torch.testing.assert_close(f, s_, rtol=2e-5, atol=2e-5 * scale)


@pytest.mark.parametrize("shape,kernel", [((1, 3, 20, 150), (6, 11)), ((2, 2, 9, 40), (3, 5))])
def test_key_query_conv_gradients_in_c(shape, kernel):
    """Multi-token's convolution backward in C (the flipped kernel over the padded gradient;
    one dot product per tap) against float64 autograd of torch's conv2d."""
    from attnkit.mechanisms.multi_token import KeyQueryConv

    g = torch.Generator().manual_seed(11)
    s = torch.randn(shape, generator=g).requires_grad_()
    w = torch.randn(shape[1], 1, *kernel, generator=g).requires_grad_()
    out = KeyQueryConv.apply(s, w)
    dz = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, (s, w), dz)
    sd, wd = (t.detach().double().requires_grad_() for t in (s, w))
    want = torch.autograd.grad(torch.nn.functional.conv2d(sd, wd, groups=shape[1]), (sd, wd), dz.double())
    # sums of up to R x C (3000) products for the kernel gradient: float32 rounding ~ sqrt(n) * 6e-8 relative
    torch.testing.assert_close(got[0].double(), want[0], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(got[1].double(), want[1], rtol=1e-5, atol=1e-4)


def _c_mixed(name, heads, ch=None, pre=True, post=True):
    from attnkit.mechanisms.multi_token import MultiToken
    from attnkit.mechanisms.talking_heads import TalkingHeads

    mech = MultiToken(heads, 3, 5, ch) if name == "multi_token" else TalkingHeads(heads, pre, post)
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for p in mech.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))  # away from the identity
    return mech


MIXED_C = {  # id: (mechanism, Hq, Hkv)
    "multi-token, groups of 2 inside key groups of 1": (lambda: _c_mixed("multi_token", 4, 2), 4, 4),
    "multi-token, no mixing, GQA 2": (lambda: _c_mixed("multi_token", 4, 1), 4, 2),
    "multi-token, groups of 2 inside key groups of 3": (lambda: _c_mixed("multi_token", 6, 2), 6, 2),
    "multi-token, one group over MQA": (lambda: _c_mixed("multi_token", 4, 4), 4, 1),
    "talking heads, pre and post": (lambda: _c_mixed("talking_heads", 4), 4, 2),
    "talking heads, pre only": (lambda: _c_mixed("talking_heads", 4, post=False), 4, 4),
    "talking heads, post only": (lambda: _c_mixed("talking_heads", 4, pre=False), 4, 1),
}


@pytest.mark.parametrize("case", list(MIXED_C))
@pytest.mark.parametrize("mask", [None, M.causal(), M.window(20, 15)], ids=repr)
@pytest.mark.parametrize("blocks", [((16, 24), (8, 16)), ((16, 5), (9, 4))], ids=["tiles wider", "blocks taller"])
def test_mixed_softmax_c_loop_forward_and_backward(case, mask, blocks, monkeypatch):
    """The whole call in C (kernels/cpu/loops_mixed.cpp), float32, against float64 autograd of
    the mechanism's reference: values and the gradients of q, k, v and every learned
    kernel and matrix; GQA with mixing groups smaller, equal and larger than a key head's
    group, a band that reaches future keys, Nq < Nk, Dv != D, blocks and tiles cut small
    (also blocks taller than a tile is wide), and three threads (sharing key heads, and for
    talking heads' single group per batch row, its queries)."""
    ran = []
    for name in ("mixed_softmax_attention", "mixed_softmax_attention_backward"):
        real = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, _real=real, _name=name, **kw: ran.append(_name) or _real(*a, **kw))
    monkeypatch.setattr(cpu_mixed, "mixed_blocks", lambda group: blocks)  # rows of a block past a tile's band: nothing visible
    make, heads, kv_heads = MIXED_C[case]
    mech = make()
    q, k, v = qkv(B=2, Hq=heads, Hkv=kv_heads, Nq=41, Nk=57, D=8, Dv=12, dtype=torch.float32, seed=6)
    go = torch.randn(2, heads, 41, 12, generator=torch.Generator().manual_seed(7))

    def grads(dtype, backend):
        m = mech.to(dtype)
        ins = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = m(*ins, mask=mask, backend=backend)
        return [out, *torch.autograd.grad(out, ins + list(m.parameters()), go.to(dtype))]

    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # more threads than talking heads' (batch, group) rows: they split queries too
    try:
        got = grads(torch.float32, "auto")
    finally:
        torch.set_num_threads(threads)
    want = grads(torch.float64, "reference")
    assert ran == ["mixed_softmax_attention", "mixed_softmax_attention_backward"]
    for g, w in zip(got, want):
        assert_close(g, w, torch.float32)
