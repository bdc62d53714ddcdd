"""InitNO (arXiv 2404.04650): its scores against literal float64 formulas on dense maps
from the default processors' q and k, and the noise optimisation's contract (lower
score, noise kept near the standard Gaussian, valid noise left alone)."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("diffusers")

import diffusion_tiny as tiny  # noqa: E402
from diffusion_reference import dense_maps, recorded, restored, smooth_literal, softmax64  # noqa: E402

import attnkit.diffusion as ad  # noqa: E402
from attnkit.diffusion.attend_excite import PAPER_SIGMA  # noqa: E402
from attnkit.diffusion.initno import gaussian_kl  # noqa: E402
from helpers import assert_close  # noqa: E402

T = tiny.TEXT
TOKENS = [2, 3]
GRID = (8, 6)  # the tiny UNet's finest latent grid


def _unet_call():
    model, inputs = tiny.unet()
    return model, inputs["sample"], inputs["timestep"], inputs["encoder_hidden_states"]


def _literal_scores(calls, gate=0.5):
    """cross: 1 - peak of the smoothed, re-normalised map, worst token; self: overlap of
    the smoothed self-attention maps at the tokens' peaks (float64, dense P of every
    self-attention call at the 8 x 6 grid, mean over heads and layers)."""
    maps = dense_maps(calls, tiny.MAP_LAYOUTS["unet"][0], GRID)
    renorm = torch.softmax(100 * maps[:, 1:], dim=1)
    smoothed = torch.stack([smooth_literal(renorm[:, t - 1], PAPER_SIGMA) for t in TOKENS], 1)  # (B, K, h, w)
    peak, where = smoothed.flatten(2).max(-1)
    cross = (1 - peak).clamp_min(0).max(1).values
    rows, count = 0, 0
    for name, q, k, scale in calls:
        if name.endswith("attn1") and q.shape[2] == 48:
            p = softmax64(q, k, scale)  # (B, H, 48, 48)
            rows = rows + torch.stack([p[b, :, where[b]] for b in range(p.shape[0])]).sum(1)  # (B, K, 48)
            count += q.shape[1]
    selfs = smooth_literal((rows / count).reshape(-1, len(TOKENS), *GRID), PAPER_SIGMA)
    a, b = selfs[:, 0].flatten(1), selfs[:, 1].flatten(1)
    conflict = torch.minimum(a, b).sum(1) / ((a + b).sum(1) + 1e-6)
    conflict = torch.where(cross <= gate, conflict, torch.zeros_like(conflict))
    return cross, conflict, where


def test_scores_equal_literal_dense_scores():
    model, z, t, text = _unet_call()
    with torch.no_grad():
        _, calls = recorded(model, lambda: model(z, t, encoder_hidden_states=text))
    for gate in (1.0, 0.5):  # 1.0: the conflict counts; 0.5: gated off on these rows (cross > 0.5)
        cross, conflict, where = _literal_scores(calls, gate)
        got = ad.initno_scores(model, z, t, text, TOKENS, self_gate=gate)
        assert torch.equal(got.peaks, where)
        assert_close(got.cross, cross, torch.float32)
        assert_close(got.self, conflict, torch.float32)
        assert_close(got.joint, cross + conflict, torch.float32)
    assert float(conflict.abs().max()) == 0.0 and float(_literal_scores(calls, 1.0)[1].min()) > 0.1


def test_initno_lowers_the_score_and_keeps_the_noise_near_gaussian():
    model, z, t, text = _unet_call()
    kl_limit = 1e-3
    result = ad.initno(model, z, t, text, TOKENS, steps=8, lr=5e-2, kl_limit=kl_limit, self_gate=1.0)
    start = ad.initno_scores(model, z, t, text, TOKENS, self_gate=1.0)
    assert_close(result.start.joint, start.joint.detach(), torch.float32)
    assert bool((result.scores.joint < result.start.joint - 1e-3).all()), (result.start.joint, result.scores.joint)
    # the scores reported are those of the noise returned
    again = ad.initno_scores(model, result.latents, t, text, TOKENS, self_gate=1.0)
    assert_close(again.joint.detach(), result.scores.joint, torch.float32)
    # z = z0 * exp(log_var / 2) + mu, with the KL of (mu, log_var) per element held under the limit
    assert_close(result.latents, z * torch.exp(0.5 * result.log_var) + result.mu, torch.float32)
    kl = (-0.5 * (1 + result.log_var - result.mu**2 - result.log_var.exp())).flatten(1).mean(1)
    assert_close(gaussian_kl(result.mu, result.log_var), kl, torch.float32)
    assert bool((kl <= kl_limit * (1 + 1e-4)).all())
    # Near Gaussian: KL <= 1e-3 per element bounds mean(mu^2) <= 2e-3 and the rms of
    # (sigma^2 - 1) to ~0.063, so each row's sample mean moves by at most ~0.05 + 0.03 from
    # the start noise's, its variance by ~13 %; a row of n = 192 standard normal draws has
    # a sample mean of sd 1/sqrt(n) = 0.072 and a variance of sd sqrt(2/n) = 0.10 (4 sd margins).
    n = z[0].numel()
    for row in range(z.shape[0]):
        out = result.latents[row]
        assert abs(float(out.mean() - z[row].mean())) <= math.sqrt(2 * kl_limit) + 0.04
        assert abs(float(out.mean())) <= 4 / math.sqrt(n) + math.sqrt(2 * kl_limit) + 0.04
        assert abs(float(out.var()) - 1) <= 4 * math.sqrt(2 / n) + 0.15
    assert len(result.history) == 8


def test_valid_noise_is_returned_unchanged():
    model, z, t, text = _unet_call()
    result = ad.initno(model, z, t, text, TOKENS, cross_threshold=2.0, self_threshold=2.0, steps=5)
    assert torch.equal(result.latents, z) and bool(result.succeeded.all()) and len(result.history) == 1


def test_bad_arguments_are_refused_and_the_model_restored():
    model, z, t, text = _unet_call()
    with pytest.raises(ValueError, match="prompt_embeds"):
        ad.initno(model, z, t, text[:1], TOKENS)
    with pytest.raises(ValueError):
        ad.initno(model, z, t, text, TOKENS, steps=0)
    with pytest.raises(ValueError, match="no_such"):
        ad.initno(model, z, t, text, TOKENS, no_such=1)
    with pytest.raises(ValueError, match="self_layers"):  # the mid block's self-attention runs at 4 x 3, not 8 x 6
        ad.initno_scores(model, z, t, text, TOKENS, self_layers=[n for n in ad.layer_names(model, "self") if "mid" in n])
    assert restored(model)


@pytest.mark.parametrize("name,image", [("sd3", slice(0, 16)), ("flux", slice(T, T + 24))])
def test_self_maps_of_joint_attention_equal_dense_rows(name, image):
    """The image-key block of the joint softmax row (text keys take their share) of
    chosen image queries, mean over heads and layers."""
    model, inputs = tiny.MODELS[name]()
    grid = (4, 4) if name == "sd3" else (4, 6)
    positions = torch.tensor([[0, 5], [7, 2]])
    with torch.no_grad():
        _, calls = recorded(model, lambda: tiny.run(model, inputs))
    total, count = 0, 0
    for _path, q, k, scale in calls:
        p = softmax64(q, k, scale)[:, :, image, image]
        total = total + torch.stack([p[b, :, positions[b]] for b in range(2)]).sum(1)
        count += q.shape[1]
    expected = (total / count).reshape(2, 2, *grid)
    with torch.no_grad(), ad.record_maps(model, self_layers=None) as rec:
        tiny.run(model, inputs)
        got = rec.self_maps(positions, grid)
    assert_close(got, expected, torch.float32)
