"""The organisms shipped inside the package, and organism names where model paths go.

Each shipped organism is a transformers export (config.json, model.safetensors, the
tokenizer files, task.json) in ``organisms/data/<name>/`` with its ``card.json``; the card
lists the SHA-256 of every other file, checked whenever the organism is looked up, so a
damaged or altered file is named before any model reads it. Only the standard library
is used here: resolving a name costs no torch or transformers import.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import resources

CARD_FILE = "card.json"
CARD_FORMAT = "attnkit.organism.card"


def data_dir() -> str:
    """The folder holding the shipped organisms."""
    return str(resources.files(__package__).joinpath("data"))


def shipped(kind: str | None = None) -> list[str]:
    """Names of the organisms whose weights ship with this install; ``kind`` "text" (the
    arena's language models) or "visual" (``organisms/visual.py``) keeps those only."""
    if kind not in (None, "text", "visual"):
        raise ValueError(f"kind: expected None, 'text' or 'visual', got {kind!r}")
    root = data_dir()
    if not os.path.isdir(root):
        return []
    found = sorted(d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, CARD_FILE)))
    return found if kind is None else [d for d in found if card_kind(os.path.join(root, d)) == kind]


def card_kind(directory: str) -> str:
    """ "visual" when the card in ``directory`` says so, else "text" (the cards before visual organisms name no kind)."""
    try:
        with open(os.path.join(directory, CARD_FILE), encoding="utf-8") as f:
            return "visual" if json.load(f).get("kind") == "visual" else "text"
    except (OSError, ValueError, AttributeError):
        return "text"


def file_hash(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_card(directory: str) -> dict:
    """The card in ``directory`` (an organism's export), as a dict; errors name the file."""
    path = os.path.join(directory, CARD_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            card = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"card: {path} is not a readable organism card: {e}") from None
    if not isinstance(card, dict) or card.get("format") != CARD_FORMAT:
        raise ValueError(
            f"card: {path} has format {card.get('format') if isinstance(card, dict) else None!r}, expected {CARD_FORMAT!r}"
        )
    return card


def verify(directory: str) -> dict:
    """The card of the organism in ``directory`` after checking every file it lists
    against its hash; a ValueError names the first missing or mismatching file."""
    card = read_card(directory)
    files = card.get("files")
    if not isinstance(files, dict) or "model.safetensors" not in files:
        raise ValueError(f"card: {os.path.join(directory, CARD_FILE)} lists no files with hashes (model.safetensors at least)")
    for name, expected in files.items():
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise ValueError(f"card: {path} is missing (the card lists it with sha256 {expected[:12]}...)")
        actual = file_hash(path)
        if actual != expected:
            raise ValueError(
                f"card: {path} does not match its hash (sha256 {actual[:12]}..., the card says "
                f"{expected[:12]}...): the file is damaged or was changed after the card was measured"
            )
    return card


def organism_path(name: str) -> str:
    """The verified export directory of the shipped organism ``name``; an unknown name
    lists the known ones."""
    known = shipped()
    if name not in known:
        raise ValueError(f"name: no shipped organism {name!r}; shipped: {', '.join(known) or 'none'}")
    directory = os.path.join(data_dir(), name)
    verify(directory)
    return directory


#: options that take an organism's weights only (a warm start), never run it as transformers would
WEIGHTS_ONLY = ("--init",)


def other_mechanisms(directory: str) -> list[str]:
    """The mechanisms other than softmax the export in ``directory`` runs (config.json's
    ``attnkit_mechanisms``, see ``attnkit.arena.export``); [] for a plain Llama."""
    try:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
            layers = json.load(f).get("attnkit_mechanisms") or []
    except (OSError, ValueError):
        return []
    return sorted({entry["mechanism"] for entry in layers})


def looks_like_name(text: str) -> bool:
    """A bare word (no path separator, no leading dot): what an organism name looks like."""
    return bool(text) and os.sep not in text and (os.altsep is None or os.altsep not in text) and not text.startswith(".")


def resolve_model_path(text: str, option: str = "--model") -> str:
    """``text`` as a model directory: an existing path as given, a shipped organism's
    name as its verified directory. A bare name that is neither is an error (naming
    ``option``) that lists the organisms; any other path is returned for the caller's
    own "no such directory" error. An organism running another mechanism than softmax
    (sigmoid, linear) is refused unless ``option`` takes weights only (``--init``):
    callers load the directory with transformers, which would run it as softmax."""
    if not isinstance(text, (str, os.PathLike)):
        return text
    text = os.fspath(text)
    if os.path.exists(text) or not looks_like_name(text):
        return text
    known = shipped()
    if text in known:
        try:
            directory = organism_path(text)
        except ValueError as e:
            raise ValueError(f"{option}: organism {text}: {str(e).removeprefix('card: ')}") from None
        mechanisms = other_mechanisms(directory)
        if mechanisms and option not in WEIGHTS_ONLY:
            raise ValueError(
                f"{option}: organism {text} runs {', '.join(mechanisms)} attention, which a transformers "
                f"Llama loaded from its files computes as softmax; load it with attnkit.organisms.load({text!r})"
            )
        return directory
    raise FileNotFoundError(f"{option}: no such directory or organism: {text!r}; organisms: {', '.join(known) or 'none shipped'}")


__all__ = [
    "CARD_FILE",
    "CARD_FORMAT",
    "card_kind",
    "data_dir",
    "file_hash",
    "organism_path",
    "other_mechanisms",
    "read_card",
    "resolve_model_path",
    "shipped",
    "verify",
]
