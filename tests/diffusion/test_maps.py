"""Per-token cross-attention maps (TokenMaps, attnkit.diffusion.maps) against dense maps
computed in the test from the q and k the model's default processors pass to SDPA."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("diffusers")

import diffusion_tiny as tiny  # noqa: E402
from diffusion_reference import dense_maps, recorded, restored, softmax64  # noqa: E402

import attnkit.diffusion as ad  # noqa: E402
from attnkit.observe import Entropy  # noqa: E402

T = tiny.TEXT
CASES = tiny.MAP_LAYOUTS  # name -> (layout, grid)


def _calls(model, inputs):
    with torch.no_grad():
        return recorded(model, lambda: tiny.run(model, inputs))[1]


@pytest.mark.parametrize("name", list(CASES))
def test_maps_equal_dense_maps(name):
    model, inputs = tiny.MODELS[name]()
    layout, size = CASES[name]
    expected = dense_maps(_calls(model, inputs), layout, size)
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
    calls = _calls(model, second)
    only = "transformer_blocks.1.attn"

    def head1_of_layer1(name, nq, nk):
        return tiny.sd3_layout(name, nq, nk) if name == only else None

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
    calls = [c for c in _calls(model, inputs) if c[0].endswith("attn2")]
    entropy = Entropy()
    with torch.no_grad(), ad.use(model, kind="cross", observers=[entropy]) as switch:
        tiny.run(model, inputs)
    got = {(switch.names[layer], head): value for layer, head, metric, value in entropy.rows() if metric == "entropy.mean"}
    for name, q, k, scale in calls:
        p = softmax64(q, k, scale)
        h = -(p * p.log()).sum(-1).mean((0, 2))  # mean over batch rows and queries, per head
        for head in range(q.shape[1]):
            assert math.isclose(got[(name, head)], float(h[head]), rel_tol=1e-5, abs_tol=1e-6)


def test_pipeline_maps_equal_dense_maps_and_leave_the_image_unchanged(tiny_pipeline):
    pipe, call = tiny_pipeline
    call = {**call, "output_type": "np"}
    with torch.no_grad():
        image, calls = recorded(pipe.unet, lambda: pipe(**call, generator=torch.Generator().manual_seed(0)).images)
    result = ad.maps(pipe, **call, generator=torch.Generator().manual_seed(0), meters=[Entropy()])
    assert abs(result.output.images - image).max() < 1e-5
    expected = dense_maps(calls, tiny.cross_only({64: (8, 8), 16: (4, 4)}), (8, 8))
    assert result.maps.shape == (2, T, 8, 8)  # [unconditional; conditional] rows, 2 steps aggregated
    torch.testing.assert_close(result.maps, expected, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(result.conditional, expected[1:], atol=2e-6, rtol=1e-5)
    assert result.tokens is None  # no tokenizer: prompt_embeds were passed
    assert {r[0] for r in result.rows()} == set(ad.layer_names(pipe.unet))
    assert result.state_bytes == 2 * T * (64 + 16) * 8
    assert restored(pipe.unet)
