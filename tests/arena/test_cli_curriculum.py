"""``attnkit arena`` growing a model: --init, --schedule, --max-len, --eval-lengths, --criterion,
--keep-best, results and export written as the run goes, progress naming the stage."""

import json

import pytest
import torch

from attnkit.arena import MechanismSpec, build_model, export, make_task
from attnkit.arena.trainer import Trainer
from attnkit.cli import main

NEEDLE = [
    "--param",
    "seq_len=16",
    "--param",
    "num_filler=8",
    "--param",
    "num_keys=8",
    "--param",
    "num_values=8",
    "--param",
    "distractors=1",
    "--param",
    "num_depths=3",
]
SMALL = ["--d-model", "16", "--layers", "1", "--heads", "2", "--batch-size", "4", "--eval-examples", "6", "--no-plots"]


@pytest.fixture
def source_export(tmp_path):
    task = make_task("induction", vocab_size=32, seq_len=16, min_segment=4, max_segment=8)
    torch.manual_seed(0)
    model = build_model(task, MechanismSpec.parse("softmax"), 16, 1, 2)
    return export(model, task, str(tmp_path / "source"))


def test_a_curriculum_from_an_export_writes_results_export_and_stage_progress(tmp_path, capsys, source_export):
    out, exported = tmp_path / "run", tmp_path / "grown"
    code = main(
        [
            "arena",
            "needle",
            *NEEDLE,
            *SMALL,
            "--init",
            source_export,
            "--schedule",
            "16:2,32+64:2x4",
            "--eval-lengths",
            "32,64",
            "--criterion",
            "cell",
            "--keep-best",
            "--eval-every",
            "2",
            "--max-len",
            "128",
            "--target",
            "none",
            "--out",
            str(out),
            "--export",
            str(exported),
        ]
    )
    assert code == 0
    err = capsys.readouterr().err
    assert "stage 1/2 (16) step 2 @32 " in err and "stage 2/2 (32+64) step 4" in err and "score" in err
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["finished"] and data["meta"]["overrides"]["schedule"] == "16:2,32+64:2x4"
    [record] = data["runs"]
    assert record["max_len"] == 128 and record["init"]["init"] == source_export and record["best_step"] in (2, 4)
    assert [r["eval_len"] for r in data["rows"]] == [32, 64]
    training = json.loads((exported / "task.json").read_text())["training"]
    assert training["schedule"] == "16:2,32+64:2x4" and training["best_step"] == record["best_step"]
    assert json.loads((exported / "config.json").read_text())["max_position_embeddings"] == 128


def test_an_interrupted_run_leaves_what_it_measured(tmp_path, capsys, monkeypatch):
    real = Trainer.train_step

    def cut_at_step_3(self):
        if self.step == 3:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(Trainer, "train_step", cut_at_step_3)
    out, exported = tmp_path / "run", tmp_path / "model"
    code = main(
        [
            "arena",
            "needle",
            *NEEDLE,
            *SMALL,
            "--steps",
            "10",
            "--eval-every",
            "1",
            "--eval-lengths",
            "16,32",
            "--quiet",
            "--out",
            str(out),
            "--export",
            str(exported),
        ]
    )
    assert code == 130
    assert "interrupted" in capsys.readouterr().err
    data = json.loads((out / "results.json").read_text())
    assert not data["meta"]["finished"] and [h["step"] for h in data["runs"][0]["history"]] == [1, 2]
    assert {r["eval_len"] for r in data["rows"]} == {16, 32} and all(r["steps"] == 2 for r in data["rows"])
    assert "eval_len" in (out / "results.csv").read_text()
    training = json.loads((exported / "task.json").read_text())["training"]
    assert training["finished"] is False and training["steps"] == 2


@pytest.mark.parametrize(
    "args,message",
    [
        (["--schedule", "16:10,32"], "--schedule: '32' is not a stage; expected LENGTHS:STEPS[xBATCH]"),
        (["--schedule", "16:0"], "--schedule: a stage's steps must be a positive int, got 0; expected LENGTHS:STEPS[xBATCH]"),
        (["--schedule", "16:2", "--steps", "5"], "--steps: with --schedule the steps are the stages'"),
        (["--schedule", "17:2"], "--schedule: length 17 does not fit the needle task: seq_len:"),
        (["--eval-lengths", "16,33"], "--eval-lengths: length 33 does not fit the needle task"),
        (["--schedule", "16:2,128:2", "--max-len", "64"], "--max-len: expected an int >= 128"),
        (["--criterion", "mean"], "--criterion: invalid choice: 'mean'"),
        (["--init", "/nonexistent/model"], "--init: no such export directory or checkpoint: /nonexistent/model"),
    ],
)
def test_bad_curriculum_input_exits_2_naming_the_option(tmp_path, capsys, args, message):
    out = tmp_path / "x"
    assert main(["arena", "needle", *NEEDLE, *SMALL, *args, "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"attnkit arena: error: {message}"), err
    assert not (out / "results.csv").exists()


def test_init_with_an_incompatible_model_names_the_tensor_before_training(tmp_path, capsys, source_export):
    out = tmp_path / "x"
    args = ["arena", "needle", *NEEDLE, *SMALL, "--d-model", "32", "--init", source_export, "--out", str(out), "--quiet"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnkit arena: error: --init: embed.weight has shape (32, 16) in "), err
    assert not (out / "results.csv").exists()


def test_init_takes_an_organism_name(tmp_path, capsys):
    from attnkit import organisms

    out = tmp_path / "run"
    code = main(
        [
            "arena",
            "needle",
            *NEEDLE,
            "--d-model",
            "64",
            "--layers",
            "2",
            "--heads",
            "4",
            "--batch-size",
            "2",
            "--eval-examples",
            "5",
            "--no-plots",
            "--steps",
            "1",
            "--init",
            "needle-32",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    [record] = json.loads((out / "results.json").read_text())["runs"]
    assert record["init"]["init"] == organisms.path("needle-32")
    assert main(["arena", "needle", *NEEDLE, *SMALL, "--init", "needle-9k", "--out", str(out), "--quiet"]) == 2
    assert "--init: no such directory or organism: 'needle-9k'; organisms: " in capsys.readouterr().err
