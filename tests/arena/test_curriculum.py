"""Length curricula, evaluation at several lengths, the selection criterion and the best checkpoint."""

import pytest
import torch

from attnkit.arena import MechanismSpec, TrainConfig, Trainer, build_model, make_task
from attnkit.arena.schedule import FORM, Stage, parse_schedule, schedule_text
from attnkit.arena.trainer import Evaluation, best_path, score

NEEDLE = dict(num_filler=8, num_keys=8, num_values=8, distractors=1, num_depths=3)


def tiny(task, max_len=None):
    torch.manual_seed(0)
    return build_model(task, MechanismSpec.parse("softmax"), 16, 1, 2, max_len)


def test_schedule_text_parses_to_stages_and_back():
    stages = parse_schedule("32:200, 128:150x32,512+1024:100x16")
    assert stages == (Stage((32,), 200), Stage((128,), 150, 32), Stage((512, 1024), 100, 16))
    assert schedule_text(stages) == "32:200,128:150x32,512+1024:100x16"


@pytest.mark.parametrize("text", ["", "32", "32:", "32:0", "a:10", "32:10x", "32:10,", "32+32:10", "32:10y4", "-32:10"])
def test_bad_schedules_name_the_option_and_show_the_form(text):
    with pytest.raises(ValueError, match="^schedule: ") as error:
        parse_schedule(text)
    assert FORM in str(error.value) or "once" in str(error.value)


def test_steps_are_the_stages_and_each_stage_has_its_own_warmup_and_cosine():
    c = TrainConfig(steps=999, lr=1e-2, min_lr=0.1, warmup=2, schedule="8:10,16:20")
    assert c.steps == 30
    assert [c.stage_at(s) for s in (1, 10, 11, 30)] == [(0, 0), (0, 9), (1, 0), (1, 19)]
    assert c.lr_at(1) == pytest.approx(5e-3) and c.lr_at(10) == pytest.approx(1e-3)  # stage 1's floor
    assert c.lr_at(11) == pytest.approx(5e-3) and c.lr_at(12) == pytest.approx(1e-2)  # warm-up again
    assert c.lr_at(30) == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="warmup: .*shortest stage"):
        TrainConfig(warmup=15, schedule="8:10,16:20")


def test_mixed_stages_alternate_lengths_at_constant_tokens_per_step():
    c = TrainConfig(batch_size=4, schedule="8:2,16+32+64:6x16")
    assert [c.length_and_batch(s, 99) for s in range(1, 9)] == [
        (8, 4),
        (8, 4),
        (16, 16),
        (32, 8),
        (64, 4),
        (16, 16),
        (32, 8),
        (64, 4),
    ]
    assert c.measured_lengths(8) == (16, 32, 64)  # the last stage's lengths by default
    assert TrainConfig(eval_lengths=[64, 16, 64]).measured_lengths(8) == (16, 64)
    assert TrainConfig().measured_lengths(8) == (8,)


def test_training_draws_each_step_at_the_scheduled_length():
    task = make_task("needle", seq_len=8, **NEEDLE)
    trainer = Trainer(
        tiny(task, 32),
        task,
        TrainConfig(batch_size=4, eval_every=100, eval_examples=6, schedule="8:1,16+32:2x4", target_accuracy=None),
    )
    seen = []
    real = task.__class__.sample

    def spy(self, n, generator):
        seen.append((self.seq_len, n))
        return real(self, n, generator)

    task.__class__.sample = spy
    try:
        trainer.fit()
    finally:
        task.__class__.sample = real
    assert seen == [(8, 4), (16, 4), (32, 2)]


def test_each_evaluation_measures_every_length_and_scores_by_the_criterion():
    task = make_task("needle", seq_len=8, **NEEDLE)
    config = TrainConfig(steps=2, batch_size=4, eval_every=1, eval_examples=6, eval_lengths=(8, 16), target_accuracy=None)
    trainer = Trainer(tiny(task), task, config)
    result = trainer.fit()
    record = result.history[-1]
    assert set(record["lengths"]) == {"8", "16"} and record["stage"] == 0
    assert record["score"] == min(record["lengths"][n]["accuracy"] for n in ("8", "16"))
    assert [ev.length for ev in result.evaluations] == [8, 16]  # the final table: the same lengths

    evs = [Evaluation(8, 0.9, 0.1, 10, {"depth=0": 0.6, "depth=1": 1.0}), Evaluation(16, 0.8, 0.1, 10, {"depth=0": 0.8})]
    assert score(evs, "accuracy") == 0.8 and score(evs, "cell") == 0.6
    with pytest.raises(ValueError, match="criterion"):
        TrainConfig(criterion="mean")


