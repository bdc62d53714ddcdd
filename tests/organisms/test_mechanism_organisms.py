"""Organisms whose attention is not softmax (sigmoid, a linear/softmax hybrid): built and
carded through the export's recorded mechanisms, measured as trained, refused where a
caller would load them as plain transformers (softmax), accepted as warm starts."""

import dataclasses
import shutil

import pytest
import torch

from attnkit import organisms
from attnkit.arena.export import export_mechanisms, mechanism_switch
from attnkit.organisms import store
from attnkit.organisms.builder import build
from attnkit.organisms.evaluate import accuracy_at, load_export
from attnkit.organisms.registry import RECIPES
from attnkit.organisms.store import resolve_model_path


@pytest.fixture(scope="module", params=["sigmoid", "softmax/linear_elu"], ids=["sigmoid", "hybrid"])
def built(request, tmp_path_factory, tiny_recipe):
    recipe = dataclasses.replace(tiny_recipe, name="tiny-mech", mechanism=request.param, layers=2)
    root = tmp_path_factory.mktemp("data")
    card = build(recipe, str(root / recipe.name))
    return recipe, root, card


@pytest.fixture
def data(built, tmp_path, monkeypatch):
    recipe, root, card = built
    copy = tmp_path / "data"
    shutil.copytree(root, copy)
    monkeypatch.setattr(store, "data_dir", lambda: str(copy))
    monkeypatch.setitem(RECIPES, recipe.name, recipe)
    return recipe, copy, card


def test_the_card_is_measured_with_the_trained_mechanism(data):
    recipe, root, card = data
    assert card["model"]["mechanism"] == recipe.mechanism
    model, task = organisms.load(recipe.name)
    layers = export_mechanisms(model.model.config)
    expected = [0, 1] if recipe.mechanism == "sigmoid" else [1]
    assert [entry["layer"] for entry in layers] == expected
    if recipe.mechanism == "sigmoid":
        assert layers[0]["params"] == {"context": 64}  # b = -log n of the last stage's context, recorded
    for length, entry in card["accuracy"].items():
        assert accuracy_at(model, task, int(length), recipe.card_examples) == entry  # the same prompts, the same numbers
    ids = task.sample(2, torch.Generator().manual_seed(0)).inputs
    with torch.no_grad():
        plain = model.model(input_ids=ids).logits
        with mechanism_switch(model.model):
            switched = model.model(input_ids=ids).logits
    assert (plain - switched).abs().max() > 1e-4  # transformers alone computes softmax on every layer


def test_plain_transformers_loaders_are_refused_and_warm_starts_accepted(data):
    recipe, root, _ = data
    with pytest.raises(
        ValueError,
        match=rf"^--model: organism {recipe.name} runs (sigmoid|linear_elu) attention, "
        r"which a transformers Llama loaded from its files computes as softmax",
    ):
        resolve_model_path(recipe.name)
    from attnkit.probes.model import load_probe_model

    with pytest.raises(ValueError, match="computes as softmax"):
        load_probe_model(recipe.name)
    assert resolve_model_path(recipe.name, "--init") == str(root / recipe.name)  # weights only


def test_shipped_non_softmax_organisms_record_their_mechanism():
    for name in organisms.shipped("text"):
        mechanism = organisms.card(name)["model"]["mechanism"]
        model, _ = load_export(organisms.path(name))
        recorded = {entry["mechanism"] for entry in export_mechanisms(model.model.config)}
        assert recorded == {m.split(":")[0] for m in mechanism.split("/")} - {"softmax"}, name
