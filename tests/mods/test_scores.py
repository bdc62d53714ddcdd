"""Score mods against their formulas written out per element."""

import math

import pytest
import torch

import attnkit as ak
from attnkit.mods import affine_form, alibi_slopes, as_score, index_tensors


def apply(mod, B=1, H=4, Nq=6, Nk=9, s=None):
    mod = as_score(mod).bind(B, H, Nq, Nk)
    b, h, q, k = index_tensors(B, H, Nk - Nq, Nq, 0, Nk)
    s = torch.randn(B, H, Nq, Nk, dtype=torch.float64) if s is None else s
    return s, mod(s, b, h, q, k).expand(B, H, Nq, Nk)


def per_element(s, f):
    B, H, Nq, Nk = s.shape
    out = torch.empty_like(s)
    for b in range(B):
        for h in range(H):
            for i in range(Nq):
                for j in range(Nk):
                    out[b, h, i, j] = f(float(s[b, h, i, j]), b, h, Nk - Nq + i, j)
    return out


def test_alibi_slopes_follow_the_paper():
    # Press et al.: for 8 heads the slopes are 1/2, 1/4, ..., 1/256.
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    # 6 heads: the 4-head slopes, then every other slope of the 8-head sequence.
    four = [2.0 ** (-2 * (i + 1)) for i in range(4)]
    assert torch.allclose(alibi_slopes(6), torch.tensor(four + [2.0**-1, 2.0**-3]))


def test_alibi_is_minus_slope_times_distance():
    slopes = alibi_slopes(4).double()
    s, got = apply(ak.alibi(4))
    want = per_element(s, lambda x, b, h, i, j: x - float(slopes[h]) * abs(i - j))
    torch.testing.assert_close(got, want)


def test_softcap_temperature_and_chains():
    s, got = apply(ak.softcap(3.0) >> ak.temperature(torch.tensor([1.0, 2.0, 4.0, 0.5], dtype=torch.float64)))
    t = [1.0, 2.0, 4.0, 0.5]
    want = per_element(s, lambda x, b, h, i, j: 3.0 * math.tanh(x / 3.0) / t[h])
    torch.testing.assert_close(got, want)
    s, got = apply([ak.temperature(2.0), ak.alibi(4)])
    slopes = alibi_slopes(4).double()
    want = per_element(s, lambda x, b, h, i, j: x / 2.0 - float(slopes[h]) * abs(i - j))
    torch.testing.assert_close(got, want)


def test_log_length_scale_is_scalable_softmax():
    s, got = apply(ak.log_length_scale(0.5))
    want = per_element(s, lambda x, b, h, i, j: x * 0.5 * math.log(i + 1))
    torch.testing.assert_close(got, want)
    s, got = apply(ak.log_length_scale(0.5, causal=False))
    torch.testing.assert_close(got, s * 0.5 * math.log(9))


