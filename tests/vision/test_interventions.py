"""Visual interventions against their literal definitions on the dense reference
(float64, padded batches with several images), identity settings bitwise, and the
model restored after the block and after an error."""

import math

import pytest
import tiny_vlms as V
import torch
from dense_reference import run_dense

import attnkit.hf as akhf
from attnkit import steer, vision
from attnkit.hf.attention import EDITS

TOL = 1e-9  # float64 logits of a 2-layer model: the two paths differ by rounding only (~1e-13)
HEADS = {0: [1, 3], 1: [0]}


def _close(model, inputs, intervention, change):
    ref, _ = run_dense(model, change, **inputs)
    with torch.no_grad(), steer.apply(model, intervention):
        got = model(**inputs).logits
    real = inputs["attention_mask"].bool()
    plain, _ = run_dense(model, **inputs)
    assert (ref.logits[real] - plain.logits[real]).abs().max() > 1e-4  # the change changes something
    assert torch.allclose(got[real], ref.logits[real], atol=TOL, rtol=0)


@pytest.fixture(scope="module", params=V.FAMILIES)
def setup(request):
    model = V.build(request.param)
    inputs, _ = V.batch(request.param)
    return model, inputs, vision.image_spans(model, inputs)


def test_amplify_weights(setup):
    model, inputs, spans = setup
    _close(model, inputs, steer.amplify_visual(spans, HEADS, 4.0), {"image": spans.mask, "heads": HEADS, "weights": 4.0})


def test_amplify_logits_pai(setup):
    model, inputs, spans = setup
    _close(
        model, inputs, steer.amplify_visual(spans, HEADS, 0.5, mode="logits"), {"image": spans.mask, "heads": HEADS, "pai": 0.5}
    )


def test_calibrate(setup):
    model, inputs, spans = setup
    blind = spans.mask & (torch.arange(spans.length) % 3 == 0)
    _close(
        model,
        inputs,
        steer.calibrate_visual(spans, blind, HEADS, beta=0.2, boost=1.5),
        {"image": spans.mask, "heads": HEADS, "calibrate": (blind, 0.2, 1.5)},
    )


def test_ablate(setup):
    model, inputs, spans = setup
    _close(model, inputs, steer.ablate_visual(spans, HEADS), {"image": spans.mask, "heads": HEADS, "ablate": True})


def test_hold_offsets_each_step(setup):
    model, inputs, spans = setup
    # The prompt ends 3 tokens before the input does: queries at steps 1, 2, 3 get offsets.
    n0 = spans.length - 3
    image = spans.mask[:, :n0]
    torch.manual_seed(3)
    curve = torch.rand(2, 4, 3, dtype=torch.float64) * 0.8 + 0.1
    strength = 1.5
    logit = lambda c: math.log(c / (1 - c))  # noqa: E731
    offsets = {
        l: [[strength * (logit(curve[l, h, 0]) - logit(curve[l, h, t])) for t in range(3)] for h in range(4)] for l in range(2)
    }
    _close(model, inputs, steer.hold_visual(image, HEADS, curve, strength), {"image": image, "heads": HEADS, "hold": offsets})


@pytest.mark.parametrize("family", V.FAMILIES)
def test_identity_settings_leave_logits_bitwise(family):
    model = V.build(family)
    inputs, _ = V.batch(family)
    spans = vision.image_spans(model, inputs)
    with torch.no_grad(), akhf.use(model):
        plain = model(**inputs).logits
        for iv in (
            steer.amplify_visual(spans, "all", 1.0),
            steer.amplify_visual(spans, "all", 0.0, mode="logits"),
            steer.calibrate_visual(spans, spans.mask, "all", beta=1.0, boost=1.0),
            steer.hold_visual(spans, "all", torch.full((2, 4, 5), 0.3, dtype=torch.float64), strength=0.0),
        ):
            with steer.apply(model, iv):
                assert torch.equal(model(**inputs).logits, plain), iv


def test_model_restored_after_block_and_after_error():
    model = V.build("qwen2_vl")
    inputs, _ = V.batch("qwen2_vl")
    spans = vision.image_spans(model, inputs)
    impl = {k: getattr(model.config, k)._attn_implementation for k in ("text_config", "vision_config")}
    with torch.no_grad():
        before = model(**inputs).logits
        with steer.apply(model, steer.amplify_visual(spans, "all", 3.0)):
            assert not torch.equal(model(**inputs).logits, before)
        with pytest.raises(RuntimeError, match="boom"), steer.apply(model, steer.ablate_visual(spans)):
            raise RuntimeError("boom")
        after = model(**inputs).logits
    assert torch.allclose(after, before, rtol=0, atol=0, equal_nan=True)  # bitwise; eager float64 pads rows with NaN
    assert not any(m in EDITS for m in model.modules())
    assert {k: getattr(model.config, k)._attn_implementation for k in impl} == impl


