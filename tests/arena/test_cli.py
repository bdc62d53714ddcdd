"""``attnkit arena`` end to end on tiny runs: table, CSV, JSON, PNG, resume, bad input."""

import csv
import json
import os

import pytest

from attnkit.arena.runner import COLUMNS, format_table, plan
from attnkit.arena.tasks import make_task
from attnkit.cli import main

TINY_MQAR = ["--param", "vocab_size=16", "--param", "seq_len=16", "--param", "num_kv_pairs=[1,2]",
             "--steps", "4", "--eval-every", "2", "--batch-size", "4", "--eval-examples", "8"]
PNG = b"\x89PNG\r\n\x1a\n"


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_grid_writes_table_csv_json_and_plots(tmp_path, capsys):
    out = tmp_path / "arena"
    code = main(["arena", "mqar", "--mechanisms", "softmax,linear_elu", "--d-model", "8,16", "--layers", "1",
                 "--heads", "2", "--seeds", "2", "--out", str(out), *TINY_MQAR])
    assert code == 0
    captured = capsys.readouterr()
    assert "arena mqar 16/16" in captured.err  # a tick per evaluation: 8 runs x 2
    table = captured.out
    assert "softmax" in table and "linear_elu" in table and "results:" in table

    rows = read_csv(out / "results.csv")
    assert list(rows[0]) == list(COLUMNS)
    assert len(rows) == 2 * 2 * 2  # mechanisms x widths x seeds, one evaluation length
    assert {(r["mechanism"], r["d_model"], r["seed"]) for r in rows} == {
        (m, d, s) for m in ("softmax", "linear_elu") for d in ("8", "16") for s in ("0", "1")}
    assert all(r["steps"] == "4" and r["layers"] == "1" and r["heads"] == "2" and r["eval_len"] == "16" for r in rows)
    assert all(0 <= float(r["accuracy"]) <= 1 and float(r["tokens_per_s"]) > 0 for r in rows)

    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["task"] == "mqar" and data["meta"]["task_params"]["num_kv_pairs"] == [1, 2]
    assert "torch" in data["meta"] and len(data["rows"]) == 8 and len(data["runs"]) == 8
    assert set(data["rows"][0]["groups"]) == {"pairs=1", "pairs=2"}
    assert [h["step"] for h in data["runs"][0]["history"]] == [2, 4]
    for name in ("accuracy_vs_width.png", "accuracy_vs_length.png", "accuracy_vs_time.png"):
        assert (out / name).read_bytes()[:8] == PNG


def test_needle_rows_cover_the_longer_test_lengths_and_json_output(tmp_path, capsys):
    out = tmp_path / "n"
    code = main(["arena", "needle", "--mechanisms", "softmax", "--d-model", "8", "--heads", "2", "--param", "seq_len=16",
                 "--param", "distractors=1", "--steps", "2", "--eval-every", "2", "--batch-size", "4",
                 "--eval-examples", "10", "--out", str(out), "--json", "--quiet", "--no-plots"])
    assert code == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    summary = json.loads(captured.out)
    assert [r["eval_len"] for r in summary["rows"]] == [16, 32, 64]
    assert set(summary["rows"][0]["groups"]) == {"depth=0.00", "depth=0.25", "depth=0.50", "depth=0.75", "depth=1.00"}
    assert summary["files"]["figures"] == [] and os.path.exists(summary["files"]["csv"])


def test_resume_continues_from_checkpoints(tmp_path, capsys):
    out = tmp_path / "r"
    args = ["arena", "associative", "--mechanisms", "fast_weight", "--d-model", "8", "--param", "seq_len=9",
            "--param", "num_keys=4", "--param", "num_values=6", "--steps", "4", "--eval-every", "2", "--batch-size", "4",
            "--eval-examples", "8", "--target", "none", "--out", str(out), "--no-plots", "--quiet"]
    assert main([*args, "--checkpoint-every", "2"]) == 0
    first = read_csv(out / "results.csv")
    checkpoints = os.listdir(out / "checkpoints")
    assert checkpoints == ["associative-fast_weight-d8-L1-h1-N9-s0.safetensors"]
    assert main([*args, "--checkpoint-every", "2", "--resume"]) == 0  # finished runs are read back, not retrained
    again = read_csv(out / "results.csv")
    for a, b in zip(first, again):
        assert (a["accuracy"], a["eval_loss"], a["steps"], a["train_seconds"]) == (b["accuracy"], b["eval_loss"], b["steps"], b["train_seconds"])
    capsys.readouterr()


@pytest.mark.parametrize("args,message", [
    (["mqar", "--mechanisms", "nope"], "unknown mechanism"),
    (["mqar", "--param", "pairs=3"], "has no pairs"),
    (["mqar", "--param", "oops"], "KEY=VALUE"),
    (["associative", "--layers", "2"], "1-layer probe"),
    (["mqar", "--d-model", "6"], "multiple of heads"),
    (["mqar", "--d-model", "a,b"], "comma-separated integers"),
    (["mqar", "--target", "high"], "--target"),
    (["mqar", "--seeds", "0"], "--seeds"),
    (["associative", "--mechanisms", "softmax,nsa"], "nsa cannot run the associative task"),  # before any training
])
def test_bad_input_exits_2_naming_the_problem(tmp_path, capsys, args, message):
    assert main(["arena", *args, "--out", str(tmp_path / "x"), "--quiet"]) == 2
    assert message in capsys.readouterr().err


def test_plan_orders_runs_and_format_table_averages_seeds():
    task = make_task("mqar")
    runs = plan(task, "softmax,gla", widths=[64, 128], seeds=[0, 1], seq_lens=[64, 128])
    assert len(runs) == 2 * 2 * 2 * 2
    assert [r.mechanism.label for r in runs[:8]] == ["softmax"] * 8
    assert (runs[0].layers, runs[0].heads, runs[0].task.seq_len) == (2, 4, 64) and runs[4].task.seq_len == 128
    rows = [{"mechanism": "softmax", "d_model": 64, "seq_len": 64, "eval_len": 64, "accuracy": a, "steps": 10,
             "tokens_per_s": 100.0} for a in (0.5, 1.0)]
    line = format_table(rows).splitlines()[-1]
    assert "0.750" in line and "0.500-1.000" in line
