"""attnkit.attention / attnkit.explain: dispatch, bad input, edge cases."""

import math
import re

import pytest
import torch
import torch.nn.functional as F

import attnkit as ak
from helpers import assert_close, qkv


def test_plain_calls_equal_torch_sdpa():
    q, k, v = qkv(B=2, Hq=4, Hkv=4, Nq=50, Nk=50, D=16, dtype=torch.float32)
    assert_close(ak.attention(q, k, v), F.scaled_dot_product_attention(q, k, v))
    assert_close(ak.attention(q, k, v, mask=ak.causal()), F.scaled_dot_product_attention(q, k, v, is_causal=True))
    q, k, v = qkv(B=2, Hq=8, Hkv=2, Nq=50, Nk=50, D=16, dtype=torch.float32)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for backend in ("auto", "sdpa", "chunked", "reference"):
        assert_close(ak.attention(q, k, v, mask=ak.causal(), backend=backend), want)


def test_decoding_against_a_cache_is_bottom_right_aligned():
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=40, Nk=40, D=8)
    full = ak.attention(q, k, v, mask=ak.causal())
    last = ak.attention(q[:, :, -3:], k, v, mask=ak.causal())
    assert_close(last, full[:, :, -3:])
    one = ak.attention(q[:, :, -1:], k, v, mask=ak.causal(), backend="sdpa")
    assert_close(one, full[:, :, -1:])


def test_return_lse_through_sdpa_and_chunked_agree():
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=30, Nk=30, D=8, dtype=torch.float32)
    _, lse_sdpa = ak.attention(q, k, v, mask=ak.causal(), return_lse=True, backend="sdpa")
    _, lse_ref = ak.attention(q, k, v, mask=ak.causal(), return_lse=True, backend="reference")
    assert_close(lse_sdpa, lse_ref)


def test_sinks_are_an_extra_zero_valued_key():
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=12, Nk=12, D=4)
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    got = ak.attention(q, k, v, mask=ak.causal(), sinks=sinks)
    # One extra key per head: its logit is the sink, its value zero.
    logits = torch.cat([torch.matmul(q, k.transpose(-1, -2)) / 2.0, sinks.view(1, 2, 1, 1).expand(1, 2, 12, 1)], -1)
    causal = torch.ones(12, 13, dtype=torch.bool).tril()
    causal[:, -1] = True
    p = torch.softmax(logits.masked_fill(~causal, -math.inf), -1)
    want = p[..., :-1] @ v
    assert_close(got, want)


# ----------------------------------------------------------------- empty and degenerate


@pytest.mark.parametrize("Nq,Nk", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences(Nq, Nk):
    q, k, v = qkv(B=2, Hq=2, Hkv=1, Nq=Nq, Nk=Nk, D=4, Dv=3, requires_grad=True)
    out, lse = ak.attention(q, k, v, mask=ak.causal(), return_lse=True)
    assert out.shape == (2, 2, Nq, 3) and lse.shape == (2, 2, Nq)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.equal(t.grad, torch.zeros_like(t))


def test_empty_keys_with_sinks_put_all_mass_on_the_sink():
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=3, Nk=0, D=4)
    sinks = torch.tensor([1.0, 2.0], dtype=torch.float64)
    out, lse = ak.attention(q, k, v, sinks=sinks, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, sinks.view(1, 2, 1).expand(1, 2, 3))


@pytest.mark.parametrize("backend", ["auto", "chunked", "reference"])
def test_fully_masked_rows_never_nan(backend):
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=600, Nk=600, D=8, dtype=torch.float32, requires_grad=True)
    out, lse = ak.attention(q, k, v, mask=~ak.causal() & ak.window(None, 3), return_lse=True, backend=backend)
    assert torch.equal(out[:, :, -1], torch.zeros_like(out[:, :, -1])) and torch.isneginf(lse[:, :, -1]).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


# ----------------------------------------------------------------- bad input


def err(fragment):
    return pytest.raises(ValueError, match=re.escape(fragment))


def test_shape_errors_name_the_argument():
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Nq=8, Nk=8, D=4)
    with err("q: expected a 4-D tensor of shape (B, Hq, Nq, D), got shape (4, 8, 4)"):
        ak.attention(q[0], k, v)
    with err("k, v: batch size must equal q's B=2"):
        ak.attention(q, k[:1], v[:1])
    with err("k: head dim must equal q's D=4"):
        ak.attention(q, k[..., :3], v)
    with err("v: expected shape (B, Hkv, Nk, Dv) = (2, 2, 8, Dv)"):
        ak.attention(q, k, v[:, :, :7])
    with err("query heads Hq=4 must be a multiple of key/value heads Hkv=3"):
        ak.attention(q, torch.randn(2, 3, 8, 4, dtype=torch.float64), torch.randn(2, 3, 8, 4, dtype=torch.float64))
    with err("q, k, v: dtypes differ"):
        ak.attention(q.float(), k, v)
    with err("q: expected dtype float16, bfloat16, float32 or float64, got torch.int64"):
        ak.attention(q.long(), k.long(), v.long())
    with err("q, k, v: devices differ"):
        ak.attention(q.to("meta"), k, v)
    with pytest.raises(TypeError, match="v: expected a torch.Tensor"):
        ak.attention(q, k, v.tolist())


