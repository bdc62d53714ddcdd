"""An organism's card: what the shipped weights measurably do, and how they were made.

``card.json`` sits beside the export's files and holds

- ``accuracy``: per length, the overall accuracy and per group (needle: per depth) on
  ``evaluation.examples_per_length`` held-out prompts (see evaluate.py);
- ``worst``: the lowest cell (length × group) at the lengths it was trained up to
  (``model.trained_up_to``; longer ones are stated failures, not claims);
- ``training``: the steps and seconds of each stage (optimisation only, as the arena
  counts them) and the build's wall time; ``machine``: where it was built;
- ``recipe`` and ``commands``: how to build it again, as data and as arena command lines;
- ``known_failures``: what it does not do;
- ``files``: the SHA-256 of every file of the export (checked at load, see store.py).
"""

from __future__ import annotations

import os

from .store import CARD_FILE, CARD_FORMAT, file_hash

VERSION = 1


def hashes(directory: str) -> dict[str, str]:
    """SHA-256 of every file in ``directory`` but the card."""
    return {
        name: file_hash(os.path.join(directory, name))
        for name in sorted(os.listdir(directory))
        if name != CARD_FILE and os.path.isfile(os.path.join(directory, name))
    }


def worst_cell(accuracy: dict, max_len: int) -> dict | None:
    """The lowest (length, group) cell at lengths up to ``max_len``."""
    cells = [
        (g_acc, int(n), g)
        for n, entry in accuracy.items()
        if int(n) <= max_len
        for g, g_acc in (entry["groups"] or {"all": entry["accuracy"]}).items()
    ]
    if not cells:
        return None
    acc, n, g = min(cells)
    return {"length": n, "group": g, "accuracy": acc}


def make_card(recipe, task, model_info: dict, accuracy: dict, training: dict, machine: dict, directory: str) -> dict:
    return {
        "format": CARD_FORMAT,
        "version": VERSION,
        "name": recipe.name,
        "summary": recipe.summary,
        "task": {"name": task.name, "paper": task.paper, "params": task.params()},
        "model": model_info,
        "evaluation": {
            "lengths": [int(n) for n in accuracy],
            "examples_per_length": recipe.card_examples,
            "prompts": "the task's held-out examples from the 'card' stream (no training run draws from it); "
            "groups cycle through the task's depths (needle) so each group has an equal share",
            "loaded_as": "transformers AutoModelForCausalLM, float32",
        },
        "accuracy": accuracy,
        "worst": worst_cell(accuracy, model_info["trained_up_to"]),
        "training": training,
        "machine": machine,
        "recipe": recipe.to_dict(),
        "commands": recipe.commands(),
        "known_failures": list(recipe.known_failures),
        "files": hashes(directory),
    }


def summary_row(card: dict) -> dict:
    """One line of ``attnkit organisms list`` and the README table."""
    acc = card["accuracy"]
    return {
        "name": card["name"],
        "task": card["task"]["name"],
        "mechanism": card["model"]["mechanism"],
        "d_model": card["model"]["d_model"],
        "layers": card["model"]["layers"],
        "max_len": card["model"]["max_len"],
        "trained_up_to": card["model"]["trained_up_to"],
        "accuracy": {n: e["accuracy"] for n, e in acc.items()},
        "worst": card.get("worst"),
        "steps": card["training"]["steps"],
        "seconds": card["training"]["wall_seconds"],
    }


def format_card(card: dict) -> str:
    """The card as text: accuracy per length x group, training, machine, known failures."""
    lines = [
        f"{card['name']}: {card['summary']}",
        f"task {card['task']['name']} ({card['task']['paper']}), {card['model']['mechanism']} d_model "
        f"{card['model']['d_model']}, {card['model']['layers']} layers, {card['model']['heads']} heads, "
        f"trained up to {card['model']['trained_up_to']} tokens (context {card['model']['max_len']}), "
        f"{card['model']['parameters']} parameters",
    ]
    acc = card["accuracy"]
    groups = sorted({g for e in acc.values() for g in e["groups"]})
    header = f"{'length':>7} {'all':>6} " + " ".join(f"{g:>11}" for g in groups)
    lines += ["", f"accuracy on {card['evaluation']['examples_per_length']} held-out prompts per length:", header]
    for n, entry in acc.items():
        lines.append(
            f"{n:>7} {entry['accuracy']:>6.3f} " + " ".join(f"{entry['groups'].get(g, float('nan')):>11.3f}" for g in groups)
        )
    worst = card.get("worst")
    if worst:
        lines.append(
            f"worst cell up to the trained length ({card['model']['trained_up_to']}): {worst['accuracy']:.3f} at "
            f"{worst['length']} tokens, {worst['group']}"
        )
    t = card["training"]
    lines += [
        "",
        f"training: {t['steps']} steps, {t['seconds']:.0f} s optimising, {t['wall_seconds']:.0f} s wall "
        f"({len(t['stages'])} stages: " + ", ".join(f"{s['name']} {s['steps']}" for s in t["stages"]) + ")",
        f"machine: {card['machine'].get('cpu', '?')}, torch {card['machine'].get('torch', '?')}, "
        f"{card['machine'].get('threads_used', '?')} thread",
    ]
    if card.get("known_failures"):
        lines += ["", "known failures:"] + [f"- {f}" for f in card["known_failures"]]
    return "\n".join(lines)


def markdown_table(cards: list[dict]) -> str:
    """The cards as one Markdown table (the README's): accuracy per length with the
    weakest depth, build steps and time."""
    lines = [
        "| organism | task | model | trained up to | accuracy by length (weakest group) | training |",
        "|---|---|---|---|---|---|",
    ]
    for card in cards:
        m, t = card["model"], card["training"]
        accuracy = ", ".join(
            f"{n}: {e['accuracy']:.3f} ({min(e['groups'].values()):.2f})" if e["groups"] else f"{n}: {e['accuracy']:.3f}"
            for n, e in card["accuracy"].items()
        )
        lines.append(
            f"| `{card['name']}` | {card['task']['name']} | {m['mechanism']}, d {m['d_model']}, {m['layers']} layers, "
            f"{m['heads']} heads | {m['trained_up_to']} | {accuracy} | {t['steps']} steps, "
            f"{t['wall_seconds'] / 60:.1f} min |"
        )
    return "\n".join(lines)


__all__ = ["VERSION", "format_card", "hashes", "make_card", "markdown_table", "summary_row", "worst_cell"]
