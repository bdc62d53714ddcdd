"""Shipped organisms: hashes checked at load, names accepted wherever a model path is, the CLI."""

import json
import os
import shutil

import pytest

from attnkit import organisms
from attnkit.cli import main
from attnkit.organisms import store
from attnkit.organisms.builder import build
from attnkit.organisms.registry import RECIPES
from attnkit.organisms.store import resolve_model_path, verify

NAME = "tiny-needle"  # the conftest's tiny recipe


@pytest.fixture(scope="module")
def tiny_organism(tmp_path_factory, tiny_recipe):
    """A data folder holding one built organism."""
    root = tmp_path_factory.mktemp("data")
    build(tiny_recipe, str(root / tiny_recipe.name))
    return root


@pytest.fixture
def data(tiny_organism, tmp_path, monkeypatch, tiny_recipe):
    """A fresh copy of the tiny organism's data folder, in place of the package's."""
    root = tmp_path / "data"
    shutil.copytree(tiny_organism, root)
    monkeypatch.setattr(store, "data_dir", lambda: str(root))
    monkeypatch.setitem(RECIPES, NAME, tiny_recipe)
    return root


def test_a_name_resolves_to_its_verified_export(data):
    assert organisms.shipped() == [NAME]
    assert organisms.path(NAME) == str(data / NAME)
    assert resolve_model_path(NAME) == str(data / NAME)
    assert organisms.card(NAME)["name"] == NAME


def test_paths_pass_through_and_unknown_names_list_the_organisms(data, tmp_path):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    assert resolve_model_path("/no/such/dir") == "/no/such/dir"  # the caller's own "no such directory"
    with pytest.raises(FileNotFoundError, match=f"^--model: no such directory or organism: 'needle-9k'; organisms: {NAME}"):
        resolve_model_path("needle-9k")


def test_a_changed_weights_file_is_named(data):
    weights = data / NAME / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(ValueError, match=f"^card: {weights} does not match its hash"):
        verify(str(data / NAME))
    with pytest.raises(ValueError, match=f"^--model: organism {NAME}: {weights} does not match its hash"):
        resolve_model_path(NAME)


def test_a_missing_file_and_a_broken_card_are_named(data):
    (data / NAME / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="tokenizer.json is missing"):
        organisms.path(NAME)
    (data / NAME / "card.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"^card: {data / NAME / 'card.json'} is not a readable organism card"):
        verify(str(data / NAME))


def test_probes_and_inspect_load_an_organism_by_name(data):
    from attnkit.inspection.loading import load_local_model
    from attnkit.probes.model import load_probe_model

    loaded = load_probe_model(NAME)
    assert loaded.kind == "causal" and loaded.task["task"] == "needle" and loaded.max_positions == 64
    model, tokenizer = load_local_model(NAME)
    assert model.config.max_position_embeddings == 64
    with pytest.raises(FileNotFoundError, match="^model: no such directory or organism: 'needle-9k'"):
        load_probe_model("needle-9k")


def test_cli_list_card_and_path(data, capsys):
    assert main(["organisms", "list"]) == 0
    out = capsys.readouterr().out
    assert NAME in out and "16:" in out and "needle-1k" in out
    assert main(["organisms", "card", NAME, "--commands"]) == 0
    out = capsys.readouterr().out
    assert "accuracy on 9 held-out prompts per length" in out and "depth=0.00" in out and "known failures" in out
    assert "attnkit arena needle" in out
    assert main(["organisms", "card", NAME, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == NAME
    assert main(["organisms", "path", NAME]) == 0
    assert capsys.readouterr().out.strip() == str(data / NAME)
    assert main(["organisms", "list", "--markdown"]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| organism |") and f"| `{NAME}` | needle |" in table
    assert main(["organisms", "list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[NAME]["shipped"] and set(rows[NAME]["accuracy"]) == {"16", "64"}


@pytest.mark.parametrize(
    "args,message",
    [
        (["organisms", "card", "needle-9k"], "NAME: no organism 'needle-9k'; known: "),
        (["organisms", "path"], "NAME: 'attnkit organisms path' needs an organism; known: "),
        (["organisms", "fly"], "action: invalid choice: 'fly'"),
    ],
)
def test_cli_bad_input_exits_2_naming_the_argument(data, capsys, args, message):
    assert main(args) == 2
    assert capsys.readouterr().err.startswith(f"attnkit organisms: error: {message}")


def test_cli_names_a_damaged_file(data, capsys):
    (data / NAME / "config.json").write_text("{}")
    assert main(["organisms", "card", NAME]) == 2
    assert "config.json does not match its hash" in capsys.readouterr().err


def test_cli_build_reports_the_distance_to_the_shipped_card(data, tmp_path, capsys):
    out = tmp_path / "rebuilt"
    assert main(["organisms", "build", NAME, "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "against the shipped card: largest difference 0.000" in printed
    assert os.path.isfile(out / "card.json")
