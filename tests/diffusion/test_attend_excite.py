"""Differentiable per-token maps (record_maps) and Attend-and-Excite (arXiv 2301.13826)
against dense references computed in the test from the q and k of the model's default
processors: maps in float64, gradients by autograd through those dense maps."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("diffusers")

import diffusion_tiny as tiny  # noqa: E402
from diffusion_reference import dense_maps, excite_literal, recorded, restored, smooth_literal  # noqa: E402

import attnkit.diffusion as ad  # noqa: E402
from attnkit.diffusion.attend_excite import PAPER_SIGMA, gaussian_smooth  # noqa: E402
from helpers import assert_close  # noqa: E402

T = tiny.TEXT
CASES = tiny.MAP_LAYOUTS  # name -> (layout, grid)
FIELD = {"unet": "sample"}  # the latents' argument; the transformers' is hidden_states


@pytest.mark.parametrize("name", list(CASES))
def test_recorded_maps_equal_dense_maps(name):
    model, inputs = tiny.MODELS[name]()
    layout, size = CASES[name]
    with torch.no_grad():
        _, calls = recorded(model, lambda: tiny.run(model, inputs))
    expected = dense_maps(calls, layout, size)
    with ad.record_maps(model) as rec:
        tiny.run(model, inputs)
        got = rec.maps()
    assert got.shape == (2, T, *size) and got.requires_grad
    assert_close(got, expected, torch.float32)
    assert restored(model)


def _literal_loss(maps, weights):
    # nonlinear in the maps, touching every token and position
    return (maps * weights).sum() + maps[:, 2].amax((-2, -1)).sum() + (maps[:, 1] ** 2).sum()


@pytest.mark.parametrize("name", ["unet", "sd3"])
def test_gradients_reach_the_latents_as_dense_autograd(name):
    model, inputs = tiny.MODELS[name]()
    layout, size = CASES[name]
    field = FIELD.get(name, "hidden_states")
    weights = torch.randn(2, T, *size, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    z = inputs[field].clone().requires_grad_(True)
    _, calls = recorded(model, lambda: tiny.run(model, {**inputs, field: z}))
    (expected,) = torch.autograd.grad(_literal_loss(dense_maps(calls, layout, size), weights), z)

    z2 = inputs[field].clone().requires_grad_(True)
    with ad.record_maps(model) as rec:
        tiny.run(model, {**inputs, field: z2})
        loss = _literal_loss(rec.maps().double(), weights)
    (got,) = torch.autograd.grad(loss, z2)
    assert expected.abs().max() > 1e-6  # the gradient is not trivially zero
    # float32 model and maps against float64 maps on the same float32 graph: errors of a
    # few float32 ulps of the largest entry, summed over the ~10^2 paths into each latent
    torch.testing.assert_close(got.double(), expected.double(), atol=1e-5 * float(expected.abs().max()), rtol=1e-4)


def test_layers_and_heads_restrict_the_recorded_maps():
    model, inputs = tiny.sd3()
    only = "transformer_blocks.1.attn"
    with torch.no_grad():
        _, calls = recorded(model, lambda: tiny.run(model, inputs))
    calls = [(n, q[:, 1:2], k[:, 1:2], s) for n, q, k, s in calls]
    expected = dense_maps(calls, lambda n, nq, nk: tiny.sd3_layout(n, nq, nk) if n == only else None, (4, 4))
    with torch.no_grad(), ad.record_maps(model, layers=[only], heads=[1]) as rec:
        tiny.run(model, inputs)
        got = rec.maps()
    assert_close(got, expected, torch.float32)
    with pytest.raises(ValueError, match="layers"):
        with ad.record_maps(model, layers=["transformer_blocks.1"]):
            pass
    with pytest.raises(ValueError, match="heads"):
        with torch.no_grad(), ad.record_maps(model, heads=[7]):
            tiny.run(model, inputs)
    assert restored(model)


def test_record_maps_restores_the_model_after_an_error():
    model, inputs = tiny.unet()
    with pytest.raises(RuntimeError, match="boom"):
        with ad.record_maps(model, self_layers=None):
            tiny.run(model, inputs)
            raise RuntimeError("boom")
    assert restored(model)


def test_smoothing_and_excite_loss_equal_literal_formulas():
    g = torch.Generator().manual_seed(3)
    maps = torch.rand(2, T, 4, 5, generator=g, dtype=torch.float64) / T
    for sigma in (0.5, PAPER_SIGMA):
        assert_close(gaussian_smooth(maps, sigma), smooth_literal(maps, sigma), torch.float64)
    got = ad.excite_loss(maps, [2, 4])
    assert_close(got, excite_literal(maps, [2, 4], PAPER_SIGMA), torch.float64)
    # the paper's kernel: its code writes exp(-((x - mu) / (2 * 0.5))**2)
    x = torch.arange(3, dtype=torch.float64) - 1
    paper = torch.exp(-((x / (2 * 0.5)) ** 2))
    ours = torch.exp(-(x**2) / (2 * PAPER_SIGMA**2))
    assert_close(ours / ours.sum(), paper / paper.sum(), torch.float64)
    for bad in (dict(tokens=[0]), dict(tokens=[T]), dict(tokens=[1], span=(2, T))):
        with pytest.raises(ValueError):
            ad.excite_loss(maps, **bad)


def _unet_call():
    model, inputs = tiny.unet()
    return model, inputs["sample"], inputs["timestep"], inputs["encoder_hidden_states"]


def test_loss_through_the_model_equals_the_dense_loss():
    model, z, t, text = _unet_call()
    got = ad.attend_and_excite_loss(model, z, t, text, [2, 3])
    with torch.no_grad():
        _, calls = recorded(model, lambda: model(z, t, encoder_hidden_states=text))
    expected = excite_literal(dense_maps(calls, CASES["unet"][0], (8, 6)), [2, 3], PAPER_SIGMA)
    assert_close(got, expected, torch.float32)


def test_a_step_lowers_the_loss_of_every_row():
    model, z, t, text = _unet_call()
    step = ad.attend_and_excite_step(model, z, t, text, [2, 3], step_size=20.0)
    before = ad.attend_and_excite_loss(model, z, t, text, [2, 3]).detach()
    after = ad.attend_and_excite_loss(model, step.latents, t, text, [2, 3]).detach()
    assert step.updates == 1
    assert_close(step.losses[0], before, torch.float32)
    assert bool((after < before - 1e-3).all()), (before, after)
    # refinement: repeated steps until the target or the iteration cap
    refined = ad.attend_and_excite_step(model, z, t, text, [2, 3], step_size=20.0, threshold=0.9, max_iterations=4)
    assert refined.updates == 4 and len(refined.losses) == 4
    last = ad.attend_and_excite_loss(model, refined.latents, t, text, [2, 3]).detach()
    assert bool((last < after).all())


def test_rows_below_their_target_are_left_unchanged():
    model, z, t, text = _unet_call()
    loss = ad.attend_and_excite_loss(model, z, t, text, [2, 3]).detach()
    # a threshold whose target 1 - threshold lies above both rows' loss: nothing moves
    step = ad.attend_and_excite_step(model, z, t, text, [2, 3], threshold=1 - (float(loss.max()) + 1e-3), max_iterations=5)
    assert step.updates == 0 and torch.equal(step.latents, z)
    # between the two rows: the lower row stays exactly, the other moves
    low, high = int(loss.argmin()), int(loss.argmax())
    middle = float(loss.min() + loss.max()) / 2
    step = ad.attend_and_excite_step(model, z, t, text, [2, 3], threshold=1 - middle)
    assert torch.equal(step.latents[low], z[low]) and not torch.equal(step.latents[high], z[high])


def test_bad_arguments_are_refused():
    model, z, t, text = _unet_call()
    for kwargs in (dict(threshold=1.5), dict(max_iterations=0)):
        with pytest.raises(ValueError):
            ad.attend_and_excite_step(model, z, t, text, [2], **kwargs)
    with pytest.raises(ValueError, match="prompt_embeds"):
        ad.attend_and_excite_step(model, z, t, text[:1], [2])
    with pytest.raises(ValueError, match="tokens"):
        ad.attend_and_excite_loss(model, z, t, text, [T + 1])
    with pytest.raises(ValueError, match="no_such_option"):
        ad.AttendAndExcite([2], no_such_option=1)
    assert restored(model)


def test_callback_refines_the_pipeline_latents(tiny_pipeline):
    pipe, call = tiny_pipeline
    call = {**call, "output_type": "latent"}

    def run(**extra):
        return pipe(**call, generator=torch.Generator().manual_seed(0), **extra).images

    base = run()
    idle = ad.AttendAndExcite([2, 3], steps=0)  # alters no step: the base pipeline
    assert torch.equal(run(callback_on_step_end=idle, callback_on_step_end_tensor_inputs=idle.tensor_inputs), base)
    aae = ad.AttendAndExcite([2, 3], thresholds={}, scale_factor=20.0)
    out = run(callback_on_step_end=aae, callback_on_step_end_tensor_inputs=aae.tensor_inputs)
    assert [i for i, _ in aae.history] == [1]  # 2 steps: the latents of step 1 are refined after step 0
    assert (out - base).abs().max() > 1e-4
    latents = torch.randn(1, 4, 2, 2, generator=torch.Generator().manual_seed(1)).repeat(1, 1, 4, 4)
    prepared = aae.prepare(pipe, latents, call["prompt_embeds"], num_inference_steps=2)
    assert prepared.shape == latents.shape and not torch.equal(prepared, latents)
    assert aae.history[-1][0] == 0
    assert restored(pipe.unet)
    assert math.isfinite(float(out.abs().max()))


def test_a_module_with_another_logit_scale_is_refused():
    model, inputs = tiny.pixart()
    layer = ad.attention_layers(model)[1]  # transformer_blocks.0.attn2
    layer.module.scale = 1.0  # as Attention(scale_qk=False) declares it
    try:
        with pytest.raises(ValueError, match="scale"):
            with torch.no_grad(), ad.record_maps(model, layers=[layer.name]):
                tiny.run(model, inputs)
    finally:
        layer.module.scale = 8**-0.5
    assert restored(model)


def test_grid_keeps_only_the_calls_at_that_grid():
    model, inputs = tiny.unet()
    with torch.no_grad():
        _, calls = recorded(model, lambda: tiny.run(model, inputs))
    mid_only = lambda n, nq, nk: (slice(None), slice(None), (4, 3)) if n.endswith("attn2") and nq == 12 else None  # noqa: E731
    coarse = dense_maps(calls, mid_only, (4, 3))
    with torch.no_grad(), ad.record_maps(model, grid=(4, 3)) as rec:
        tiny.run(model, inputs)
        got = rec.maps()
    assert rec.grids == [(4, 3)]
    assert_close(got, coarse, torch.float32)
    with pytest.raises(ValueError, match="grid"):
        with torch.no_grad(), ad.record_maps(model, grid=(16, 16)) as rec:
            tiny.run(model, inputs)
            rec.maps()
    with pytest.raises(ValueError, match="grid"):
        with ad.record_maps(model, grid=16):
            pass