def test_vision_tower_is_not_steered():
    """Layer 0 of the decoder is steered; the vision tower's first layer (also numbered 0
    by rank) must not be: image features stay those of the plain model."""
    model = V.build("llava")
    inputs, _ = V.batch("llava")
    spans = vision.image_spans(model, inputs)
    with torch.no_grad():
        with akhf.use(model):
            plain = model.model.get_image_features(pixel_values=inputs["pixel_values"])
        with steer.apply(model, steer.amplify_visual(spans, "all", 5.0)):
            steered = model.model.get_image_features(pixel_values=inputs["pixel_values"])
    plain = plain.pooler_output if hasattr(plain, "pooler_output") else plain
    steered = steered.pooler_output if hasattr(steered, "pooler_output") else steered
    for a, b in zip(plain, steered):
        assert torch.equal(a, b)


@pytest.mark.parametrize("make", ["amplify", "calibrate", "ablate"])
def test_decoding_steps_equal_the_whole_sequence(make):
    """Steered decoding steps (one SDPA call with the offsets as its mask, the table built
    once at a doubled width and sliced as keys grow) give the logits of a steered forward
    over the whole generated sequence (the tiled engine): LLaVA's first row, no padding."""
    model = V.build("llava")
    inputs, _ = V.batch("llava")
    inputs = {k: v[:2] if k == "pixel_values" else v[:1] for k, v in inputs.items()}
    spans = vision.image_spans(model, inputs)
    blind = spans.mask & (torch.arange(spans.length) % 3 == 0)
    iv = {
        "amplify": steer.amplify_visual(spans, HEADS, 4.0),
        "calibrate": steer.calibrate_visual(spans, blind, HEADS, beta=0.2, boost=1.5),
        "ablate": steer.ablate_visual(spans, HEADS),
    }[make]
    steps, n0 = 6, spans.length
    with torch.no_grad(), steer.apply(model, iv):
        out = model.generate(**inputs, max_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True)
        whole = dict(inputs, input_ids=out.sequences, attention_mask=torch.ones_like(out.sequences))
        want = model(**whole).logits[0, n0 - 1 : n0 - 1 + steps]
    with torch.no_grad(), akhf.use(model):
        plain = model(**whole).logits[0, n0 - 1 : n0 - 1 + steps]
    got = torch.cat(out.logits)  # (steps, vocab), step t predicting token n0 + t; generate keeps float32 copies
    # float64 paths apart by ~1e-13, each rounded to float32: equal to within one float32 ulp
    torch.testing.assert_close(got, want.float(), rtol=2.4e-7, atol=1e-12)
    assert (want - plain).abs().max() > 1e-4  # the steps were steered


def _first_row(family: str, inputs: dict) -> dict:
    """Batch row 0 alone (the longest: no padding, so the decoder's calls are causal)."""
    row = {k: v[:1] for k, v in inputs.items() if k in ("input_ids", "attention_mask", "mm_token_type_ids")}
    if family == "qwen2_vl":
        thw = inputs["image_grid_thw"][:2]  # row 0's two images
        return {**row, "image_grid_thw": thw, "pixel_values": inputs["pixel_values"][: int(thw.prod(-1).sum())]}
    return {**row, "pixel_values": inputs["pixel_values"][: 2 if family == "llava" else 1]}


@pytest.mark.parametrize("family", V.FAMILIES)
def test_pai_in_float32(family, monkeypatch):
    """float32 PAI on its fast paths: the C++ softmax loop with its boost table (row 0
    alone: causal calls, the prompt's and, for a short prompt, the few-query one) and
    PyTorch tiles with the C++ boost step (the padded batch), against the float64 dense
    reference."""
    from attnkit.kernels import tiled

    loops = []
    c_loop = tiled.cpu.softmax_attention
    monkeypatch.setattr(tiled.cpu, "softmax_attention", lambda *a, **k: loops.append(k.get("boost")) or c_loop(*a, **k))
    model64, model32 = V.build(family), V.build(family, dtype=torch.float32)
    batch, _ = V.batch(family)
    for inputs, causal in ((_first_row(family, batch), True), (batch, False)):
        spans = vision.image_spans(model64, inputs)
        ref, _ = run_dense(model64, {"image": spans.mask, "heads": HEADS, "pai": 0.5}, **inputs)
        loops.clear()
        with torch.no_grad(), steer.apply(model32, steer.amplify_visual(spans, HEADS, 0.5, mode="logits")):
            got = model32(**{k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}).logits
        real = inputs["attention_mask"].bool()
        # float32 through two layers (weights rounded too): 3-5 ulps of the largest logit
        # measured, on the plain forward as on this one; 16 leave room for other summation orders
        ulp = ref.logits[real].abs().max().item() * 2**-23
        torch.testing.assert_close(got[real].double(), ref.logits[real], rtol=0, atol=16 * ulp)
        assert (len(loops) == 2 and all(t is not None for t in loops)) if causal else not loops  # the layers with chosen heads
