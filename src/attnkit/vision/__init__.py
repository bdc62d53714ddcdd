"""attnkit on vision-language models: where the images are, how much attention they get,
and interventions on it.

API summary (everything below takes a transformers >= 5 model; nothing is downloaded):

    import attnkit as ak
    from attnkit import vision, steer

    spans = vision.image_spans(model, inputs)     # inputs: the processor's output (input_ids, pixel_values, image_grid_thw, ...)
    spans.mask                                    # (B, N0) bool, True on image tokens (N0 = prompt length, padding included)
    spans.images                                  # ImageSpan(row, start, end, grid=(rows, cols) | None, index) per image
    spans.first_step                              # N0 - 1: the query position that predicts generated token 0

    meter = spans.meter(top_k=4)                  # attnkit.observe.VisualAttention(spans.mask, top_k=4, layers=, heads=, queries=)
    with ak.hf.use(model, observers=[meter]):     # a VLM: observers see the decoder's layers only (vision tower excluded)
        model.generate(**inputs, max_new_tokens=8)
    meter.rows()     # (layer, head, metric, value): visual.share, visual.share.uniform, visual.entropy,
                     # visual.entropy.norm, visual.top4, visual.blind, visual.drift (slope of share per step)
    meter.arrays()["visual_share"][(layer, head)]   # {"step_start": N0-1, "values": (B, T) share per generated step}
    meter.arrays()["visual_received"][(layer, head)] # (B, N0) attention mass each key received (0 off the image)

    blind = vision.blind_tokens(meter, factor=3.0)          # (B, N0) over-attended image tokens
    curve = vision.share_curve(meter, num_layers, num_heads) # (L, H, T) reference share per step

    with steer.apply(model, steer.amplify_visual(spans, heads="all", alpha=2.0)):             # image weights x alpha, renormalised
    with steer.apply(model, steer.amplify_visual(spans, {1: [0, 2]}, alpha=0.5, mode="logits")):  # PAI: s + alpha|s| on image logits
    with steer.apply(model, steer.calibrate_visual(spans, blind, "all", beta=0.3)):           # blind tokens' weights x beta
    with steer.apply(model, steer.hold_visual(spans, "all", curve, strength=1.0)):            # drift-corrected generation
    with steer.apply(model, steer.ablate_visual(spans)):                                      # image hidden from the decoder
    out = vision.contrastive_generate(model, inputs, spans, lam=1.0, max_new_tokens=8)     # VCD-style against the ablated run

    # vision towers (CLIP, SigLIP, ViT, DINOv2; a VLM's model.model.vision_tower):
    hn = vision.high_norm(tower, pixel_values, factor=3.0)   # hn.outliers[l] (B, N) bool, hn.norms[l]; rows highnorm.count/mass/uniform
    neurons = vision.register_neurons(tower, pixel_values, top=2)   # {layer: [MLP units]} writing the outliers
    with vision.test_time_registers(tower, neurons, count=1):      # an extra token takes their activations
        tower(pixel_values=pixel_values)

Supported families: LLaVA, Qwen2-VL / Qwen2.5-VL, Idefics3 / SmolVLM (others with
``tokens_per_image=``). Errors are one-line ValueErrors naming the argument: ``model``
(no image placeholder: a text-only model), ``inputs`` (placeholder count that does not
match the images, an image not on consecutive placeholders), ``keys``.

Papers: registers (arXiv 2309.16588), test-time registers (arXiv 2506.08010), PAI (arXiv 2407.21771), AVC (arXiv 2405.17820), VAR (arXiv 2503.03321), VCD
(arXiv 2311.16922); the reading lists' abstracts on text inertia (CG-VLM), visual
attention score (AVAR), one-token-at-a-time attention shifts (OTaT).
"""

from .highnorm import HighNorm, high_norm, register_neurons, vit_parts
from .measure import blind_tokens, share_curve
from .registers import test_time_registers
from .spans import ImageSpan, ImageSpans, family, image_spans, image_token_id

__all__ = [
    "HighNorm",
    "ImageSpan",
    "ImageSpans",
    "blind_tokens",
    "contrastive_generate",
    "family",
    "high_norm",
    "image_spans",
    "image_token_id",
    "register_neurons",
    "share_curve",
    "test_time_registers",
    "vit_parts",
]


def __getattr__(name):
    if name == "contrastive_generate":  # needs transformers; imported on first use
        from .contrastive import contrastive_generate

        return contrastive_generate
    raise AttributeError(name)
