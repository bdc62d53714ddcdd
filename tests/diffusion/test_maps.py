"""Per-token cross-attention maps (TokenMaps, attnkit.diffusion.maps) against dense maps
computed in the test from the q and k the model's default processors pass to SDPA."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("diffusers")

import attnkit.diffusion as ad  # noqa: E402
import diffusion_tiny as tiny  # noqa: E402
from attnkit.observe import Entropy  # noqa: E402
from diffusion_reference import Record, dense_maps  # noqa: E402

T = tiny.TEXT


def _cross_only(grids):
    def layout(name, nq, nk):
        return (slice(None), slice(None), grids[nq]) if name.endswith("attn2") else None

    return layout


def _sd3(name, nq, nk):
    n_img = nq - T  # [image; text]
    return slice(0, n_img), slice(n_img, n_img + T), (4, 4)


def _flux(name, nq, nk):
    return slice(T, None), slice(0, T), (4, 6)  # [text; image], double- and single-stream


CASES = {
    "unet": (_cross_only({48: (8, 6), 12: (4, 3)}), (8, 6)),
    "pixart": (_cross_only({16: (4, 4)}), (4, 4)),
    "sd3": (_sd3, (4, 4)),
    "sd3_qknorm": (_sd3, (4, 4)),
    "flux": (_flux, (4, 6)),
}


def _recorded(model, inputs):
    rec = Record(model)
    try:
        with torch.no_grad(), rec:
            tiny.run(model, inputs)
    finally:
        rec.close()
    return rec.calls


@pytest.mark.parametrize("name", list(CASES))
def test_maps_equal_dense_maps(name):
    model, inputs = tiny.MODELS[name]()
    layout, size = CASES[name]
    expected = dense_maps(_recorded(model, inputs), layout, size)
    meter = ad.TokenMaps()
    with torch.no_grad(), ad.use(model, observers=[meter]):
        tiny.run(model, inputs)
    got = meter.maps()
    assert got.shape == (2, T, *size)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)
    # state: one (B, T, h*w) float64 sum per grid, never N_image^2
    assert meter.state_bytes() == sum(2 * T * h * w * 8 for h, w in meter.grids)


def test_layers_heads_and_steps_restrict_the_maps():
    model, inputs = tiny.sd3()
    second = {**inputs, "hidden_states": inputs["hidden_states"].flip(-1)}
    calls = _recorded(model, second)
    only = "transformer_blocks.1.attn"

    def head1_of_layer1(name, nq, nk):
        return _sd3(name, nq, nk) if name == only else None

    layers = {layer.name: layer.index for layer in ad.attention_layers(model)}
    meter = ad.TokenMaps(layers=[layers[only]], heads=[1], steps=[1])
    with torch.no_grad(), ad.use(model, observers=[meter]) as switch:
        tiny.run(model, inputs)  # step 0: left out
        tiny.run(model, second)  # step 1
    assert switch.step == 1
    calls = [(n, q[:, 1:2], k[:, 1:2], s) for n, q, k, s in calls]
    torch.testing.assert_close(meter.maps(), dense_maps(calls, head1_of_layer1, (4, 4)), atol=2e-6, rtol=1e-5)


def test_maps_refuse_what_they_cannot_measure():
    model, inputs = tiny.dit()  # self-attention only: no text keys
    meter = ad.TokenMaps()
    with torch.no_grad(), ad.use(model, observers=[meter]):
        tiny.run(model, inputs)
    with pytest.raises(ValueError, match="maps"):
        meter.maps()
    for bad in ({"heads": [-1]}, {"steps": "all"}, {"layers": [1.5]}):
        with pytest.raises(ValueError):
            ad.TokenMaps(**bad)


def test_entropy_meter_on_cross_attention_equals_dense_entropy():
    model, inputs = tiny.pixart()
    calls = [c for c in _recorded(model, inputs) if c[0].endswith("attn2")]
    entropy = Entropy()
    with torch.no_grad(), ad.use(model, kind="cross", observers=[entropy]) as switch:
        tiny.run(model, inputs)
    got = {(switch.names[layer], head): value for layer, head, metric, value in entropy.rows() if metric == "entropy.mean"}
    for name, q, k, scale in calls:
        p = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * scale, dim=-1)
        h = -(p * p.log()).sum(-1).mean((0, 2))  # mean over batch rows and queries, per head
        for head in range(q.shape[1]):
            assert math.isclose(got[(name, head)], float(h[head]), rel_tol=1e-5, abs_tol=1e-6)


def _pipeline():
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline

    unet, _ = tiny.unet()
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 8), latent_channels=4,
                        norm_num_groups=4, layers_per_block=1, sample_size=16).eval()
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=None, tokenizer=None, unet=unet, scheduler=DDIMScheduler(clip_sample=False, steps_offset=1),
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(2)
    call = dict(prompt_embeds=torch.randn(1, T, 12, generator=g), negative_prompt_embeds=torch.randn(1, T, 12, generator=g),
                num_inference_steps=2, guidance_scale=3.0, height=16, width=16, output_type="np")
    return pipe, call


def test_pipeline_maps_equal_dense_maps_and_leave_the_image_unchanged():
    pipe, call = _pipeline()
    rec = Record(pipe.unet)
    try:
        with torch.no_grad(), rec:
            image = pipe(**call, generator=torch.Generator().manual_seed(0)).images
    finally:
        rec.close()
    result = ad.maps(pipe, **call, generator=torch.Generator().manual_seed(0), meters=[Entropy()])
    assert abs(result.output.images - image).max() < 1e-5
    expected = dense_maps(rec.calls, _cross_only({64: (8, 8), 16: (4, 4)}), (8, 8))
    assert result.maps.shape == (2, T, 8, 8)  # [unconditional; conditional] rows, 2 steps aggregated
    torch.testing.assert_close(result.maps, expected, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(result.conditional, expected[1:], atol=2e-6, rtol=1e-5)
    assert result.tokens is None  # no tokenizer: prompt_embeds were passed
    assert {r[0] for r in result.rows()} == set(ad.layer_names(pipe.unet))
    assert result.state_bytes == 2 * T * (64 + 16) * 8
    assert all("forward" not in layer.module.__dict__ for layer in ad.attention_layers(pipe.unet))
