"""``attnkit arena sweep`` with the local engine and ``attnkit results``."""

import json

import pytest

from attnkit.cli import main

TINY = [
    "--mechanisms",
    "softmax,sigmoid",
    "--d-model",
    "8",
    "--layers",
    "1",
    "--heads",
    "2",
    "--steps",
    "3",
    "--batch-size",
    "4",
    "--eval-examples",
    "8",
    "--param",
    "seq_len=16",
    "--param",
    "num_kv_pairs=2",
    "--quiet",
]


def test_arena_sweep_writes_the_store_table_and_figure_and_resumes(tmp_path, capsys):
    out = str(tmp_path / "out")
    assert main(["arena", "sweep", "mqar", *TINY, "--seeds", "2", "--workers", "2", "--out", out]) == 0
    printed = capsys.readouterr().out
    assert "4 cells: 4 computed, 0 from the store, 0 failed" in printed and "sigmoid" in printed
    assert (tmp_path / "out" / "accuracy_vs_width.png").stat().st_size > 1000
    assert len((tmp_path / "out" / "results.csv").read_text().splitlines()) == 5
    # The same command again reads every cell from the store.
    assert main(["arena", "sweep", "mqar", *TINY, "--seeds", "2", "--out", out, "--json", "--no-plots"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["summary"]["computed"] == 0 and again["summary"]["from_store"] == 4 and len(again["rows"]) == 4
    # attnkit results: the table, JSON and CSV
    assert main(["results", out]) == 0
    assert "4 cells done, 0 failed, 4 rows" in capsys.readouterr().out
    assert main(["results", out, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["rows"]) == 4 and {c["status"] for c in data["cells"]} == {"done"}
    assert data["meta"]["grid_hash"] == again["summary"]["grid_hash"]
    assert main(["results", out, "--csv"]) == 0
    csv_lines = capsys.readouterr().out.splitlines()
    assert csv_lines[0].startswith("cell,task,mechanism,d_model") and len(csv_lines) == 5
    # Another grid into the same store is refused, naming --out.
    assert main(["arena", "sweep", "mqar", *TINY, "--seeds", "3", "--out", out]) == 2
    assert "attnkit arena: error: --out: " in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,message",
    [
        (["arena", "mqar", "--engine", "local"], "--engine: only with 'attnkit arena sweep mqar ...'"),
        (["arena", "mqar", "--rerun"], "--rerun: only with 'attnkit arena sweep mqar ...'"),
        (["arena", "mqar", "needle"], "task: expected one task, got 'mqar' and 'needle'"),
        (["arena", "sweep", "bogus"], "task: invalid choice: 'bogus'"),
        (["arena", "sweep", "--export", "x"], "--export: not with 'attnkit arena sweep'"),
        (["arena", "sweep", "--address", "host:1"], "--address: only with --engine ray"),
        (
            ["arena", "sweep", "--engine", "ray", "--address", "nowhere"],
            "--address: expected 'auto', HOST:PORT or ray://HOST:PORT",
        ),
        (["arena", "sweep", "--max-failures", "-1"], "--max-failures: expected an integer >= 0"),
        (["arena", "sweep", "--workers", "0"], "--workers: expected a positive integer"),
        (["results", "no-such-dir"], "DIR: no sweep store at"),
    ],
)
def test_bad_input_is_one_line_naming_the_option(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*args, "--quiet"] if args[0] == "arena" else args) == 2
    assert message in capsys.readouterr().err
