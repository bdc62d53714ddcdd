"""Image spans from each family's own placeholders and image sizes, and the one-line
errors for inputs that do not add up, a text-only model, and bad keys."""

import pytest
import tiny_vlms as V
import torch

from attnkit import steer, vision


@pytest.mark.parametrize("family", V.FAMILIES)
def test_spans_match_the_models_own_placeholder_mask(family):
    model = V.build(family)
    inputs, sizes = V.batch(family)
    spans = vision.image_spans(model, inputs)
    assert [im.length for im in spans.images] == sizes
    assert [im.row for im in spans.images] == [0, 0, 1]
    assert [im.index for im in spans.images] == [0, 1, 2]
    # the features the model's vision side makes: one per image token
    kw = {k: v for k, v in inputs.items() if k in ("pixel_values", "image_grid_thw")}
    with torch.no_grad():
        feats = model.model.get_image_features(**kw).pooler_output
    per = [len(f) for f in feats]
    if family == "idefics3":  # one entry per batch row
        assert per == [sum(im.length for im in spans.images if im.row == r) for r in range(2)]
    else:
        assert per == [im.length for im in spans.images]
    assert torch.equal(spans.mask, inputs["input_ids"] == V.IMAGE)
    for im in spans.images:
        rows, cols = im.grid
        assert rows * cols == im.length
    if family == "qwen2_vl":
        assert [im.grid for im in spans.images] == [(2, 2), (2, 3), (2, 2)]  # (h, w) / merge from image_grid_thw


def _one_line(err):
    assert "\n" not in str(err.value)


def test_image_count_not_matching_placeholders():
    model = V.build("llava")
    inputs, _ = V.batch("llava")
    with pytest.raises(ValueError, match=r"^inputs: 2 image\(s\) in pixel_values need 18 placeholder tokens .* hold 27") as err:
        vision.image_spans(model, dict(inputs, pixel_values=inputs["pixel_values"][:2]))
    _one_line(err)
    qwen = V.build("qwen2_vl")
    q_inputs, _ = V.batch("qwen2_vl")
    with pytest.raises(ValueError, match=r"^inputs: 2 image\(s\) in image_grid_thw need 10") as err:
        vision.image_spans(qwen, dict(q_inputs, image_grid_thw=q_inputs["image_grid_thw"][:2]))
    _one_line(err)
    with pytest.raises(ValueError, match="^inputs: Qwen2-VL needs image_grid_thw") as err:
        vision.image_spans(qwen, {"input_ids": q_inputs["input_ids"]})
    _one_line(err)


def test_image_that_cannot_be_located():
    model = V.build("idefics3")
    inputs, _ = V.batch("idefics3")
    ids = inputs["input_ids"].clone()
    # break row 0's first image into 3 + 1 placeholders: the count still adds up, the run does not
    first = int((ids[0] == V.IMAGE).nonzero()[2])
    ids[0, first + 1], ids[0, first + 2] = ids[0, first + 2].item(), V.IMAGE
    ids[0, first + 1] = 5
    with pytest.raises(ValueError, match="^inputs: image 0 needs 4 consecutive placeholder tokens") as err:
        vision.image_spans(model, dict(inputs, input_ids=ids))
    _one_line(err)
    with pytest.raises(ValueError, match="^inputs: expected the processor's output") as err:
        vision.image_spans(model, inputs["input_ids"])
    _one_line(err)


def test_text_only_model_refused():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "hf"))
    import tiny_models

    llama = tiny_models.build("llama")
    ids = torch.randint(3, 90, (1, 10))
    with pytest.raises(ValueError, match="^model: LlamaConfig declares no image placeholder") as err:
        vision.image_spans(llama, {"input_ids": ids})
    _one_line(err)
    mask = torch.zeros(1, 10, dtype=torch.bool)
    mask[0, 2:5] = True
    for iv in (steer.amplify_visual(mask, "all", 2.0), steer.ablate_visual(mask)):
        with pytest.raises(
            ValueError, match=f"^model: LlamaConfig has no image placeholder .*{iv.name} needs a vision-language model"
        ) as err:
            with steer.apply(llama, iv):
                pass
        _one_line(err)


def test_bad_keys_and_settings():
    with pytest.raises(ValueError, match="^keys: marks no image key"):
        steer.amplify_visual(torch.zeros(1, 4, dtype=torch.bool), "all", 2.0)
    with pytest.raises(ValueError, match="^keys: expected a \\(batch, tokens\\) bool mask"):
        steer.amplify_visual([1, 2], "all", 2.0)
    mask = torch.tensor([[False, True, True]])
    with pytest.raises(ValueError, match="^alpha: expected a number > 0"):
        steer.amplify_visual(mask, "all", 0.0)
    with pytest.raises(ValueError, match="^mode: expected 'weights' or 'logits'"):
        steer.amplify_visual(mask, "all", 2.0, mode="pai")
    with pytest.raises(ValueError, match="^blind: marks keys that are not image keys"):
        steer.calibrate_visual(mask, torch.tensor([[True, False, False]]), "all")
    with pytest.raises(ValueError, match="^curve: visual shares must lie strictly between 0 and 1"):
        steer.hold_visual(mask, "all", torch.ones(2, 4, 3))
    model = V.build("llava")
    inputs, _ = V.batch("llava")
    spans = vision.image_spans(model, inputs)
    with pytest.raises(ValueError, match=r"^curve: measured for \(3, 4\) \(layers, heads\); the model has \(2, 4\)"):
        with steer.apply(model, steer.hold_visual(spans, "all", torch.full((3, 4, 2), 0.5))):
            pass
    one = {k: v[:1] for k, v in inputs.items()}
    one["pixel_values"] = inputs["pixel_values"][:2]
    with pytest.raises(ValueError, match="^keys: a mask for 2 batch rows, but the call has a batch of 1") as err:
        with torch.no_grad(), steer.apply(model, steer.amplify_visual(spans, "all", 2.0)):
            model(**one)
    _one_line(err)


def test_unknown_family_needs_tokens_per_image():
    model = V.build("llava")
    inputs, _ = V.batch("llava")
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.model_type = "somevlm"
    with pytest.raises(ValueError, match="^model: attnkit does not know how many tokens each image takes.*tokens_per_image="):
        vision.image_spans(config, inputs)
    spans = vision.image_spans(config, {"input_ids": inputs["input_ids"]}, tokens_per_image=9)
    assert [(im.row, im.start, im.end) for im in spans.images] == [
        (0, 2, 11),
        (0, 12, 21),
        (1, 12, 21),
    ]  # row 1: 10 pads, BOS, one word
