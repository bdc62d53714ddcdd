"""Where the images sit in a vision-language model's token sequence.

A vision-language model in transformers writes one placeholder token per image feature
into ``input_ids`` (``config.image_token_id``, ``image_token_index`` in older configs)
and overwrites those embeddings with the projected vision features. So the image tokens
are exactly the placeholder positions, and which image each belongs to follows from the
number of features each image yields, which the model's config and the image sizes fix:

- LLaVA: ``(image_size / patch_size)²`` per image (one more with
  ``vision_feature_select_strategy="full"``, the CLS token), a square patch grid.
- Qwen2-VL / Qwen2.5-VL: ``t·h·w / spatial_merge_size²`` per image from the processor's
  ``image_grid_thw``, a grid of ``(h / merge, w / merge)`` tokens.
- Idefics3 / SmolVLM: ``(image_size / patch_size)² / scale_factor²`` per image (each
  tile of a split image counts as one), a square grid after the pixel shuffle; images
  of ``pixel_values`` that are all zeros are padding, as the model itself treats them.

Nothing is guessed: a placeholder count that does not add up to the images' features,
or an image that does not sit on consecutive placeholders, is a ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class ImageSpan:
    """One image: batch ``row``, token positions ``start:end`` and its token ``grid``
    (rows, columns) in reading order, or None when the family has no grid."""

    row: int
    start: int
    end: int
    grid: tuple[int, int] | None
    index: int  # the image's number in the batch (the order of pixel_values)

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ImageSpans:
    """The image tokens of one batch of inputs: ``images`` in order, over ``batch`` rows
    of ``length`` tokens (the prompt as the model sees it, padding included)."""

    images: tuple[ImageSpan, ...]
    batch: int
    length: int
    family: str

    @property
    def mask(self) -> Tensor:
        """(batch, length) bool: True on image tokens."""
        out = torch.zeros(self.batch, self.length, dtype=torch.bool)
        for im in self.images:
            out[im.row, im.start : im.end] = True
        return out

    def rows(self) -> list[list[tuple[int, int]]]:
        """Per batch row, the (start, end) of its images."""
        out: list[list[tuple[int, int]]] = [[] for _ in range(self.batch)]
        for im in self.images:
            out[im.row].append((im.start, im.end))
        return out

    @property
    def first_step(self) -> int:
        """Query position whose output is the first generated token (``length - 1``)."""
        return self.length - 1

    def meter(self, **kwargs):
        """An ``attnkit.observe.VisualAttention`` meter over these image tokens."""
        from ..observe.visual import VisualAttention

        return VisualAttention(self.mask, **kwargs)


def image_token_id(model) -> int:
    """The placeholder id of ``model`` (a model or its config); a ValueError naming
    ``model`` for a text-only one."""
    config = getattr(model, "config", model)
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    raise ValueError(
        f"model: {type(config).__name__} declares no image placeholder (config.image_token_id / image_token_index); "
        "it is not a vision-language model attnkit can locate images in"
    )


def family(model) -> str:
    config = getattr(model, "config", model)
    kind = getattr(config, "model_type", "")
    if kind in ("qwen2_vl", "qwen2_5_vl"):
        return "qwen2_vl"
    if kind in ("idefics3", "smolvlm"):
        return "idefics3"
    if kind in ("llava", "vipllava"):
        return "llava"
    return kind


def image_spans(model, inputs: Mapping, *, tokens_per_image: int | None = None) -> ImageSpans:
    """The image tokens of ``inputs`` (the processor's output: ``input_ids`` and the
    image tensors it made) for ``model``. ``tokens_per_image`` is for a family attnkit
    does not know: then every image takes that many consecutive placeholders."""
    if not isinstance(inputs, Mapping) or "input_ids" not in inputs:
        raise ValueError("inputs: expected the processor's output (a mapping with input_ids and the image tensors)")
    ids = torch.as_tensor(inputs["input_ids"])
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2:
        raise ValueError(f"inputs: input_ids must be (batch, tokens), got shape {tuple(ids.shape)}")
    token = image_token_id(model)
    config = getattr(model, "config", model)
    kind = family(config)
    placeholder = ids == token
    if tokens_per_image is not None:
        if isinstance(tokens_per_image, bool) or not isinstance(tokens_per_image, int) or tokens_per_image < 1:
            raise ValueError(f"tokens_per_image: expected an int >= 1, got {tokens_per_image!r}")
        sizes = _fixed(placeholder, tokens_per_image, None, _count(inputs, kind))
    elif kind == "qwen2_vl":
        sizes = _qwen(config, inputs)
    elif kind == "idefics3":
        side = config.vision_config.image_size // config.vision_config.patch_size // config.scale_factor
        sizes = _fixed(placeholder, side * side, (side, side), _count(inputs, kind))
    elif kind == "llava":
        side = config.vision_config.image_size // config.vision_config.patch_size
        extra = 1 if getattr(config, "vision_feature_select_strategy", "default") == "full" else 0
        sizes = _fixed(placeholder, side * side + extra, None if extra else (side, side), _count(inputs, kind))
    else:
        raise ValueError(
            f"model: attnkit does not know how many tokens each image takes in a {type(config).__name__} "
            "(known: LLaVA, Qwen2-VL, Qwen2.5-VL, Idefics3, SmolVLM); pass tokens_per_image="
        )
    return ImageSpans(_assign(placeholder, sizes), ids.shape[0], ids.shape[1], kind)


def _count(inputs: Mapping, kind: str) -> int | None:
    """Number of real images in ``pixel_values`` (None when not given)."""
    px = inputs.get("pixel_values")
    if px is None:
        return None
    px = torch.as_tensor(px)
    if kind == "idefics3":
        if px.dim() != 5:
            raise ValueError(
                f"inputs: Idefics3 pixel_values must be (batch, images, channels, height, width), got {tuple(px.shape)}"
            )
        flat = px.reshape(px.shape[0] * px.shape[1], -1)
        return int((flat != 0).any(-1).sum())  # all-zero images are padding, as the model drops them
    if px.dim() != 4:
        raise ValueError(f"inputs: pixel_values must be (images, channels, height, width), got {tuple(px.shape)}")
    return px.shape[0]


def _fixed(placeholder: Tensor, per_image: int, grid, count: int | None) -> list[tuple[int, tuple | None]]:
    total = int(placeholder.sum())
    if count is None:
        if total % per_image:
            raise ValueError(
                f"inputs: input_ids hold {total} image placeholders, not a multiple of the {per_image} each image takes"
            )
        count = total // per_image
    if count * per_image != total:
        raise ValueError(
            f"inputs: {count} image(s) in pixel_values need {count * per_image} placeholder tokens ({per_image} each), "
            f"but input_ids hold {total}"
        )
    return [(per_image, grid)] * count


def _qwen(config, inputs: Mapping) -> list[tuple[int, tuple | None]]:
    thw = inputs.get("image_grid_thw")
    if thw is None:
        raise ValueError("inputs: Qwen2-VL needs image_grid_thw (the processor returns it with pixel_values) to size each image")
    thw = torch.as_tensor(thw)
    if thw.dim() != 2 or thw.shape[1] != 3:
        raise ValueError(f"inputs: image_grid_thw must be (images, 3), got {tuple(thw.shape)}")
    merge = config.vision_config.spatial_merge_size
    out = []
    for t, h, w in thw.tolist():
        if h % merge or w % merge:
            raise ValueError(f"inputs: image_grid_thw ({t}, {h}, {w}) is not divisible by spatial_merge_size {merge}")
        out.append((t * h * w // (merge * merge), (h // merge, w // merge) if t == 1 else None))
    total, need = int((torch.as_tensor(inputs["input_ids"]) == config.image_token_id).sum()), sum(n for n, _ in out)
    if total != need:
        raise ValueError(
            f"inputs: {len(out)} image(s) in image_grid_thw need {need} placeholder tokens, but input_ids hold {total}"
        )
    return out


def _assign(placeholder: Tensor, sizes: list[tuple[int, tuple | None]]) -> tuple[ImageSpan, ...]:
    """Images in order over the placeholders in reading order (row by row), each on
    ``n`` consecutive placeholders of one row."""
    if not sizes:
        return ()
    images, i = [], 0
    for row in range(placeholder.shape[0]):
        where = placeholder[row].nonzero().view(-1).tolist()
        at = 0
        while at < len(where):
            if i >= len(sizes):
                raise ValueError("inputs: input_ids hold more image placeholders than the images need")
            n, grid = sizes[i]
            start = where[at]
            if at + n > len(where) or where[at + n - 1] != start + n - 1:
                raise ValueError(
                    f"inputs: image {i} needs {n} consecutive placeholder tokens from position {start} of row {row}, "
                    "but the run is cut short"
                )
            images.append(ImageSpan(row, start, start + n, grid, i))
            at += n
            i += 1
    if i != len(sizes):
        raise ValueError(f"inputs: {len(sizes)} image(s) given, but input_ids hold placeholders for {i}")
    return tuple(images)