def test_option_errors_name_the_argument():
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=8, Nk=8, D=4)
    with err("scale: expected a finite Python number"):
        ak.attention(q, k, v, scale=float("nan"))
    with err("sinks: expected a float tensor of shape (Hq,) = (2,)"):
        ak.attention(q, k, v, sinks=torch.zeros(3))
    with err("sinks: contains NaN or inf"):
        ak.attention(q, k, v, sinks=torch.tensor([0.0, math.inf], dtype=torch.float64))
    with err("backend: expected 'auto' or one of"):
        ak.attention(q, k, v, backend="cuda")
    with err("backend='sdpa' cannot run this call: mask window(left=2, right=0) is not expressible"):
        q32, k32, v32 = qkv(B=1, Hq=2, Hkv=2, Nq=32, Nk=32, D=4)  # above 16 queries: no dense mask
        ak.attention(q32, k32, v32, mask=ak.window(2), backend="sdpa")
    with err("backend='flex' cannot run this call: FlexAttention has no backward on CPU"):
        ak.attention(q.requires_grad_(), k, v, backend="flex")


def test_nan_inputs_raise_naming_the_input_unless_disabled():
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=8, Nk=8, D=4)
    k = k.clone()
    k[0, 1, 3, 2] = math.nan
    with err("k: contains NaN or inf (first at index [0, 1, 3, 2])"):
        ak.attention(q, k, v)
    out = ak.attention(q, k, v, check_finite=False)
    assert torch.isnan(out[0, 1]).all() and torch.isfinite(out[0, 0]).all()


# ----------------------------------------------------------------- explain


def test_explain_names_backend_and_reason():
    q, k, v = qkv(B=1, Hq=8, Hkv=8, Nq=2048, Nk=2048, D=16, dtype=torch.float32)
    text = ak.explain(q, k, v, mask=ak.causal())
    assert text.startswith("backend: sdpa") and "reduces to torch SDPA" in text
    text = ak.explain(q, k, v, mask=ak.window(256))
    assert text.startswith("backend: chunked") and "not sdpa: mask window(left=256, right=0)" in text
    assert "tiles skipped" in text and "chunked/fused" in text
    text = ak.explain(q, k, v, mask=ak.causal(), score=ak.softcap(30.0))
    assert "chunked/tiled: score mod softcap(30) is not affine" in text
    assert "empty sequence" in ak.explain(q[:, :, :0], k, v)


def test_mechanism_argument():
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=8, Nk=8, D=4)
    assert_close(ak.attention(q, k, v, mechanism="softmax", mask=ak.causal()), ak.attention(q, k, v, mask=ak.causal()))
    with err("mechanism: unknown name 'nope'"):
        ak.attention(q, k, v, mechanism="nope")


# ----------------------------------------------------------------- wrong numbers (issue 13)
# The classes are covered by tests/properties; these are the reported reproducers, at the
# default tile sizes (N = 300 crosses the 256-row query blocks).


