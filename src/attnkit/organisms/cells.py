"""Organism builds as sweep cells (``attnkit.sweeps``): the ``organism`` cell kind builds
one recipe (carried in the cell's config, so a worker or a Ray node needs no registry)
into ``out`` and returns its card as tidy rows, one per length and group.

    attnkit organisms build needle-1k,needle-2k --engine local --workers 2 --store builds --out built
"""

from __future__ import annotations

import os


def organism_cell(config: dict) -> list[dict]:
    """The ``organism`` cell kind: ``{"recipe": Recipe.to_dict(), "known_failures": [...],
    "out": DIR}``; rows of the card (accuracy per length and group, training seconds)."""
    from ..sweeps import report_line
    from .builder import build
    from .recipes import Recipe

    recipe = Recipe.from_dict(config["recipe"], tuple(config.get("known_failures", ())))
    out = os.path.join(config["out"], recipe.name)
    card = build(recipe, out, on_eval=lambda stage, record, train: report_line(f"{stage.name} step {record['step']}"))
    return card_rows(card, out)


def card_rows(card: dict, out: str) -> list[dict]:
    """A card as tidy rows: ``accuracy`` per (length, group; ``all`` for the whole length),
    ``train_seconds`` and ``wall_seconds``, each with the organism's name and export path."""
    where = {"organism": card["name"], "path": out}
    rows = []
    for length, entry in card["accuracy"].items():
        rows.append({**where, "length": int(length), "group": "all", "metric": "accuracy", "value": entry["accuracy"]})
        rows += [
            {**where, "length": int(length), "group": g, "metric": "accuracy", "value": a} for g, a in entry["groups"].items()
        ]
    rows.append({**where, "metric": "train_seconds", "value": card["training"]["seconds"]})
    rows.append({**where, "metric": "wall_seconds", "value": card["training"]["wall_seconds"]})
    return rows


def organism_cells(names: list[str], out: str) -> list:
    """One cell per recipe name, each building into ``out/NAME``."""
    from ..sweeps import Cell
    from .registry import recipe

    cells = []
    for name in names:
        r = recipe(name)
        cells.append(
            Cell(
                "organism",
                {"recipe": r.to_dict(), "known_failures": list(r.known_failures), "out": os.path.abspath(os.fspath(out))},
                label=f"organism {name}",
            )
        )
    return cells


__all__ = ["card_rows", "organism_cell", "organism_cells"]
