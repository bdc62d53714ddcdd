"""attnkit.nn.Attention: every option against the literal dense formula (literal.py),
float64, TOL[float64]; every registered mechanism runs and trains inside the layer."""

import pytest
import torch
from literal import attention_layer

import attnkit as ak
from attnkit.mechanisms import available, get_mechanism
from attnkit.nn import Attention, RotaryEmbedding
from helpers import assert_close

D_MODEL = 32

OPTIONS = {
    "mha": dict(),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "head_dim": dict(head_dim=12),
    "rope": dict(rope=True),
    "partial rope + yarn": dict(rope=dict(rotary_dim=4, scaling=dict(kind="yarn", factor=4.0, original_max_len=8))),
    "qk_norm": dict(qk_norm=True, rope=True),
    "gate headwise": dict(gate="headwise"),
    "gate elementwise": dict(gate="elementwise", n_kv_heads=2),
    "sinks": dict(sinks=True),
    "bias": dict(bias=True),
    "alibi": dict(alibi=True),
    "window": dict(window=3, rope=True),
    "bidirectional": dict(causal=False),
    "bidirectional window": dict(causal=False, window=2),
}


def layer_with(**kwargs):
    torch.manual_seed(0)
    layer = Attention(D_MODEL, 4, **kwargs).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)  # non-trivial norms, gates, sinks and biases
    return layer


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_each_option_equals_the_literal_formula(option):
    layer = layer_with(**OPTIONS[option])
    x = torch.randn(2, 11, D_MODEL, dtype=torch.float64)
    assert_close(layer(x), attention_layer(layer, x))


def test_explicit_positions_per_batch_row():
    layer = layer_with(rope=True)
    x = torch.randn(2, 6, D_MODEL, dtype=torch.float64)
    shifted = torch.arange(6) + 10
    rows = torch.stack([torch.arange(6), shifted])
    out = layer(x, positions=rows)
    assert_close(out[0], attention_layer(layer, x[:1])[0])
    assert_close(out[1], attention_layer(layer, x[1:], positions=shifted)[0])
    # RoPE logits depend on relative positions only: a shift changes nothing here.
    assert_close(out[1], layer(x[1:])[0])


def test_extra_mask_is_anded_with_the_layers_own():
    layer = layer_with(rope=True)
    x = torch.randn(1, 9, D_MODEL, dtype=torch.float64)
    assert_close(layer(x, mask=ak.window(2)), layer_with(rope=True, window=2)(x))


def test_output_dropout_only_in_training():
    layer = layer_with(dropout=0.5)
    x = torch.randn(1, 8, D_MODEL, dtype=torch.float64)
    assert_close(layer.eval()(x), attention_layer(layer, x))
    out = layer.train()(x)
    assert 0.2 < float((out == 0).double().mean()) < 0.8


# Mechanisms whose defaults do not fit a causal layer say what they need.
MECHANISM_SETUP = {
    "neighborhood": dict(causal=False, mechanism_params=dict(kernel=3, rpb=True)),
    "top_theta": dict(mechanism_params=dict(thresholds=torch.full((4,), -0.5))),
}


@pytest.mark.parametrize("name", available())
def test_every_registered_mechanism_runs_and_trains_in_the_layer(name):
    setup = dict(MECHANISM_SETUP.get(name, {}))
    torch.manual_seed(0)
    layer = Attention(D_MODEL, 4, n_kv_heads=2, mechanism=name, rope=True, **setup)
    assert isinstance(layer.mechanism, torch.nn.Module) and layer.mechanism.name == name
    x = torch.randn(2, 10, D_MODEL, requires_grad=True)
    out = layer(x)
    assert out.shape == (2, 10, D_MODEL) and bool(torch.isfinite(out).all())
    out.square().mean().backward()
    assert x.grad.abs().sum() > 0
    # The mechanism is a submodule: its parameters (if any) get gradients and are saved.
    names = {n for n, _ in layer.named_parameters()}
    for n, p in layer.mechanism.named_parameters():
        assert f"mechanism.{n}" in names
        assert p.grad is not None


def test_a_mechanism_instance_is_used_as_given():
    mech = get_mechanism("sigmoid", bias=-1.0)
    layer = Attention(D_MODEL, 4, mechanism=mech)
    assert layer.mechanism is mech


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_kv_heads=3), "n_kv_heads: must divide n_heads=4"),
        (dict(gate="channel"), "gate: expected None, 'headwise' or 'elementwise'"),
        (dict(window=-1), "window: expected a non-negative int"),
        (dict(dropout=1.0), r"dropout: expected a probability in \[0, 1\)"),
        (dict(rope="yes"), "rope: expected None, True"),
        (dict(mechanism="nope"), "mechanism: unknown name 'nope'"),
        (dict(latent=dict(kv_rank=8), n_kv_heads=2), "latent: MLA has its own key/value heads"),
        (dict(head_dim=0), "head_dim: expected a positive int"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Attention(D_MODEL, 4, **kwargs)


def test_bad_input_shape():
    with pytest.raises(ValueError, match=r"x: expected \(B, N, d_model=32\)"):
        Attention(D_MODEL, 4)(torch.randn(2, 5, 16))


def test_rope_module_instance_is_shared():
    rope = RotaryEmbedding(8)
    layer = Attention(D_MODEL, 4, rope=rope)
    assert layer.rope is rope
