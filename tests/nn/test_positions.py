"""RoPE variants against their formulas and against transformers' independent
implementation of the same scalings; learned positions."""

import math

import pytest
import torch
from literal import rope_complex

from attnkit.nn import LearnedPositions, RopeScaling, RotaryEmbedding, rope_frequencies
from helpers import assert_close


def test_rope_is_complex_rotation_by_position_times_theta():
    rope = RotaryEmbedding(16, base=100.0)
    x = torch.randn(2, 3, 7, 16, dtype=torch.float64)
    pos = torch.arange(7) * 3
    theta = 100.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    assert_close(rope(x, pos), rope_complex(x, pos, theta))


def test_rope_logits_depend_only_on_relative_position():
    rope = RotaryEmbedding(8)
    q, k = torch.randn(2, 1, 1, 1, 8, dtype=torch.float64).unbind(0)

    def logit(m, n):
        return float((rope(q, torch.tensor([m])) * rope(k, torch.tensor([n]))).sum())

    assert math.isclose(logit(3, 1), logit(103, 101), rel_tol=1e-12)
    assert not math.isclose(logit(3, 1), logit(3, 2), rel_tol=1e-3)


def test_partial_rotary_rotates_only_the_leading_dims():
    rope = RotaryEmbedding(16, rotary_dim=6)
    x = torch.randn(1, 2, 5, 16, dtype=torch.float64)
    pos = torch.arange(5)
    out = rope(x, pos)
    assert torch.equal(out[..., 6:], x[..., 6:])
    assert_close(out[..., :6], RotaryEmbedding(6)(x[..., :6], pos))


def test_linear_scaling_is_position_interpolation():
    scaled = RotaryEmbedding(8, scaling=dict(kind="linear", factor=4.0))
    x = torch.randn(1, 1, 6, 8, dtype=torch.float64)
    pos = torch.arange(6) * 4
    assert_close(scaled(x, pos), RotaryEmbedding(8)(x, pos // 4))


def test_ntk_aware_scaling_changes_the_base():
    s, d, base = 8.0, 16, 10000.0
    inv_freq, factor = rope_frequencies(d, base, RopeScaling("ntk", s))
    new_base = base * s ** (d / (d - 2))
    assert_close(inv_freq, new_base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d))
    assert factor == 1.0
    # The highest frequency is unchanged; the lowest is divided by exactly s.
    plain, _ = rope_frequencies(d, base)
    assert inv_freq[0] == plain[0]
    assert math.isclose(float(plain[-1] / inv_freq[-1]), s, rel_tol=1e-12)


def _hf(kind, head_dim, base, params):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": kind, "rope_theta": base, **params},
    )
    inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    return inv_freq.double(), factor


@pytest.mark.parametrize("factor, original, fast, slow, truncate", [(4.0, 2048, 32, 1, True), (16.0, 512, 16, 2, False)])
def test_yarn_equals_transformers(factor, original, fast, slow, truncate):
    scaling = RopeScaling("yarn", factor, original, beta_fast=fast, beta_slow=slow, truncate=truncate)
    inv_freq, attn = rope_frequencies(64, 10000.0, scaling)
    want, want_attn = _hf(
        "yarn",
        64,
        10000.0,
        dict(factor=factor, original_max_position_embeddings=original, beta_fast=fast, beta_slow=slow, truncate=truncate),
    )
    # transformers computes in float32: compare at float32 tolerance.
    assert_close(inv_freq, want, dtype=torch.float32)
    assert math.isclose(attn, want_attn, rel_tol=1e-7)
    assert math.isclose(attn, 0.1 * math.log(factor) + 1, rel_tol=1e-12)  # YaRN's sqrt(1/t)


def test_yarn_keeps_fast_dims_and_interpolates_slow_ones():
    plain, _ = rope_frequencies(64)
    yarn, _ = rope_frequencies(64, scaling=RopeScaling("yarn", 8.0, 1024))
    assert yarn[0] == plain[0]
    assert math.isclose(float(plain[-1] / yarn[-1]), 8.0, rel_tol=1e-12)
    assert bool(((yarn <= plain) & (yarn >= plain / 8)).all())


def test_linear_equals_transformers():
    inv_freq, _ = rope_frequencies(32, 500.0, RopeScaling("linear", 3.0))
    want, _ = _hf("linear", 32, 500.0, dict(factor=3.0))
    assert_close(inv_freq, want, dtype=torch.float32)


def test_yarn_attention_factor_scales_q_and_k():
    rope = RotaryEmbedding(8, scaling=dict(kind="yarn", factor=4.0, original_max_len=64))
    x = torch.randn(1, 1, 3, 8, dtype=torch.float64)
    pos = torch.arange(3)
    assert_close(rope(x, pos), rope_complex(x, pos, rope.inv_freq, factor=0.1 * math.log(4.0) + 1))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kind="dynamic", factor=2.0), "rope scaling kind"),
        (dict(kind="linear", factor=0.5), "rope scaling factor: expected a number >= 1"),
        (dict(kind="yarn", factor=2.0), "rope scaling original_max_len"),
    ],
)
def test_bad_scaling(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RopeScaling(**kwargs)


def test_bad_rope_calls():
    with pytest.raises(ValueError, match="rotary_dim: expected an even int"):
        RotaryEmbedding(8, rotary_dim=5)
    rope = RotaryEmbedding(8)
    with pytest.raises(ValueError, match=r"positions: expected integer positions of shape \(N,\) or \(B, N\) with N=4"):
        rope(torch.randn(1, 1, 4, 8), torch.arange(3))
    with pytest.raises(ValueError, match=r"x: expected \(B, H, N, head_dim=8\)"):
        rope(torch.randn(1, 4, 8), torch.arange(4))


def test_learned_positions():
    pos = LearnedPositions(10, 4)
    assert torch.equal(pos(torch.tensor([3, 7])), pos.weight[[3, 7]])
    with pytest.raises(ValueError, match="positions: learned positions cover 0..9"):
        pos(torch.tensor([10]))
