"""Building an organism from a recipe: stages chained by warm starts, the export, the card."""

import json
import os
import shlex

import pytest

from attnkit.cli import build_parser
from attnkit.organisms import names, recipe
from attnkit.organisms.builder import build, compare
from attnkit.organisms.store import verify


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_recipe):
    out = tmp_path_factory.mktemp("organisms") / "tiny"
    seen = []
    card = build(tiny_recipe, str(out), on_eval=lambda stage, record, config: seen.append((stage.name, record["step"])))
    return str(out), card, seen


def test_a_build_runs_every_stage_from_the_one_before_and_cards_the_export(built):
    out, card, seen = built
    assert seen == [("copy", 3), ("grow", 2), ("grow", 4)]
    assert {"config.json", "model.safetensors", "task.json", "tokenizer.json", "card.json"} <= set(os.listdir(out))
    assert verify(out) == card  # every file's hash checks
    assert set(card["accuracy"]) == {"16", "64"}
    assert set(card["accuracy"]["64"]["groups"]) == {"depth=0.00", "depth=0.50", "depth=1.00"}
    assert card["model"]["max_len"] == 64 and card["model"]["mechanism"] == "softmax" and card["model"]["parameters"] > 0
    assert [s["name"] for s in card["training"]["stages"]] == ["copy", "grow"] and card["training"]["steps"] == 7
    assert card["worst"]["accuracy"] == min(min(e["groups"].values()) for e in card["accuracy"].values())
    assert card["known_failures"] == ["everything: it trained for 7 steps"] and card["machine"]["threads_used"] == 1
    training = json.loads(open(os.path.join(out, "task.json")).read())["training"]
    assert training["init"]["init"] == "stage copy" and training["schedule"] == "16:2,32+64:2x4"


def test_a_rebuild_is_deterministic_and_compare_measures_the_distance(built, tmp_path, tiny_recipe):
    out, card, _ = built
    again = build(tiny_recipe, str(tmp_path / "again"))
    assert again["files"]["model.safetensors"] == card["files"]["model.safetensors"]
    assert compare(again, card)["largest"] == 0.0
    shifted = json.loads(json.dumps(card))
    shifted["accuracy"]["64"]["groups"]["depth=0.00"] -= 0.25
    assert compare(again, shifted)["largest"] == pytest.approx(0.25)


@pytest.mark.parametrize("name", names())
def test_every_recipe_is_a_chain_of_valid_arena_command_lines(name):
    parser = build_parser()
    commands = recipe(name).commands()
    assert len(commands) == len(recipe(name).stages)
    for i, line in enumerate(commands):
        args = parser.parse_args(shlex.split(line)[1:])
        assert args.command == "arena" and (args.init is None) == (i == 0)


def test_an_unknown_recipe_lists_the_known_ones():
    with pytest.raises(ValueError, match="^name: no organism 'needle-9k'; known: .*needle-1k"):
        recipe("needle-9k")
