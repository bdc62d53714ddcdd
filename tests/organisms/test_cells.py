"""Organism builds as sweep cells: the recipe travels in the cell, the card comes back as
rows, and a local worker process builds the same bytes as a build in this process."""

import os

import pytest

from attnkit.organisms.builder import build
from attnkit.organisms.cells import card_rows, organism_cell, organism_cells
from attnkit.organisms.recipes import Recipe
from attnkit.organisms.store import verify
from attnkit.sweeps import Cell, LocalEngine, load, run_sweep


def test_a_recipe_survives_the_trip_through_a_cell(tiny_recipe):
    assert Recipe.from_dict(tiny_recipe.to_dict(), tiny_recipe.known_failures) == tiny_recipe


def test_the_cell_builds_the_recipe_and_returns_its_card(tiny_recipe, tmp_path):
    rows = organism_cell(
        {"recipe": tiny_recipe.to_dict(), "known_failures": list(tiny_recipe.known_failures), "out": str(tmp_path)}
    )
    out = tmp_path / tiny_recipe.name
    card = verify(str(out))
    assert rows == card_rows(card, str(out))
    for length, entry in card["accuracy"].items():
        row = [r for r in rows if r.get("length") == int(length) and r.get("group") == "all"]
        assert [r["value"] for r in row] == [entry["accuracy"]]
    assert card["known_failures"] == list(tiny_recipe.known_failures)


def test_cells_name_their_recipes_and_refuse_unknown_ones(tmp_path):
    cells = organism_cells(["needle-32", "induction-32"], tmp_path)
    assert [c.config["recipe"]["name"] for c in cells] == ["needle-32", "induction-32"]
    assert all(c.config["out"] == os.path.abspath(tmp_path) for c in cells)
    with pytest.raises(ValueError, match="^name: no organism 'nope'"):
        organism_cells(["nope"], tmp_path)


@pytest.mark.slow
def test_a_worker_process_builds_the_same_bytes(tiny_recipe, tmp_path):
    cell = Cell(
        "organism",
        {"recipe": tiny_recipe.to_dict(), "known_failures": list(tiny_recipe.known_failures), "out": str(tmp_path / "swept")},
    )
    result = run_sweep([cell], str(tmp_path / "store"), LocalEngine(workers=1))
    assert result.failed == [] and result.computed == [cell.hash]
    here = build(tiny_recipe, str(tmp_path / "here"))
    there = verify(str(tmp_path / "swept" / tiny_recipe.name))
    assert there["files"]["model.safetensors"] == here["files"]["model.safetensors"]
    assert [r["value"] for r in load(str(tmp_path / "store"), with_cell=False) if r["metric"] == "accuracy"] == [
        r["value"] for r in card_rows(there, "") if r["metric"] == "accuracy"
    ]
