"""``attnkit.diffusion.maps``: sample with a pipeline and measure its attention.

Per-token cross-attention maps (``TokenMaps``) plus any attnkit meters (entropy, sinks,
...) on the chosen layers, heads and steps, all in O(N) state: no N x N map is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .switch import denoiser, use
from .tokenmaps import TokenMaps

Tensor = torch.Tensor


@dataclass
class DiffusionMaps:
    """What ``maps`` measured. ``maps``: (B, T, h, w) per batch row of the denoiser's
    calls and text token (with classifier-free guidance the unconditional rows come
    first, as diffusers batches them); ``conditional``: the rows of the prompts;
    ``tokens``: the text tokens' strings when the pipeline's tokenizer could name them;
    ``names``: layer number -> module path; ``meters``: the extra meters, fed."""

    maps: Tensor
    conditional: Tensor
    tokens: list[str] | None
    names: dict[int, str]
    meters: list = field(default_factory=list)
    output: object = None
    state_bytes: int = 0

    def rows(self) -> list[tuple]:
        """The extra meters' tidy rows, with module paths for layer numbers."""
        return [(self.names.get(r[0], r[0]), *r[1:]) for m in self.meters for r in m.rows()]


def maps(
    pipeline,
    prompt=None,
    *,
    layers=None,
    kind: str | None = None,
    heads=None,
    steps=None,
    meters=(),
    size: tuple[int, int] | None = None,
    **call_kwargs,
) -> DiffusionMaps:
    """Run ``pipeline(prompt, **call_kwargs)`` and return per-token attention maps.

    Args:
        pipeline: a diffusers pipeline (or any callable with a ``unet``/``transformer``).
        prompt: passed on as ``prompt`` (omit it when passing ``prompt_embeds``).
        layers, kind: which attention layers to measure (module paths, exact; kind
            "cross" or "joint"); default: every layer, maps from those that see text.
        heads: head indices averaged (default: all). steps: denoising steps aggregated.
        meters: further attnkit meters (``Entropy()``, ``SinkMass()``, ...), fed on the
            same layers; their layer numbers map to paths through ``names``.
        size: (h, w) of the returned maps (default: the finest latent grid measured).
    """
    if kind == "self":
        raise ValueError("kind: self-attention has no text tokens to map; use 'cross', 'joint' or None")
    token_maps = TokenMaps(heads=heads, steps=steps)
    extra = list(meters)
    if prompt is not None:
        call_kwargs["prompt"] = prompt
    with use(pipeline, layers=layers, kind=kind, observers=[token_maps, *extra]) as switch:
        with torch.no_grad():
            output = pipeline(**call_kwargs)
        names = switch.names
    result = token_maps.maps(size)
    guided = bool(getattr(pipeline, "do_classifier_free_guidance", False)) and result.shape[0] % 2 == 0
    conditional = result[result.shape[0] // 2 :] if guided else result
    return DiffusionMaps(
        result, conditional, _tokens(pipeline, prompt, result.shape[1]), names, extra, output, token_maps.state_bytes()
    )


def _tokens(pipeline, prompt, count: int) -> list[str] | None:
    tokenizer = getattr(pipeline, "tokenizer", None)
    if tokenizer is None or not isinstance(prompt, str):
        return None
    try:
        ids = tokenizer(prompt, padding="max_length", max_length=count, truncation=True).input_ids
        return list(tokenizer.convert_ids_to_tokens(ids))
    except Exception:  # a tokenizer without these options: the maps stay unnamed
        return None


__all__ = ["DiffusionMaps", "denoiser", "maps"]
