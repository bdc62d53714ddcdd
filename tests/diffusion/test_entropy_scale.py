"""Entropy-guided attention concentration on the tiny UNet: a factor of 1 is the model,
a factor multiplies exactly that layer's logits (the output equals the literal float64
softmax(factor * q k^T * scale) v from the module's own projections), the calibration's
entropies equal literal dense entropies, and the calibrated factors bring the target
resolution's entropy toward the base resolution's (entropies computed densely here)."""

from __future__ import annotations

import math
from contextlib import nullcontext

import pytest
import torch

pytest.importorskip("diffusers")

import diffusion_tiny as tiny  # noqa: E402
from diffusion_reference import restored  # noqa: E402
from projection_capture import Capture, attention, mean_entropy, probabilities  # noqa: E402

import attnkit.diffusion as ad  # noqa: E402
from helpers import assert_close  # noqa: E402


@pytest.fixture(scope="module")
def peaked():
    """The tiny UNet with its self-attention queries scaled up 10x: random weights attend
    almost uniformly, trained models do not, and matching needs entropy to move."""
    model, inputs = tiny.unet()
    with torch.no_grad():
        for layer in ad.attention_layers(model):
            if layer.kind == "self":
                layer.module.to_q.weight.mul_(10.0)
    text = inputs["encoder_hidden_states"]

    def at(size):
        sample = torch.randn(2, 4, size, size, generator=torch.Generator().manual_seed(0))
        return lambda: model(sample, 3, encoder_hidden_states=text)

    return model, at(8), at(16)


def _heads(model, name):
    return dict(model.named_modules())[name].heads


def _captured(model, run, applied=None):
    """What ``Capture`` saw of ``run()`` (inside ``applied``: a concentration's context),
    per attention module path."""
    with Capture(model) as cap, torch.no_grad(), applied or nullcontext():
        run()
    return cap.seen


def _literal_entropies(model, run, factors=None):
    """Dense entropy of every self-attention layer's latest call, from its projections."""
    captured = _captured(model, run)
    out = {}
    for name in ad.layer_names(model, "self"):
        seen = captured[name]
        factor = 1.0 if factors is None else factors.get(name, 1.0)
        p = probabilities(seen["to_q"], seen["to_k"], _heads(model, name), factor)
        out[name] = (mean_entropy(p), p.shape[-1])
    return out


def test_factor_one_is_the_model(peaked):
    model, base, target = peaked
    with torch.no_grad():
        own = target().sample
        with ad.EntropyConcentration({name: 1.0 for name in ad.layer_names(model, "self")}).apply(model):
            out = target().sample
    assert_close(out, own, torch.float32)


def test_factor_scales_exactly_its_layer(peaked):
    model, base, target = peaked
    chosen = ad.layer_names(model, "self")[1]
    for name, seen in _captured(model, target, ad.EntropyConcentration({chosen: 1.7}).apply(model)).items():
        factor = 1.7 if name == chosen else 1.0
        expected = attention(seen["to_q"], seen["to_k"], seen["to_v"], _heads(model, name), factor)
        assert_close(seen["out"], expected, torch.float32, msg=name)


def test_measured_entropy_equals_dense(peaked):
    model, base, target = peaked
    literal = _literal_entropies(model, base)
    measured = ad.measure_entropy(model, base)
    assert set(measured) == set(literal)
    for name, (h, keys) in literal.items():
        assert measured[name].keys == keys
        assert math.isclose(measured[name].entropy, h, rel_tol=1e-5, abs_tol=1e-5), name


def test_first_round_is_the_closed_form(peaked):
    model, base, target = peaked
    hb, ht = _literal_entropies(model, base), _literal_entropies(model, target)
    one = ad.EntropyConcentration.calibrate(model, base, target, rounds=1)
    for name, factor in one.scales.items():
        log_n = math.log(ht[name][1])
        expected = math.sqrt((log_n - hb[name][0]) / (log_n - ht[name][0]))
        assert math.isclose(factor, expected, rel_tol=1e-4), name
        assert factor > 1  # more image tokens dilute attention: every layer is sharpened