def _literal(q, k, v, visible=None, bias=None, scale=None, sinks=None):
    """float64 softmax attention written out: (out, lse)."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q.double() @ k.double().mT) * scale
    if bias is not None:
        s = s + bias
    if visible is not None:
        s = s.masked_fill(~visible, -math.inf)
    z = s if sinks is None else torch.cat([s, sinks.double().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], -1)
    lse = torch.logsumexp(z, -1)
    return torch.nan_to_num(torch.exp(s - lse.unsqueeze(-1))) @ v.double(), lse


@pytest.mark.parametrize("layout", ["mT", "every_other"])
def test_inputs_with_a_strided_last_dimension(layout):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 300, 16, generator=g) for _ in range(3))
    strided = q.mT.contiguous().mT if layout == "mT" else torch.stack([q, q], -1).flatten(-2)[..., ::2]
    assert strided.stride(-1) != 1 and torch.equal(strided, q)
    for kw in (dict(mask=ak.window(20)), dict(score=ak.alibi(2)), dict(backend="chunked")):
        assert torch.equal(ak.attention(strided, k, v, **kw), ak.attention(q, k, v, **kw))


def test_minus_inf_in_a_bias_hides_the_key_and_adds_no_phantom_key():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 300, 8, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(1, 1, 300, 300, generator=g, dtype=torch.float64)
    bias[..., 256, 256] = -math.inf  # a query-block boundary
    bias[..., 5, :] = -math.inf  # a row the bias hides completely
    causal = torch.ones(300, 300, dtype=torch.bool).tril()
    sinks = torch.tensor([0.7], dtype=torch.float64, requires_grad=True)
    out, lse = ak.attention(q, k, v, mask=ak.causal(), score=ak.bias(bias), return_lse=True)
    want, want_lse = _literal(q, k, v, causal, bias)
    assert_close(out, want)
    assert torch.isneginf(lse[0, 0, 5]) and torch.equal(out[0, 0, 5], torch.zeros(8, dtype=torch.float64))
    finite = torch.isfinite(want_lse)
    assert_close(lse[finite], want_lse[finite])
    out, lse = ak.attention(q, k, v, mask=ak.causal(), score=ak.bias(bias), sinks=sinks, return_lse=True)
    want, want_lse = _literal(q, k, v, causal, bias, sinks=sinks)
    assert_close(lse, want_lse)
    assert lse[0, 0, 5] == sinks.detach()[0]
    (got_ds,) = torch.autograd.grad(out.sum() + lse.sum(), sinks)
    (want_ds,) = torch.autograd.grad(want.sum() + want_lse.sum(), sinks)
    assert_close(got_ds, want_ds)


@pytest.mark.parametrize("chain", ["alibi>>temperature", "bias>>temperature", "alibi>>log_length_scale"])
def test_learnable_scale_after_a_fixed_bias_gets_its_whole_gradient(chain):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g, dtype=torch.float64) for _ in range(3))
    t = torch.tensor([1.3, 0.8], dtype=torch.float64, requires_grad=True)
    slopes = torch.tensor([0.25, 0.0625], dtype=torch.float64)
    dist = (torch.arange(40).view(-1, 1) - torch.arange(40)).abs().double()
    fixed = (
        -slopes.view(1, 2, 1, 1) * dist
        if chain.startswith("alibi")
        else torch.randn(1, 2, 40, 40, generator=g, dtype=torch.float64)
    )
    first = ak.alibi(slopes=slopes) if chain.startswith("alibi") else ak.bias(fixed)
    s = (q @ k.mT) / math.sqrt(8) + fixed
    if chain.endswith("temperature"):
        out = ak.attention(q, k, v, score=first >> ak.temperature(t))
        want = torch.softmax(s / t.view(1, 2, 1, 1), -1) @ v
    else:
        out = ak.attention(q, k, v, score=first >> ak.log_length_scale(t))
        want = torch.softmax(s * t.view(1, 2, 1, 1) * torch.log(torch.arange(1, 41).double()).view(1, 1, -1, 1), -1) @ v
    assert_close(out, want)
    assert_close(torch.autograd.grad(out.sum(), t)[0], torch.autograd.grad(want.sum(), t)[0])


def test_python_number_mods_are_float64_in_a_float64_call():
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=40, Nk=40, D=8)
    _, lse = ak.attention(q, k, v, score=ak.temperature(0.3), return_lse=True)
    torch.testing.assert_close(lse, torch.logsumexp((q @ k.mT) / math.sqrt(8) / 0.3, -1), atol=1e-12, rtol=1e-12)
    _, lse = ak.attention(q, k, v, mask=ak.causal(), score=ak.log_length_scale(0.3), return_lse=True)
    factor = 0.3 * torch.log(torch.arange(1, 41).double()).view(1, 1, -1, 1)
    s = ((q @ k.mT) / math.sqrt(8) * factor).masked_fill(~torch.ones(40, 40, dtype=torch.bool).tril(), -math.inf)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("backend", ["auto", "chunked", "reference"])
@pytest.mark.parametrize("where", ["k", "v"])
def test_nan_in_padding_never_reaches_the_output(backend, where):
    q, k, v = qkv(B=2, Hq=2, Hkv=2, Nq=300, Nk=300, D=8, dtype=torch.float32, requires_grad=True)
    lengths = torch.tensor([300, 270])
    visible = (torch.arange(300) < lengths.view(2, 1, 1, 1)).expand(2, 2, 300, 300)
    want, _ = _literal(q.detach(), k.detach(), v.detach(), visible)
    bad = {"k": k.detach().clone(), "v": v.detach().clone()}[where]
    bad[1, :, 280] = math.nan
    args = (q, bad.requires_grad_(), v) if where == "k" else (q, k, bad.requires_grad_())
    out = ak.attention(*args, mask=ak.padding(lengths), backend=backend)
    assert_close(out, want)
    grads = torch.autograd.grad(out.sum(), args)
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("n", [1, 5, 40, 300])
def test_a_nan_query_is_reported_at_every_size(n):
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=n, Nk=n, D=8, dtype=torch.float32)
    q[0, 1, n // 2, 3] = math.nan
    for backend in ("auto", "sdpa", "chunked", "reference"):
        with err("q: contains NaN or inf"):
            ak.attention(q, k, v, backend=backend)
