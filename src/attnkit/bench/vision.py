"""Vision-language models: what the visual meters add to ``generate`` and what the visual
interventions add to a forward pass.

Subjects: a tiny random LLaVA config (CLIP tower 2 x 64 on 96 x 96 images in 4 x 4
patches: 576 image tokens; Llama decoder 4 x 256, 4 heads, 2 kv heads) on a 2048-token
prompt (the image and 1472 text tokens), and the shipped visual organism ``shapes-vlm``
(9 image tokens, a 13-token question) when it is installed. Float32, batch 1.

- meters: greedy ``generate`` inside ``attnkit.hf.use(model, observers=[VisualAttention])``
  (the meter on the generated steps' rows, as ``attnkit inspect --image`` runs it, and
  on every row) against plain ``generate`` of the same model on transformers' sdpa;
  interleaved medians; target <= 1.3x.
- interventions: one forward inside an open ``attnkit.steer.apply`` block with each
  visual intervention on every decoder head, against the same forward of a copy of the
  model inside an open ``attnkit.hf.use`` block (the blocks' set-up, paid once per
  block, is left out; the steer suite times it with each forward); target <= 1.1x.

``quick`` uses a 512-token prompt (144 image tokens), 8 new tokens and 2 repeats.
"""

from __future__ import annotations

import copy

import torch

from .harness import Row, run_steps, time_pair

STEPS = 3
TARGET_METERS = 1.3
TARGET_INTERVENTION = 1.1
IMAGE_TOKEN = 999


def tiny_llava(image_size: int):
    import transformers as T

    torch.manual_seed(0)
    vision = T.CLIPVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=image_size, patch_size=4
    )
    text = dict(
        model_type="llama",
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        pad_token_id=0,
    )
    config = T.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    model = T.LlavaForConditionalGeneration._from_config(config, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None
    return model


def llava_inputs(n: int, image_size: int) -> dict:
    g = torch.Generator().manual_seed(n)
    n_image = (image_size // 4) ** 2
    text = torch.randint(1, 998, (n - n_image,), generator=g)
    ids = torch.cat([text[:8], torch.full((n_image,), IMAGE_TOKEN), text[8:]]).unsqueeze(0)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.randn(1, 3, image_size, image_size, generator=g),
    }


def organism_subject():
    """(model, inputs) of shapes-vlm on one held-out question, or None when not installed."""
    try:
        from .. import organisms
        from ..vision import organism as org
        from ..vision import shapes

        directory = organisms.path("shapes-vlm")
        model, processor = org.load_export(directory)
    except (ImportError, ValueError, FileNotFoundError, KeyError, AttributeError):
        return None
    example = shapes.examples(1, seed=12345)[0]
    inputs = dict(processor(images=[example.image], text=[org.prompt(example.question)], return_tensors="pt"))
    model.generation_config.eos_token_id = None
    return model, inputs


def meter_rows(name: str, model, inputs: dict, new_tokens: int, repeats: int) -> list[Row]:
    from .. import hf, vision

    spans = vision.image_spans(model, inputs)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    n = spans.length
    rows = []
    for label, queries in (("generated rows", (spans.first_step, None)), ("every row", None)):

        def plain():
            model.generate(**inputs, **kw)

        def metered():
            meter = spans.meter(queries=queries)
            with hf.use(model, observers=[meter]):
                model.generate(**inputs, **kw)
            meter.rows()  # the results, so that work the meter defers is timed too

        with torch.no_grad():
            a, b = time_pair(metered, plain, repeats=repeats)
        rows.append(
            Row(
                "vision",
                f"{name}: generate with VisualAttention ({label})",
                f"prompt={n} ({int(spans.mask.sum())} image) +{new_tokens}",
                a,
                "plain generate (sdpa)",
                b,
                f"<= {TARGET_METERS}x",
                a / b <= TARGET_METERS,
            )
        )
    return rows


def intervention_rows(name: str, model, inputs: dict, repeats: int) -> list[Row]:
    from .. import hf, steer, vision

    spans = vision.image_spans(model, inputs)
    blind = spans.mask & (torch.arange(spans.length) % 7 == 0)
    layers, heads = steer.targets.model_shape(model)
    curve = torch.linspace(0.6, 0.3, 8, dtype=torch.float64).expand(layers, heads, 8)
    cases = {
        "amplify_visual alpha=2": steer.amplify_visual(spans, "all", 2.0),
        "amplify_visual PAI alpha=0.5": steer.amplify_visual(spans, "all", 0.5, mode="logits"),
        "calibrate_visual beta=0.3": steer.calibrate_visual(spans, blind, "all", beta=0.3),
        "hold_visual": steer.hold_visual(spans, "all", curve),
        "ablate_visual": steer.ablate_visual(spans),
    }
    # Each side opens its block once and times forwards inside it (the cost an intervention adds
    # to a forward, not the block's set-up, paid once per block): two copies of the model with the
    # same weights, one steered, one plain, timed alternately.
    twin = copy.deepcopy(model)
    rows = []
    for label, iv in cases.items():
        with torch.no_grad(), hf.use(twin), steer.apply(model, iv):
            a, b = time_pair(lambda: model(**inputs), lambda: twin(**inputs), repeats=repeats)
        rows.append(
            Row(
                "vision",
                f"{name}: forward with {label}",
                f"N={spans.length}",
                a,
                "attnkit.hf.use forward",
                b,
                f"<= {TARGET_INTERVENTION}x",
                a / b <= TARGET_INTERVENTION,
                "every decoder head; blocks opened once",
            )
        )
    return rows


def run(quick: bool = False, progress=None) -> list[Row]:
    n, image_size, new_tokens, repeats = (512, 48, 8, 2) if quick else (2048, 96, 32, 5)

    def llava_meters():
        model = tiny_llava(image_size)
        return meter_rows("tiny LLaVA", model, llava_inputs(n, image_size), new_tokens, repeats)

    def llava_interventions():
        model = tiny_llava(image_size)
        return intervention_rows("tiny LLaVA", model, llava_inputs(n, image_size), repeats)

    def organism():
        subject = organism_subject()
        if subject is None:
            return [Row("vision", "shapes-vlm", "-", None, "-", None, note="the visual organism is not installed: skipped")]
        model, inputs = subject
        return meter_rows("shapes-vlm", model, inputs, new_tokens, repeats) + intervention_rows(
            "shapes-vlm", model, inputs, repeats
        )

    return run_steps(
        [("tiny LLaVA meters", llava_meters), ("tiny LLaVA interventions", llava_interventions), ("shapes-vlm", organism)],
        progress,
    )