def test_calibrated_factors_move_entropy_to_the_base(peaked):
    model, base, target = peaked
    hb, before = _literal_entropies(model, base), _literal_entropies(model, target)
    conc = ad.EntropyConcentration.calibrate(model, base, target, rounds=3)
    assert len(conc.history) == 3
    # the factors as applied (the previous test shows apply multiplies the logits)
    captured = _captured(model, target, conc.apply(model))
    for name in hb:
        seen = captured[name]
        after = mean_entropy(probabilities(seen["to_q"], seen["to_k"], _heads(model, name), conc.scales[name]))
        gap_before, gap_after = abs(before[name][0] - hb[name][0]), abs(after - hb[name][0])
        assert gap_before > 0.5 and gap_after < 0.25 * gap_before, (name, hb[name][0], before[name][0], after)


def test_errors_and_restore(peaked):
    model, base, target = peaked
    name = ad.layer_names(model, "self")[0]
    for bad in ({}, {name: 0.0}, {name: float("nan")}, {name: True}, {3: 1.0}, [1.0]):
        with pytest.raises(ValueError, match="scales"):
            ad.EntropyConcentration(bad)
    with pytest.raises(ValueError, match="rounds"):
        ad.EntropyConcentration.calibrate(model, base, target, rounds=0)
    with pytest.raises(ValueError, match="run"):
        ad.measure_entropy(model, "not callable")
    with pytest.raises(ValueError, match="run"):
        ad.measure_entropy(model, lambda: None)
    with pytest.raises(ValueError, match="layers"):
        with ad.EntropyConcentration({"down_blocks.0": 2.0}).apply(model):
            pass
    with torch.no_grad():
        own = target().sample
    with pytest.raises(RuntimeError, match="boom"):
        with ad.EntropyConcentration({name: 3.0}).apply(model):
            raise RuntimeError("boom")
    assert restored(model)
    with torch.no_grad():
        assert_close(target().sample, own, torch.float32)


def test_per_head_factors(peaked):
    model, base, target = peaked
    chosen = ad.layer_names(model, "self")[0]
    heads = _heads(model, chosen)
    with pytest.raises(ValueError, match=f"{heads} heads, got {heads + 1} factors"):
        with ad.EntropyConcentration({chosen: [1.0] * (heads + 1)}).apply(model):
            pass
    factors = [0.7, 2.5, 1.0, 1.6][:heads]
    seen = _captured(model, target, ad.EntropyConcentration({chosen: factors}).apply(model))[chosen]
    factor = torch.tensor(factors, dtype=torch.float64).view(heads, 1, 1)
    assert_close(seen["out"], attention(seen["to_q"], seen["to_k"], seen["to_v"], heads, factor), torch.float32)

    hb = {}
    captured = _captured(model, base)
    for name in ad.layer_names(model, "self"):
        p = probabilities(captured[name]["to_q"], captured[name]["to_k"], _heads(model, name))
        hb[name] = [mean_entropy(p[:, j]) for j in range(p.shape[1])]
    conc = ad.EntropyConcentration.calibrate(model, base, target, rounds=3, per_head=True)
    for name, h in hb.items():
        assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5) for a, b in zip(conc.base[name].heads, h))
        first = conc.history[0][name].heads  # the target with every factor 1
        seen = _captured(model, target, conc.apply(model))[name]
        f = torch.tensor(conc.scales[name], dtype=torch.float64).view(-1, 1, 1)
        p = probabilities(seen["to_q"], seen["to_k"], _heads(model, name), f)
        for j in range(p.shape[1]):
            after = mean_entropy(p[:, j])
            assert abs(after - h[j]) < 0.25 * abs(first[j] - h[j]), (name, j, h[j], first[j], after)
