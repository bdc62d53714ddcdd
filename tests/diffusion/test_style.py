"""Style injection (StyleID, arXiv 2312.09008) on the tiny UNet: the injected attention
equals softmax(T * q~ K_ref^T * scale) V_ref computed literally in float64 from the
projections the model's own modules produce, unchosen layers run unchanged, gamma = 1,
T = 1 with one image as style and content is the model itself, and everything is
restored after errors."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

import diffusion_tiny as tiny  # noqa: E402
from diffusion_reference import restored  # noqa: E402
from projection_capture import Capture, attention, split_heads  # noqa: E402

import attnkit.diffusion as ad  # noqa: E402
from helpers import assert_close  # noqa: E402


@pytest.fixture(scope="module")
def unet():
    model, inputs = tiny.unet()
    return model, inputs


def _inputs(inputs, seed):
    g = torch.Generator().manual_seed(seed)
    out = dict(inputs)
    out["sample"] = torch.randn(inputs["sample"].shape, generator=g)
    return out


def _run(model, inputs):
    with torch.no_grad():
        return tiny.run(model, inputs)


def test_default_layers_are_the_decoder_self_attention(unet):
    model, _ = unet
    expected = [n for n in ad.layer_names(model, "self") if n.startswith("up_blocks.")]
    assert expected and ad.StyleInjection().layer_paths(model) == expected


def test_same_image_gamma_one_temperature_one_is_the_model(unet):
    model, inputs = unet
    own = _run(model, inputs)
    style = ad.StyleInjection(gamma=1.0, temperature=1.0)
    with style.record(model, "style", "content"):
        _run(model, inputs)
    with style.inject(model):
        out = _run(model, inputs)
    assert_close(out, own, torch.float32)
    assert restored(model)


def test_injected_attention_equals_literal_formula_on_chosen_layer_only(unet):
    model, inputs = unet
    decoder = ad.StyleInjection().layer_paths(model)
    chosen, other = decoder[-1], decoder[0]
    gamma, temp = 0.6, 1.7
    style = ad.StyleInjection(layers=[chosen], gamma=gamma, temperature=temp)
    style_in, content_in, current_in = _inputs(inputs, 11), _inputs(inputs, 12), _inputs(inputs, 13)
    with Capture(model) as cap:
        with style.record(model, "style"):
            _run(model, style_in)
        ref = cap.snapshot()
        with style.record(model, "content"):
            _run(model, content_in)
        content = cap.snapshot()
        plain = _run(model, current_in)
        with style.inject(model):
            out = _run(model, current_in)
        now = cap.seen
    heads = dict(model.named_modules())[chosen].heads
    # the recorded K, V are literally the reference's projections
    k_rec, v_rec = next(kv for (t, name), kv in style.style.items() if name == chosen)
    assert_close(k_rec.double(), split_heads(ref[chosen]["to_k"], heads), torch.float32)
    assert_close(v_rec.double(), split_heads(ref[chosen]["to_v"], heads), torch.float32)
    # chosen layer: softmax(T q~ K_ref^T scale) V_ref with q~ = gamma q_content + (1 - gamma) q
    q_blend = gamma * content[chosen]["to_q"] + (1 - gamma) * now[chosen]["to_q"]
    expected = attention(q_blend, ref[chosen]["to_k"], ref[chosen]["to_v"], heads, temp)
    assert_close(now[chosen]["out"], expected, torch.float32)
    # every other attention layer attends with its own q, k, v
    for name, seen in now.items():
        if name != chosen:
            h = dict(model.named_modules())[name].heads
            assert_close(seen["out"], attention(seen["to_q"], seen["to_k"], seen["to_v"], h), torch.float32, msg=name)
    assert other != chosen and (out - plain).abs().max() > 1e-4
    assert restored(model)


def test_restored_after_an_exception(unet):
    model, inputs = unet
    own = _run(model, inputs)
    style = ad.StyleInjection(temperature=2.0)
    with style.record(model, "style", "content"):
        _run(model, _inputs(inputs, 5))
    with pytest.raises(RuntimeError, match="boom"):
        with style.inject(model):
            _run(model, inputs)
            raise RuntimeError("boom")
    assert restored(model)
    assert_close(_run(model, inputs), own, torch.float32)


def test_errors(unet):
    model, inputs = unet
    for bad in (-0.1, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="gamma"):
            ad.StyleInjection(gamma=bad)
    for bad in (0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            ad.StyleInjection(temperature=bad)
    style = ad.StyleInjection()
    with pytest.raises(ValueError, match="style: nothing recorded"):
        with style.inject(model):
            pass
    with pytest.raises(ValueError, match="roles"):
        with style.record(model, "texture"):
            pass
    cross = ad.layer_names(model, "cross")[-1]
    with pytest.raises(ValueError, match="layers"):
        with ad.StyleInjection(layers=[cross]).record(model, "style"):
            pass
    # the stylised pass at a timestep the reference never saw
    with style.record(model, "style", "content"):
        _run(model, inputs)
    later = dict(inputs, timestep=torch.tensor(7))
    with pytest.raises(ValueError, match="timestep 7"):
        with style.inject(model):
            _run(model, later)
    # content recorded with batch 2 cannot serve a batch of 3
    three = dict(
        inputs,
        sample=torch.randn(3, *inputs["sample"].shape[1:]),
        encoder_hidden_states=torch.randn(3, *inputs["encoder_hidden_states"].shape[1:]),
    )
    with pytest.raises(ValueError, match="batch"):
        with style.inject(model):
            _run(model, three)
    assert restored(model)


def test_batch_one_reference_serves_every_row(unet):
    model, inputs = unet
    one = {k: (v[:1] if k in ("sample", "encoder_hidden_states") else v) for k, v in inputs.items()}
    style = ad.StyleInjection(gamma=0.0, temperature=1.3)
    with style.record(model, "style"):
        _run(model, one)
    with style.inject(model):
        both = _run(model, inputs)
        first = _run(model, {k: (v[:1] if k in ("sample", "encoder_hidden_states") else v) for k, v in inputs.items()})
    assert_close(both[:1], first, torch.float32)


def test_adainattention():
    g = torch.Generator().manual_seed(0)
    c, s = (
        torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64),
        3 + 2 * torch.randn(1, 3, 6, 6, generator=g, dtype=torch.float64),
    )
    out = ad.adain(c, s, eps=0.0)
    for b in range(2):
        for ch in range(3):
            x, y = c[b, ch].flatten(), s[0, ch].flatten()
            mu_x, mu_y = x.sum() / x.numel(), y.sum() / y.numel()
            sd_x = ((x - mu_x) ** 2).mean().sqrt()
            sd_y = ((y - mu_y) ** 2).mean().sqrt()
            assert_close(out[b, ch], sd_y * (c[b, ch] - mu_x) / sd_x + mu_y, torch.float64)
    with pytest.raises(ValueError, match="style"):
        ad.adain(c, torch.randn(3, 3, 4, 4))


def test_dit_named_layers_per_row_timesteps():
    """A DiT (no up_blocks: layers named), a batch whose rows have different timesteps."""
    model, inputs = tiny.dit()
    last = ad.layer_names(model, "self")[-1]
    with pytest.raises(ValueError, match="up_blocks"):
        ad.StyleInjection().layer_paths(model)
    own = _run(model, inputs)
    same = ad.StyleInjection(layers=[last], gamma=1.0, temperature=1.0)
    with same.record(model, "style", "content"):
        _run(model, inputs)
    assert {t for t, _ in same.style} == {(3.0, 5.0)}
    with same.inject(model):
        assert_close(_run(model, inputs), own, torch.float32)
    hot = ad.StyleInjection(layers=[last], gamma=1.0, temperature=3.0)
    hot.style, hot.content = same.style, same.content
    with hot.inject(model):
        assert (_run(model, inputs) - own).abs().max() > 1e-4
    assert restored(model)


def test_pipeline_with_guidance_matches_references_by_timestep(tiny_pipeline):
    """Through a whole guided sampling run (DDIM, batch 2): the same seed as style and
    content with gamma = 1, T = 1 reproduces the plain run; another style changes it."""
    pipe, call = tiny_pipeline

    def sample(seed):
        with torch.no_grad():
            return pipe(**call, generator=torch.Generator().manual_seed(seed)).images

    plain = sample(2)
    same = ad.StyleInjection(gamma=1.0, temperature=1.0)
    with same.record(pipe, "style", "content"):
        sample(2)
    assert len({t for t, _ in same.style}) == call["num_inference_steps"]
    with same.inject(pipe):
        assert_close(sample(2), plain, torch.float32)
    other = ad.StyleInjection(gamma=0.5, temperature=1.5)
    with other.record(pipe, "style"):
        sample(1)
    with other.record(pipe, "content"):
        sample(2)
    with other.inject(pipe):
        assert (sample(2) - plain).abs().max() > 1e-4
    assert restored(pipe.unet)