def test_early_stopping_goes_by_the_score_not_the_training_length():
    task = make_task("needle", seq_len=8, **NEEDLE)
    config = TrainConfig(steps=4, batch_size=4, eval_every=1, eval_examples=6, target_accuracy=0.01, eval_lengths=(8, 16))
    trainer = Trainer(tiny(task), task, config)
    trainer._record = lambda loss: _fake(trainer, {1: 1.0, 2: 1.0, 3: 1.0}, {1: 0.0, 2: 0.0, 3: 0.5})
    result = trainer.fit()
    assert result.steps == 3 and result.stopped_early  # stopped when the longer length reached the target


def _fake(trainer, short, long):
    """A record whose lengths' accuracies are given per step (scores as the trainer's)."""
    evs = [Evaluation(8, short[trainer.step], 0.0, 1), Evaluation(16, long[trainer.step], 0.0, 1)]
    record = {
        "step": trainer.step,
        "seconds": 0.0,
        "train_loss": 0.0,
        "score": score(evs, "accuracy"),
        "accuracy": score(evs, "accuracy"),
        "eval_loss": 0.0,
        "stage": 0,
        "lengths": {str(e.length): {"accuracy": e.accuracy, "loss": 0.0, "groups": {}} for e in evs},
    }
    trainer.history.append(record)
    return record


def test_keep_best_ends_on_the_best_scoring_weights_and_writes_them(tmp_path):
    task = make_task("needle", seq_len=8, **NEEDLE)
    config = TrainConfig(
        steps=3, batch_size=4, eval_every=1, eval_examples=6, target_accuracy=None, keep_best=True, eval_lengths=(8, 16)
    )
    trainer = Trainer(tiny(task), task, config)
    scores = {1: 0.2, 2: 0.7, 3: 0.4}
    weights, snapshots = {}, []
    trainer._record = lambda loss: _fake(trainer, {s: 1.0 for s in scores}, scores)

    def remember(record):
        weights[record["step"]] = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    path = str(tmp_path / "run.safetensors")
    result = trainer.fit(
        on_eval=remember, checkpoint_path=path, on_snapshot=lambda model, record: snapshots.append(record["step"])
    )
    assert (result.best_step, result.best_score) == (2, 0.7)
    assert snapshots == [1, 2]  # each new best, as the run goes
    assert all(torch.equal(trainer.model.state_dict()[k], weights[2][k]) for k in weights[2])
    from attnkit.arena.checkpoint import load_weights

    assert best_path(path).endswith("run.best.safetensors")
    best = load_weights(best_path(path))
    assert all(torch.equal(best[k], weights[2][k]) for k in weights[2])


def test_max_len_is_independent_of_the_task():
    task = make_task("needle", seq_len=8, **NEEDLE)
    assert tiny(task).config.max_len == 32  # the task's longest test length (4x)
    assert tiny(task, 2048).config.max_len == 2048
    with pytest.raises(ValueError, match="max_len"):
        tiny(task, 0)


def test_run_lengths_are_checked_against_the_task_and_max_len():
    from attnkit.arena.runner import check_lengths

    task = make_task("needle", seq_len=8, **NEEDLE)
    assert check_lengths(task, TrainConfig(schedule="8:1,64:1"), None) == 64
    assert check_lengths(task, TrainConfig(eval_lengths=(128,)), 256) == 256
    with pytest.raises(ValueError, match="^max_len: expected an int >= 64"):
        check_lengths(task, TrainConfig(schedule="8:1,64:1"), 32)
    with pytest.raises(ValueError, match="^schedule: length 33 does not fit the needle task"):
        check_lengths(task, TrainConfig(schedule="33:1"), None)
    with pytest.raises(ValueError, match="^eval_lengths: length 9"):
        check_lengths(task, TrainConfig(eval_lengths=(9,)), None)
