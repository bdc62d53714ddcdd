"""``attnkit arena`` end to end on tiny runs: table, CSV, JSON, PNG, resume, bad input."""

import csv
import json
import os

import pytest

from attnkit.arena.runner import COLUMNS, format_table, plan
from attnkit.arena.tasks import make_task
from attnkit.cli import main

TINY_MQAR = [
    "--param",
    "vocab_size=16",
    "--param",
    "seq_len=16",
    "--param",
    "num_kv_pairs=[1,2]",
    "--steps",
    "4",
    "--eval-every",
    "2",
    "--batch-size",
    "4",
    "--eval-examples",
    "8",
]
PNG = b"\x89PNG\r\n\x1a\n"


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_grid_writes_table_csv_json_and_plots(tmp_path, capsys):
    out = tmp_path / "arena"
    code = main(
        [
            "arena",
            "mqar",
            "--mechanisms",
            "softmax,linear_elu",
            "--d-model",
            "8,16",
            "--layers",
            "1",
            "--heads",
            "2",
            "--seeds",
            "2",
            "--out",
            str(out),
            *TINY_MQAR,
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    assert "arena mqar 16/16" in captured.err  # a tick per evaluation: 8 runs x 2
    table = captured.out
    assert "softmax" in table and "linear_elu" in table and "results:" in table

    rows = read_csv(out / "results.csv")
    assert list(rows[0]) == list(COLUMNS)
    assert len(rows) == 2 * 2 * 2  # mechanisms x widths x seeds, one evaluation length
    assert {(r["mechanism"], r["d_model"], r["seed"]) for r in rows} == {
        (m, d, s) for m in ("softmax", "linear_elu") for d in ("8", "16") for s in ("0", "1")
    }
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
    code = main(
        [
            "arena",
            "needle",
            "--mechanisms",
            "softmax",
            "--d-model",
            "8",
            "--heads",
            "2",
            "--param",
            "seq_len=16",
            "--param",
            "distractors=1",
            "--steps",
            "2",
            "--eval-every",
            "2",
            "--batch-size",
            "4",
            "--eval-examples",
            "10",
            "--out",
            str(out),
            "--json",
            "--quiet",
            "--no-plots",
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    summary = json.loads(captured.out)
    assert [r["eval_len"] for r in summary["rows"]] == [16, 32, 64]
    assert set(summary["rows"][0]["groups"]) == {"depth=0.00", "depth=0.25", "depth=0.50", "depth=0.75", "depth=1.00"}
    assert summary["files"]["figures"] == [] and os.path.exists(summary["files"]["csv"])


def test_resume_continues_from_checkpoints(tmp_path, capsys):
    out = tmp_path / "r"
    args = [
        "arena",
        "associative",
        "--mechanisms",
        "fast_weight",
        "--d-model",
        "8",
        "--param",
        "seq_len=9",
        "--param",
        "num_keys=4",
        "--param",
        "num_values=6",
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--batch-size",
        "4",
        "--eval-examples",
        "8",
        "--target",
        "none",
        "--out",
        str(out),
        "--no-plots",
        "--quiet",
    ]
    assert main([*args, "--checkpoint-every", "2"]) == 0
    first = read_csv(out / "results.csv")
    checkpoints = os.listdir(out / "checkpoints")
    assert checkpoints == ["associative-fast_weight-d8-L1-h1-N9-s0.safetensors"]
    assert main([*args, "--checkpoint-every", "2", "--resume"]) == 0  # finished runs are read back, not retrained
    again = read_csv(out / "results.csv")
    for a, b in zip(first, again):
        assert (a["accuracy"], a["eval_loss"], a["steps"], a["train_seconds"]) == (
            b["accuracy"],
            b["eval_loss"],
            b["steps"],
            b["train_seconds"],
        )
    capsys.readouterr()


@pytest.mark.parametrize(
    "args,message",
    [
        (["mqar", "--heads", "0"], "--heads: expected a positive integer, got '0'"),  # was a ZeroDivisionError
        (["mqar", "--heads", "-2"], "--heads: expected a positive integer"),
        (["mqar", "--heads", "two"], "--heads: expected a positive integer"),
        (["mqar", "--layers", "0"], "--layers: expected a positive integer"),
        (["mqar", "--seeds", "0"], "--seeds: expected a positive integer"),
        (["mqar", "--steps", "0"], "--steps: expected a positive integer"),
        (["mqar", "--batch-size", "-1"], "--batch-size: expected a positive integer"),
        (["mqar", "--eval-every", "0"], "--eval-every: expected a positive integer"),
        (["mqar", "--eval-examples", "0"], "--eval-examples: expected a positive integer"),
        (["mqar", "--checkpoint-every", "0"], "--checkpoint-every: expected a positive integer"),
        (["mqar", "--threads", "0"], "--threads: expected a positive integer"),
        (["mqar", "--lr", "0"], "--lr: expected a positive finite number"),
        (["mqar", "--lr", "nan"], "--lr: expected a positive finite number"),
        (["mqar", "--lr", "fast"], "--lr: expected a positive number"),
        (["mqar", "--target", "high"], "--target: expected an accuracy in (0, 1] or 'none'"),
        (["mqar", "--target", "1.5"], "--target: expected an accuracy in (0, 1]"),
        (["mqar", "--target", "0"], "--target: expected an accuracy in (0, 1]"),
        (["mqar", "--d-model", "a,b"], "--d-model: expected comma-separated integers"),
        (["mqar", "--d-model", "64,0"], "--d-model: expected positive integers"),
        (["mqar", "--d-model", "6"], "--d-model: each width must be a multiple of heads=4"),
        (["mqar", "--d-model", "6", "--heads", "4"], "--d-model: each width must be a multiple of heads=4 (--heads), got 6"),
        (["mqar", "--seq-len", "0"], "--seq-len: expected positive integers"),
        (["mqar", "--seq-len", "64,4"], "--seq-len: 4 does not fit the mqar task"),
        (["mqar", "--mechanisms", "nope"], "--mechanisms: unknown mechanism 'nope'"),
        (["mqar", "--mechanisms", "softmax:bogus=1"], "--mechanisms: softmax has no parameter 'bogus'"),  # was a TypeError
        (["mqar", "--mechanisms", "deltanet:gate=1"], "--mechanisms: deltanet has no parameter 'gate'"),
        (["mqar", "--mechanisms", "deltanet:heads=2"], "--mechanisms: 'heads' in 'deltanet:heads=2' is set by the model"),
        (["mqar", "--mechanisms", "linear:rule"], "--mechanisms: expected name:key=value"),
        (["mqar", "--mechanisms", "softmax,softmax"], "--mechanisms: each may appear once"),
        (["mqar", "--mechanisms", ","], "--mechanisms: expected a comma-separated list"),
        (
            ["mqar", "--mechanisms", "linear:rule=bogus", "--d-model", "8"],
            "--mechanisms: linear:rule=bogus cannot run the mqar task: rule:",
        ),
        (
            ["associative", "--mechanisms", "softmax,nsa"],
            "--mechanisms: nsa cannot run the associative task",
        ),  # before any training
        (["mqar", "--param", "pairs=3"], "--param: mqar has no pairs"),
        (["mqar", "--param", "oops"], "--param: expected KEY=VALUE"),
        (["mqar", "--param", "seq_len=3"], "--param: seq_len: expected an int >= 4"),
        (["mqar", "--param", "num_kv_pairs=[1,2,3]"], "--param: num_kv_pairs: expected an int or a (low, high) pair"),
        (["mqar", "--param", "seq_len=64", "--param", "power_a=steep"], "--param: power_a: expected 0 < a <= 1, got 'steep'"),
        (["associative", "--layers", "2"], "--layers: the associative task is a 1-layer probe, got 2"),
        (["bogus"], "task: invalid choice: 'bogus'"),
        (["mqar", "--steps"], "--steps: expected one argument"),
    ],
)
def test_bad_input_exits_2_naming_the_option(tmp_path, capsys, args, message):
    out = tmp_path / "x"
    assert main(["arena", *args, "--out", str(out), "--quiet"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"attnkit arena: error: {message}"), captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    assert not (out / "results.csv").exists()


def test_an_unusable_out_directory_is_refused_before_training(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    for out, message in (
        (afile, f"--out: {afile} exists and is not a directory"),
        (afile / "sub", f"--out: cannot create directory {afile / 'sub'}"),
    ):
        assert main(["arena", "mqar", *TINY_MQAR, "--d-model", "8", "--out", str(out)]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith(f"attnkit arena: error: {message}") and "arena mqar" not in captured.err  # no progress


def test_a_read_only_out_directory_is_refused(tmp_path, capsys, monkeypatch):
    """A directory nothing can be written in (root writes everywhere, so the refusal the
    file system would give is played by the probe file's creation)."""
    import attnkit.cli.options as options

    locked = tmp_path / "locked"
    locked.mkdir()
    real = options.tempfile.TemporaryFile

    def refuse_in_locked(*args, dir=None, **kwargs):
        if dir is not None and os.path.samefile(dir, locked):
            raise PermissionError(13, "Permission denied")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(options.tempfile, "TemporaryFile", refuse_in_locked)
    assert main(["arena", "mqar", *TINY_MQAR, "--d-model", "8", "--out", str(locked)]) == 2
    assert capsys.readouterr().err.startswith(f"attnkit arena: error: --out: cannot write in {locked}: Permission denied")


def test_the_delta_rule_needs_bounded_keys(tmp_path, capsys):
    """docs/arena.md: with unbounded elu+1 features the delta rule's state overflows on the
    pre-training check; the L2-normalised map trains."""
    # the task's default length (64) and a width of 32: the check runs two examples, no training
    assert (
        main(
            [
                "arena",
                "mqar",
                "--d-model",
                "32",
                "--mechanisms",
                "linear:rule=delta:feature_map=elu+1",
                "--out",
                str(tmp_path / "a"),
                "--quiet",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("attnkit arena: error: --mechanisms: linear:rule=delta:feature_map=elu+1 cannot run the mqar task")
    assert "overflow" in err
    assert not (tmp_path / "a" / "results.csv").exists()
    assert (
        main(
            [
                "arena",
                "mqar",
                *TINY_MQAR,
                "--d-model",
                "8",
                "--heads",
                "2",
                "--layers",
                "1",
                "--quiet",
                "--no-plots",
                "--mechanisms",
                "linear:rule=delta:feature_map=silu+l2",
                "--out",
                str(tmp_path / "b"),
            ]
        )
        == 0
    )
    rows = read_csv(tmp_path / "b" / "results.csv")
    assert rows[0]["mechanism"] == "linear:rule=delta:feature_map=silu+l2" and rows[0]["steps"] == "4"
    capsys.readouterr()


def test_mechanism_specs_check_constructor_keywords():
    from attnkit.arena.models import MechanismSpec

    spec = MechanismSpec.parse("linear:rule=delta:feature_map=silu+l2:chunk_size=16")
    assert (spec.name, spec.params) == ("linear", {"rule": "delta", "feature_map": "silu+l2", "chunk_size": 16})
    assert MechanismSpec.parse("delta:beta=null").params == {"beta": None}  # presets take LinearAttention's keywords
    assert MechanismSpec.parse("sigmoid:bias=-2").params == {"bias": -2}
    with pytest.raises(ValueError, match=r"^mechanisms: topk has no parameter 'K' \(in 'topk:K=4'\); it takes k$"):
        MechanismSpec.parse("topk:K=4")
    with pytest.raises(ValueError, match="softmax has no parameter 'scale'.*it takes no parameters"):
        MechanismSpec.parse("softmax:scale=2")
    with pytest.raises(ValueError, match="'num_heads' in 'talking_heads:num_heads=2' is set by the model"):
        MechanismSpec.parse("talking_heads:num_heads=2")


def test_help_exits_0(capsys):
    assert main(["arena", "--help"]) == 0
    assert "--eval-every N" in capsys.readouterr().out


def test_plan_orders_runs_and_format_table_averages_seeds():
    task = make_task("mqar")
    runs = plan(task, "softmax,gla", widths=[64, 128], seeds=[0, 1], seq_lens=[64, 128])
    assert len(runs) == 2 * 2 * 2 * 2
    assert [r.mechanism.label for r in runs[:8]] == ["softmax"] * 8
    assert (runs[0].layers, runs[0].heads, runs[0].task.seq_len) == (2, 4, 64) and runs[4].task.seq_len == 128
    rows = [
        {"mechanism": "softmax", "d_model": 64, "seq_len": 64, "eval_len": 64, "accuracy": a, "steps": 10, "tokens_per_s": 100.0}
        for a in (0.5, 1.0)
    ]
    line = format_table(rows).splitlines()[-1]
    assert "0.750" in line and "0.500-1.000" in line
