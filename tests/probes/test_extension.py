"""A new probe is one file: this one defines ``toy`` (a function of the model with one
checked keyword), registers it with ``register_probe``, and ``attnkit probe toy`` runs
it with its keyword read off the signature, without any other edit."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "inspect"))
from inspect_models import bert, saved, tokenizer  # noqa: E402

from attnkit.cli import main  # noqa: E402
from attnkit.probes import PROBES, ProbeResult, as_probe_model, register_probe  # noqa: E402
from attnkit.validate import integer  # noqa: E402


def toy(model=None, tokenizer=None, *, repeats: int = 1, progress=None) -> ProbeResult:
    """A toy probe: the model's number of layers, ``repeats`` times."""
    repeats = integer(repeats, "repeats", 1)
    pm = as_probe_model(model, tokenizer)
    result = ProbeResult("toy")
    for r in range(repeats):
        result.add("layers", pm.layers, repeat=r)
    result.meta = {"model": pm.name, "params": {"repeats": repeats}}
    return result


@pytest.fixture
def registered():
    register_probe("toy", toy)
    yield
    PROBES.pop("toy")


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return saved(bert(positions=64), tokenizer(d), d / "bert")


def test_a_registered_probe_runs_from_the_command_line(registered, encoder_dir, tmp_path):
    out = tmp_path / "run"
    assert main(["probe", "toy", "--model", encoder_dir, "--out", str(out), "--repeats", "3"]) == 0
    result = ProbeResult.from_json(str(out / "results.json"))
    assert [row["repeat"] for row in result.rows] == [0, 1, 2] and result.value("layers", repeat=0) == 2


def test_its_checks_name_the_option_on_the_command_line(registered, encoder_dir, tmp_path, capsys):
    assert main(["probe", "toy", "--model", encoder_dir, "--out", str(tmp_path / "x"), "--repeats", "0"]) == 2
    assert "--repeats: expected an int >= 1, got 0" in capsys.readouterr().err
