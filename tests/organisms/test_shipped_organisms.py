"""Every organism shipped with the package: files intact, card well-formed, and its accuracy
re-measured on a small sample of prompts the card was not measured on, within the
spread that sample size allows."""

import math
import os

import pytest

from attnkit import organisms
from attnkit.organisms.evaluate import accuracy_at, load_export

SHIPPED = organisms.shipped("text")  # the arena's language models (visual ones: tests/vision)
#: prompts per length in the re-check (the card has ``examples_per_length``, 500)
RECHECK = 60


def binomial_tolerance(p: float, n: int, n_card: int) -> float:
    """4 standard deviations of the difference of two accuracies measured on n and n_card
    prompts (p held away from 0 and 1, where the variance vanishes), plus one prompt."""
    q = min(max(p, 0.05), 0.95)
    return 4 * math.sqrt(q * (1 - q) * (1 / n + 1 / n_card)) + 1 / n


def test_the_package_ships_the_organisms_the_docs_promise():
    assert {"needle-32", "needle-1k"} <= set(SHIPPED)
    assert set(SHIPPED) <= set(organisms.names())  # each shipped one has its recipe


@pytest.mark.parametrize("name", SHIPPED)
def test_files_match_the_card_and_the_card_is_complete(name):
    directory = organisms.path(name)  # checks every hash
    card = organisms.card(name)
    assert os.path.getsize(os.path.join(directory, "model.safetensors")) < 1_000_000
    assert card["name"] == name and card["recipe"] == organisms.recipe(name).to_dict()
    assert [int(n) for n in card["accuracy"]] == list(organisms.recipe(name).card_lengths)
    task = load_export(directory)[1]
    for entry in card["accuracy"].values():  # every group the task defines (the needle's depths; induction has none)
        assert 0 <= entry["accuracy"] <= 1 and set(entry["groups"]) == set(task.group_names)
    assert card["training"]["steps"] > 0 and card["training"]["wall_seconds"] > 0 and card["machine"]["cpu"]
    assert card["known_failures"] and card["commands"]


@pytest.mark.parametrize("name", SHIPPED)
def test_a_fresh_sample_agrees_with_the_card(name):
    card = organisms.card(name)
    model, task = load_export(organisms.path(name))
    for length, entry in card["accuracy"].items():
        if int(length) > card["model"]["trained_up_to"]:
            continue  # past the trained lengths: on the card as a failure, not a claim (and slow to re-measure)
        measured = accuracy_at(model, task, int(length), RECHECK, stream="recheck")["accuracy"]
        tolerance = binomial_tolerance(entry["accuracy"], RECHECK, card["evaluation"]["examples_per_length"])
        assert abs(measured - entry["accuracy"]) <= tolerance, (name, length, measured, entry["accuracy"], tolerance)


@pytest.mark.parametrize("name,length", [("needle-1k", 1024), ("needle-2k", 2048)])
def test_long_context_organisms_retrieve_at_every_depth_of_their_context(name, length):
    if name not in SHIPPED:
        pytest.skip(f"{name} is not shipped in this install")
    card = organisms.card(name)
    for n, entry in card["accuracy"].items():
        if int(n) <= length:
            assert min(entry["groups"].values()) >= 0.9, (n, entry)
