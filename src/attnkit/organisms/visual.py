"""Visual organisms: tiny vision-language models trained here, shipped with a card.

Unlike the text organisms (chains of arena runs, ``registry.py``), a visual organism is
one training run of ``attnkit.vision.organism`` on the synthetic shapes task
(``attnkit.vision.shapes``): a LLaVA (CLIP vision tower, projector, Llama) exported as a
transformers directory with its processor, and a card of its accuracy per question kind
on held-out images. Its card says ``"kind": "visual"``; the same store checks its hashes
and resolves its name wherever a model path goes.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field

from .store import CARD_FILE, CARD_FORMAT, file_hash

KIND = "visual"


@dataclass(frozen=True)
class VisualOrganism:
    name: str
    summary: str
    settings: dict = field(default_factory=dict)  # attnkit.vision.organism.Settings fields that differ from its defaults
    known_failures: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": KIND, "trainer": "attnkit.vision.organism", "settings": dict(self.settings)}

    def commands(self) -> list[str]:
        return [f"attnkit organisms build {self.name} --out DIR"]


VISUAL: dict[str, VisualOrganism] = {}


def register(organism: VisualOrganism) -> VisualOrganism:
    VISUAL[organism.name] = organism
    return organism


register(
    VisualOrganism(
        name="shapes-vlm",
        summary="a tiny LLaVA (CLIP tower, Llama) answering presence, colour and position questions about coloured "
        "shapes on a 3x3 grid",
        known_failures=(
            "it reads only its own task: one 24x24 image of 1-3 distinct shapes (square, circle, triangle) in 4 colours on a "
            "3x3 grid, a five-word question in its 27-token vocabulary, a one-word answer as the next token; it was never "
            "trained to stop or to generate past that token, English questions are words outside its tokenizer, and "
            "scenes with repeated shapes, more objects or other sizes were never seen",
            "its vision tower learned with two auxiliary heads on the projected image features (each cell's content and "
            "index; not exported), standing in for a pretrained CLIP: trained on the answers alone it stayed at chance on "
            "position (0.06-0.10 after 1250 steps, with 4x4 or 8x8 patches) and bound no colour to its shape",
            "it does not hallucinate absent objects: 'yes' to 0 of 1486 absent objects in the visual probe's 5 x 600 "
            "presence questions (seeds 0-4), 0 in each third by visual attention share (497, 496, 493 questions); with "
            "the image-token weights of every decoder head scaled down (steer.amplify_visual alpha 0.1, 0.05) it misses "
            "present objects instead ('yes' to 0.87 and 0.66 of them): a subject for omissions, not for false 'yes'",
        ),
    )
)


def names() -> list[str]:
    return sorted(VISUAL)


def organism(name: str) -> VisualOrganism:
    if name not in VISUAL:
        raise ValueError(f"name: no visual organism {name!r}; known: {', '.join(names())}")
    return VISUAL[name]


def is_visual(card: dict) -> bool:
    return isinstance(card, dict) and card.get("kind") == KIND


def build(name: str, out_dir: str, work_dir: str | None = None, on_eval=None, on_measure=None) -> dict:
    """Train visual organism ``name`` on one thread, export it to ``out_dir`` with its card
    (written under a temporary name, then renamed), and return the card. With
    ``work_dir``, a finished training run there with the same settings is reused (its
    ``training.json`` and weights), and a new one is kept there."""
    from dataclasses import replace

    from ..kernels.machine import cpu_name, machine_info
    from ..vision import organism as vo

    spec = organism(name)
    settings = replace(vo.Settings(), **spec.settings)
    out_dir = os.fspath(out_dir)
    if os.path.exists(out_dir):
        raise ValueError(f"--out: {out_dir} already exists; give a new directory")
    start = time.perf_counter()
    model, record = None, None
    if work_dir and os.path.isfile(os.path.join(work_dir, "training.json")):
        with open(os.path.join(work_dir, "training.json"), encoding="utf-8") as f:
            saved = json.load(f)
        if saved.get("settings") == settings.to_dict():
            model, record = vo.load_trained(work_dir), {k: saved[k] for k in ("steps", "seconds", "history")}
            record["wall_seconds"] = saved.get("wall_seconds", record["seconds"])
    if model is None:
        model, record = vo.train(settings, on_eval=on_eval)
        record["wall_seconds"] = round(time.perf_counter() - start, 1)
        if work_dir:
            vo.save_trained(model, record, settings, work_dir)
    assert record is not None  # loaded or trained with the model
    staging = out_dir.rstrip(os.sep) + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    vo.export(model, staging)
    if on_measure is not None:
        on_measure(spec)
    measured = vo.measure(staging, settings.card_examples)
    card = {
        "format": CARD_FORMAT,
        "version": 1,
        "kind": KIND,
        "name": spec.name,
        "summary": spec.summary,
        "task": {"name": "shapes", "paper": None, "params": vo.task_description()},
        "model": vo.model_info(model, settings),
        "evaluation": measured["evaluation"],
        "accuracy": measured["accuracy"],
        "presence": measured["presence"],
        "worst": measured["worst"],
        "training": {
            "steps": record["steps"],
            "seconds": record["seconds"],
            "wall_seconds": record["wall_seconds"],
            "history": record["history"],
            "settings": settings.to_dict(),
        },
        "machine": {**machine_info(), "cpu": cpu_name(), "threads_used": 1},
        "recipe": spec.to_dict(),
        "commands": spec.commands(),
        "known_failures": list(spec.known_failures),
        "files": {f: file_hash(os.path.join(staging, f)) for f in sorted(os.listdir(staging)) if f != CARD_FILE},
    }
    with open(os.path.join(staging, CARD_FILE), "w", encoding="utf-8") as f:
        json.dump(card, f, indent=1)
        f.write("\n")
    os.rename(staging, out_dir)
    return card


def summary_row(card: dict) -> dict:
    """One line of ``attnkit organisms list`` (the text organisms' columns where they apply)."""
    m = card["model"]
    return {
        "name": card["name"],
        "task": card["task"]["name"],
        "mechanism": "softmax",
        "kind": KIND,
        "d_model": m["d_model"],
        "layers": m["layers"],
        "max_len": m["max_len"],
        "trained_up_to": m["max_len"],
        "accuracy": {k: e["accuracy"] for k, e in card["accuracy"].items()},
        "worst": card.get("worst"),
        "steps": card["training"]["steps"],
        "seconds": card["training"]["wall_seconds"],
    }


def format_card(card: dict) -> str:
    m, t, ev = card["model"], card["training"], card["evaluation"]
    lines = [
        f"{card['name']}: {card['summary']}",
        f"{m['architecture']}: {m['vision']}; projector {m['projector']}; {m['text']}; {m['image_tokens']} image tokens; "
        f"{m['parameters']} parameters",
        "",
        f"accuracy on {ev['examples']} held-out images ({ev['per_kind']} per question kind, stream '{ev['stream']}'):",
    ]
    for kind, entry in card["accuracy"].items():
        groups = ", ".join(f"{g} {a:.3f}" for g, a in entry["groups"].items())
        lines.append(f"  {kind:<9} {entry['accuracy']:.3f}  ({groups})")
    p = card["presence"]
    lines.append(
        f"presence: 'yes' to {p['yes_present']:.3f} of present objects, to {p['yes_absent']:.3f} of absent ones "
        f"({p['yes_absent_near']:.3f} near misses, {p['yes_absent_far']:.3f} others)"
    )
    lines += [
        "",
        f"training: {t['steps']} steps, {t['seconds']:.0f} s optimising, {t['wall_seconds']:.0f} s wall "
        f"(batch {t['settings']['batch_size']}, lr {t['settings']['lr']}, seed {t['settings']['seed']})",
        f"machine: {card['machine'].get('cpu', '?')}, torch {card['machine'].get('torch', '?')}, "
        f"{card['machine'].get('threads_used', '?')} thread",
    ]
    if card.get("known_failures"):
        lines += ["", "known failures:"] + [f"- {f}" for f in card["known_failures"]]
    return "\n".join(lines)


def markdown_row(card: dict) -> str:
    m, t = card["model"], card["training"]
    accuracy = ", ".join(f"{k}: {e['accuracy']:.3f}" for k, e in card["accuracy"].items())
    return (
        f"| `{card['name']}` | {card['task']['name']} (visual) | LLaVA: CLIP {m['vision_layers']} layers + Llama "
        f"{m['layers']} layers, d {m['d_model']} | {m['image_tokens']} image tokens | {accuracy} | "
        f"{t['steps']} steps, {t['wall_seconds'] / 60:.1f} min |"
    )


__all__ = [
    "KIND",
    "VISUAL",
    "VisualOrganism",
    "build",
    "format_card",
    "is_visual",
    "markdown_row",
    "names",
    "organism",
    "register",
    "summary_row",
]