def t5_bucket(rel, num_buckets, max_distance, bidirectional):
    """T5's bucketing, from the paper's description, one integer at a time."""
    n = num_buckets // 2 if bidirectional else num_buckets
    offset = n if (bidirectional and rel > 0) else 0
    dist = abs(rel) if bidirectional else max(-rel, 0)
    exact = n // 2
    if dist < exact:
        return offset + dist
    far = exact + int(math.log(dist / exact) / math.log(max_distance / exact) * (n - exact))
    return offset + min(far, n - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_bias_buckets_match_t5(bidirectional):
    table = torch.randn(16, 3, dtype=torch.float64)
    mod = ak.relative_bias(table, num_buckets=16, max_distance=40, bidirectional=bidirectional)
    s, got = apply(mod, H=3, Nq=50, Nk=60, s=torch.zeros(1, 3, 50, 60, dtype=torch.float64))
    want = per_element(s, lambda x, b, h, i, j: float(table[t5_bucket(j - i, 16, 40, bidirectional), h]))
    torch.testing.assert_close(got, want)


def test_dense_bias_aligns_rows_with_queries():
    t = torch.randn(2, 1, 4, 9, dtype=torch.float64)
    s, got = apply(ak.bias(t), B=2, Nq=4, Nk=9)
    torch.testing.assert_close(got, s + t)


def test_affine_form_splits_scales_and_biases():
    form = affine_form(ak.alibi(4) >> ak.temperature(2.0) >> ak.bias(torch.zeros(1, 1, 6, 9)))
    assert len(form.scales) == 1 and len(form.terms) == 2
    assert len(form.terms[0][1]) == 1 and form.terms[1][1] == []  # alibi is scaled by the later temperature
    assert affine_form(ak.softcap(2.0)) is None
    assert affine_form(ak.alibi(4) >> (lambda s, b, h, q, k: s)) is None


def test_alibi_separable_form_equals_dense_bias():
    mod = ak.alibi(4).bind(1, 4, 8, 8)
    h, q, k = torch.arange(4), torch.arange(20, 28), torch.arange(0, 20)
    row, col = mod.separable(None, h, q, k, "left")
    dense = mod.bias(None, h.view(1, -1, 1, 1), q.view(1, 1, -1, 1), k.view(1, 1, 1, -1))[0]
    torch.testing.assert_close(row[:, :, None] + col[:, None, :], dense)
    k = torch.arange(30, 40)
    row, col = mod.separable(None, h, q, k, "right")
    dense = mod.bias(None, h.view(1, -1, 1, 1), q.view(1, 1, -1, 1), k.view(1, 1, 1, -1))[0]
    torch.testing.assert_close(row[:, :, None] + col[:, None, :], dense)


@pytest.mark.parametrize(
    "make,fragment",
    [
        (lambda: ak.softcap(0), "softcap(cap)"),
        (lambda: ak.softcap(float("inf")), "softcap(cap)"),
        (lambda: ak.temperature(-1.0), "temperature(t): must be > 0"),
        (lambda: ak.temperature(torch.tensor([[1.0]])), "temperature(t)"),
        (lambda: ak.alibi(), "alibi: give num_heads"),
        (lambda: ak.relative_bias(torch.randn(8)), "relative_bias(table)"),
        (lambda: ak.relative_bias(torch.randn(8, 2), max_distance=2), "relative_bias(max_distance)"),
        (lambda: ak.bias(torch.randn(3, 3)), "bias(tensor)"),
        (lambda: ak.log_length_scale(float("nan")), "log_length_scale(scale)"),
    ],
)
def test_bad_score_arguments_are_named(make, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        make()


@pytest.mark.parametrize(
    "score,fragment",
    [
        (ak.alibi(3), "alibi(slopes): has 3 values but the call has Hq=4"),
        (ak.temperature(torch.ones(2)), "temperature(t): has 2 values"),
        (ak.relative_bias(torch.randn(8, 2)), "relative_bias(table): has 2 heads"),
        (ak.bias(torch.randn(1, 1, 5, 5)), "bias(tensor): has shape (1, 1, 5, 5) but the call needs"),
    ],
)
def test_score_mods_check_call_sizes(score, fragment):
    q = torch.randn(1, 4, 6, 8)
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        ak.attention(q, q, q, score=score)


def test_score_type_errors():
    q = torch.randn(1, 1, 4, 4)
    with pytest.raises(TypeError, match="score: expected"):
        ak.attention(q, q, q, score=3)
    with pytest.raises(TypeError, match="mask: expected"):
        ak.attention(q, q, q, mask="causal")


def test_python_numbers_are_kept_in_float64():
    assert ak.temperature(0.3).t.dtype == torch.float64
    assert ak.log_length_scale(0.3).scale.dtype == torch.float64
    s, got = apply(ak.temperature(0.3))
    torch.testing.assert_close(got, s / 0.3, atol=0, rtol=1e-15)  # 0.3 not rounded to float32


def test_minus_inf_from_a_bias_stays_a_mask_under_later_row_scales():
    B, H, Nq, Nk = 1, 2, 5, 5
    table = torch.zeros(1, 1, Nq, Nk, dtype=torch.float64)
    table[..., 0, :] = -math.inf  # query 0 (n = 1 key: log n = 0) fully hidden
    table[..., 3, 1] = -math.inf
    t = torch.tensor([0.5, 2.0], dtype=torch.float64, requires_grad=True)
    s = torch.randn(B, H, Nq, Nk, dtype=torch.float64)
    for later in (ak.log_length_scale(t), ak.temperature(t)):
        _, got = apply(ak.bias(table) >> later, B, H, Nq, Nk, s)
        assert torch.equal(torch.isneginf(got), torch.isneginf(table).expand_as(got))  # never NaN, never finite
        (grad,) = torch.autograd.grad(got.masked_fill(torch.isneginf(got), 0.0).sum(), t)
        assert torch.isfinite(grad).all()


def test_abs_boost_formula_and_bad_tables():
    """PAI's s + t |s| per (b, h, key), a hidden key kept hidden; a table that is not a
    float (B, H, Nk) tensor, or does not fit the call, is refused by name."""
    from attnkit.mods import abs_boost

    table = torch.tensor([[[0.0, 0.5, 2.0]]], dtype=torch.float64)
    s = torch.tensor([[[[-2.0, -2.0, 3.0], [1.0, -math.inf, -1.0]]]], dtype=torch.float64)
    b, h, q, kv = index_tensors(1, 1, 0, 2, 0, 3)
    got = abs_boost(table)(s, b, h, q, kv)
    want = torch.tensor([[[[-2.0, -1.0, 9.0], [1.0, -math.inf, 1.0]]]], dtype=torch.float64)
    assert torch.equal(got, want)
    for bad in ([0.5], torch.zeros(2, 3), torch.zeros(1, 1, 3, dtype=torch.long)):
        with pytest.raises(ValueError, match="abs_boost\\(table\\)"):
            abs_boost(bad)
    with pytest.raises(ValueError, match="abs boost: table of shape"):
        abs_boost(table).check(2, 1, 2, 3)
