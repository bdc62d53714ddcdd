"""Synthetic scenes for the visual organism: a few coloured shapes on a grid, and
questions about their presence, colour and position.

A scene is a 3 × 3 grid of 8-pixel cells (a 24 × 24 RGB image) holding one to three
objects in distinct cells, each a filled square, circle or triangle in red, green, blue
or yellow, drawn with a small random offset inside its cell on a dark background with
mild pixel noise. The shapes in one scene are distinct, so "the circle" names one object.

Questions are word sequences over a closed vocabulary (``WORDS``) with a one-word answer,
each ending on the shape it asks about (no question mark: the last token, which predicts
the answer, is the shape's own word):

- ``presence``: ``is there a red circle`` → ``yes`` / ``no``. Half of them ask about an
  object in the scene; the other half about one that is not there, most often a near
  miss (its colour or its shape is in the scene, the pair is not), so "no" needs the
  colour and the shape bound to one object.
- ``colour``: ``what color is the circle`` → ``red``.
- ``position``: ``where is the red circle`` → one of nine cell names
  (``top-left`` … ``bottom-right``).

Everything is deterministic given a seed (numpy's PCG64): ``examples(n, seed)`` returns
the same scenes and questions on every machine; the organism trains on one stream of
seeds and is measured on others (``STREAMS``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

GRID = 3
CELL = 8
IMAGE_SIZE = GRID * CELL
COLOURS = {"red": (220, 40, 40), "green": (40, 190, 60), "blue": (50, 80, 230), "yellow": (225, 215, 40)}
SHAPES = ("square", "circle", "triangle")
POSITIONS = ("top-left", "top", "top-right", "left", "center", "right", "bottom-left", "bottom", "bottom-right")
KINDS = ("presence", "colour", "position")
#: the question words, then the answers; the image placeholder and padding are added by the organism's tokenizer
WORDS = ("is", "there", "a", "what", "color", "where", "the", "yes", "no") + tuple(COLOURS) + SHAPES + POSITIONS
#: seeds of the example streams: training draws from "train" only; the card and tests from the others
STREAMS = {"train": 1_000, "card": 2_000_003, "test": 3_000_017, "probe": 4_000_037}
MAX_OBJECTS = 3


@dataclass(frozen=True)
class Obj:
    colour: str
    shape: str
    cell: int  # 0..8, row-major from the top left

    @property
    def position(self) -> str:
        return POSITIONS[self.cell]


@dataclass(frozen=True)
class Example:
    """One scene and one question about it. ``absent`` is set for presence questions
    about an object that is not in the scene (answer "no")."""

    image: np.ndarray = field(repr=False)  # (IMAGE_SIZE, IMAGE_SIZE, 3) uint8
    objects: tuple[Obj, ...]
    kind: str
    question: str
    answer: str
    absent: bool = False
    near_miss: bool = False


def _mask(shape: str, size: int = 6) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size]
    if shape == "square":
        return np.ones((size, size), dtype=bool)
    if shape == "circle":
        c = (size - 1) / 2
        return (yy - c) ** 2 + (xx - c) ** 2 <= (size / 2) ** 2 - 0.5
    if shape == "triangle":  # apex up: row r spans the middle r+1 columns (both halves)
        half = (yy + 1) / 2
        return np.abs(xx - (size - 1) / 2) <= half
    raise ValueError(f"shape: expected one of {', '.join(SHAPES)}, got {shape!r}")


_MASKS = {s: _mask(s) for s in SHAPES}


def render(objects, rng: np.random.Generator | None = None) -> np.ndarray:
    """The image of ``objects`` (uint8, IMAGE_SIZE × IMAGE_SIZE × 3). With ``rng``, each
    shape sits at a random offset of 0–2 pixels inside its cell and the pixels get noise;
    without, every shape is centred and the image noiseless."""
    image: np.ndarray = np.full((IMAGE_SIZE, IMAGE_SIZE, 3), 20, dtype=np.int16)
    if rng is not None:
        image += rng.integers(-12, 13, size=image.shape, dtype=np.int16)
    for obj in objects:
        if obj.colour not in COLOURS:
            raise ValueError(f"objects: colour {obj.colour!r} is not one of {', '.join(COLOURS)}")
        if not 0 <= obj.cell < GRID * GRID:
            raise ValueError(f"objects: cell {obj.cell} outside 0..{GRID * GRID - 1}")
        dy, dx = rng.integers(0, 3, size=2) if rng is not None else (1, 1)
        top, left = (obj.cell // GRID) * CELL + int(dy), (obj.cell % GRID) * CELL + int(dx)
        mask = _MASKS[obj.shape]
        region = image[top : top + 6, left : left + 6]
        colour = np.array(COLOURS[obj.colour], dtype=np.int16)
        if rng is not None:
            colour = colour + rng.integers(-15, 16, size=3, dtype=np.int16)
        region[mask] = colour
    return np.clip(image, 0, 255).astype(np.uint8)


def scene(rng: np.random.Generator, num_objects: int | None = None) -> tuple[Obj, ...]:
    """One to MAX_OBJECTS objects with distinct shapes in distinct cells."""
    n = int(rng.integers(1, MAX_OBJECTS + 1)) if num_objects is None else num_objects
    shapes = rng.permutation(len(SHAPES))[:n]
    cells = rng.permutation(GRID * GRID)[:n]
    colours = list(COLOURS)
    return tuple(Obj(colours[int(rng.integers(len(colours)))], SHAPES[int(s)], int(c)) for s, c in zip(shapes, cells))


def _absent_object(rng: np.random.Generator, objects) -> tuple[str, str, bool]:
    present = {(o.colour, o.shape) for o in objects}
    candidates = [(c, s) for c in COLOURS for s in SHAPES if (c, s) not in present]
    near = [(c, s) for c, s in candidates if any(c == o.colour or s == o.shape for o in objects)]
    pool = near if near and rng.random() < 0.75 else candidates
    c, s = pool[int(rng.integers(len(pool)))]
    return c, s, (c, s) in near


def question(rng: np.random.Generator, objects, kind: str) -> tuple[str, str, bool, bool]:
    """(question, answer, absent, near_miss) of ``kind`` about the scene ``objects``."""
    if kind == "presence":
        if rng.random() < 0.5:
            o = objects[int(rng.integers(len(objects)))]
            return f"is there a {o.colour} {o.shape}", "yes", False, False
        c, s, near = _absent_object(rng, objects)
        return f"is there a {c} {s}", "no", True, near
    o = objects[int(rng.integers(len(objects)))]
    if kind == "colour":
        return f"what color is the {o.shape}", o.colour, False, False
    if kind == "position":
        return f"where is the {o.colour} {o.shape}", o.position, False, False
    raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")


def examples(n: int, seed: int | Sequence[int], kinds=KINDS, noise: bool = True) -> list[Example]:
    """``n`` examples from the stream ``seed``, the question kinds cycling through ``kinds``
    (so each kind has an equal share); the same seed gives the same examples."""
    if n < 0:
        raise ValueError(f"n: expected a count >= 0, got {n}")
    kinds = tuple(kinds)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"kinds: expected some of {', '.join(KINDS)}, got {', '.join(map(repr, unknown or kinds)) or 'none'}")
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        objects = scene(rng)
        kind = kinds[i % len(kinds)]
        q, a, absent, near = question(rng, objects, kind)
        out.append(Example(render(objects, rng if noise else None), objects, kind, q, a, absent, near))
    return out


def stream(name: str) -> int:
    """The seed of a named example stream (``STREAMS``)."""
    if name not in STREAMS:
        raise ValueError(f"stream: expected one of {', '.join(STREAMS)}, got {name!r}")
    return STREAMS[name]


__all__ = [
    "CELL",
    "COLOURS",
    "Example",
    "GRID",
    "IMAGE_SIZE",
    "KINDS",
    "MAX_OBJECTS",
    "Obj",
    "POSITIONS",
    "SHAPES",
    "STREAMS",
    "WORDS",
    "examples",
    "question",
    "render",
    "scene",
    "stream",
]
