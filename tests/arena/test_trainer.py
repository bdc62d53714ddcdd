"""The trainer: schedule, learning a trivial task, determinism, evaluation, checkpoints."""

import json
import math
from dataclasses import dataclass, replace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from attnkit.arena import MechanismSpec, TrainConfig, Trainer, build_model, make_task
from attnkit.arena.tasks import IGNORE, Batch, Task
from attnkit.arena.trainer import generator, stream_seed


@dataclass(frozen=True)
class PreviousToken(Task):
    """Trivially learnable: the output at position i is the input token at i - 1 (one
    attention layer attending one step back)."""

    vocab_size: int = 8
    seq_len: int = 8
    name = "previous_token"

    def sample(self, n, generator):
        x = torch.randint(0, self.vocab_size, (n, self.seq_len), generator=generator)
        y = torch.full_like(x, IGNORE)
        y[:, 1:] = x[:, :-1]
        return Batch(x, y, y != IGNORE)


def tiny(task, mechanism="softmax", seed=0, layers=1, d=16, heads=2):
    torch.manual_seed(seed)
    return build_model(task, MechanismSpec.parse(mechanism), d, layers, heads)


def states_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_schedule_is_linear_warmup_then_half_cosine():
    c = TrainConfig(steps=100, lr=1e-2, warmup=10, min_lr=0.1)
    assert c.lr_at(1) == pytest.approx(1e-3) and c.lr_at(5) == pytest.approx(5e-3) and c.lr_at(10) == pytest.approx(1e-2)
    assert c.lr_at(100) == pytest.approx(1e-3)  # the floor at the last step
    assert c.lr_at(55) == pytest.approx(1e-2 * (0.1 + 0.9 * 0.5))  # half way down the cosine
    s = 73
    assert c.lr_at(s) == pytest.approx(1e-2 * (0.1 + 0.45 * (1 + math.cos(math.pi * (s - 10) / 90))))
    assert TrainConfig(steps=200).warmup_steps == 10


@pytest.mark.parametrize(
    "bad",
    [
        dict(steps=0),
        dict(batch_size=-1),
        dict(lr=0),
        dict(min_lr=2),
        dict(steps=100, warmup=500),
        dict(target_accuracy=1.5),
        dict(checkpoint_every=-1),
    ],
)
def test_bad_config_raises(bad):
    with pytest.raises(ValueError):
        TrainConfig(**bad)


def test_stream_seeds_are_stable_and_distinct():
    assert stream_seed(0, "train", 1) == stream_seed(0, "train", 1)
    assert (
        len({stream_seed(0, "train", 1), stream_seed(0, "train", 2), stream_seed(1, "train", 1), stream_seed(0, "eval", 1)}) == 4
    )
    assert torch.equal(torch.rand(3, generator=generator(5, "x", 0)), torch.rand(3, generator=generator(5, "x", 0)))


def test_learns_a_trivial_task_in_seconds_and_stops_early():
    task = PreviousToken()
    trainer = Trainer(
        tiny(task, d=64, heads=4), task, TrainConfig(steps=800, batch_size=32, lr=1e-2, eval_every=10, eval_examples=64)
    )
    assert trainer.evaluate().accuracy < 0.3  # chance is 1/8
    result = trainer.fit()
    assert result.stopped_early and result.steps < 800
    assert result.evaluations[0].accuracy >= 0.99 and result.history[-1]["accuracy"] >= 0.99
    assert result.tokens_per_s > 0 and result.train_seconds > 0
    assert [h["step"] for h in result.history] == list(range(10, result.steps + 1, 10))


def test_same_seed_same_run_other_seed_other_run():
    task = make_task("mqar", vocab_size=16, seq_len=16, num_kv_pairs=(1, 2))
    config = TrainConfig(steps=6, batch_size=4, eval_every=3, eval_examples=8)
    runs = []
    for seed in (0, 0, 1):
        trainer = Trainer(tiny(task, seed=seed), task, replace(config, seed=seed))
        result = trainer.fit()
        runs.append((trainer.model.state_dict(), [(h["train_loss"], h["accuracy"]) for h in result.history]))
    assert states_equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    assert not states_equal(runs[0][0], runs[2][0])


class Interrupted(Exception):
    pass


@pytest.mark.parametrize("name,mechanism", [("mqar", "softmax"), ("associative", "fast_weight"), ("regression", "linear_elu")])
def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(tmp_path, name, mechanism):
    small = {
        "mqar": dict(vocab_size=16, seq_len=16, num_kv_pairs=(1, 2)),
        "associative": dict(seq_len=9, num_keys=4, num_values=6),
        "regression": dict(dim=2, seq_len=8),
    }[name]
    task = make_task(name, **small)
    layers = task.fixed_layers or 2
    config = TrainConfig(steps=8, batch_size=4, eval_every=2, eval_examples=8, target_accuracy=None, checkpoint_every=4)
    straight = Trainer(tiny(task, mechanism, layers=layers), task, config)
    straight.fit()

    def crash_at_step_4(record):
        if record["step"] == 4:
            raise Interrupted

    path = str(tmp_path / "run.safetensors")
    with pytest.raises(Interrupted):
        Trainer(tiny(task, mechanism, layers=layers), task, config).fit(on_eval=crash_at_step_4, checkpoint_path=path)
    later = Trainer(tiny(task, mechanism, seed=123, layers=layers), task, config)  # another init, overwritten by resume
    later.resume(path)
    assert later.step == 4 and len(later.history) == 2
    later.fit()
    assert later.step == 8
    assert states_equal(straight.model.state_dict(), later.model.state_dict())
    a, b = straight.optimizer.state_dict()["state"], later.optimizer.state_dict()["state"]
    assert a.keys() == b.keys() and all(states_equal(a[i], b[i]) for i in a)
    curve = lambda t: [(h["step"], h["train_loss"], h["accuracy"], h["eval_loss"]) for h in t.history]  # noqa: E731
    assert curve(straight) == curve(later)


def test_checkpoint_is_plain_safetensors_with_tied_weights_stored_once(tmp_path):
    task = make_task("mqar", vocab_size=16, seq_len=16, num_kv_pairs=2)
    trainer = Trainer(tiny(task), task, TrainConfig(steps=2, batch_size=2, eval_every=2, eval_examples=4))
    path = str(tmp_path / "c.safetensors")
    trainer.fit(checkpoint_path=path)
    with safe_open(path, framework="pt") as f:
        keys = set(f.keys())
        header = json.loads(f.metadata()["attnkit"])
    assert "model/embed.weight" in keys and "model/lm_head.weight" not in keys
    assert header["aliases"] == {"model/lm_head.weight": "model/embed.weight"}
    assert header["meta"]["step"] == 2 and len(header["meta"]["history"]) == 1
    assert any(k.startswith("optim/") and k.endswith("/exp_avg_sq") for k in keys) and "rng/torch" in keys


def test_resume_refuses_a_checkpoint_of_another_run(tmp_path):
    task = make_task("mqar", vocab_size=16, seq_len=16, num_kv_pairs=2)
    trainer = Trainer(tiny(task), task, TrainConfig(steps=2, batch_size=2, eval_every=2, eval_examples=4))
    path = str(tmp_path / "c.safetensors")
    trainer.save(path)
    other = Trainer(tiny(task), task, TrainConfig(steps=3, batch_size=2, eval_every=2, eval_examples=4))
    with pytest.raises(ValueError, match="config"):
        other.resume(path)
    save_file({"a": torch.zeros(1)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match="not an attnkit arena checkpoint"):
        other.resume(str(tmp_path / "x.safetensors"))


class Oracle(torch.nn.Module):
    """Answers MQAR by reading the context, as the task defines it: logits one-hot on the
    value that follows the queried key's first occurrence (keys occur once in the context)."""

    def __init__(self, vocab_size, wrong_pairs=()):
        super().__init__()
        self.vocab_size, self.wrong_pairs = vocab_size, set(wrong_pairs)

    def forward(self, inputs):
        out = torch.zeros(*inputs.shape, self.vocab_size)
        for b, row in enumerate(inputs.tolist()):
            context = {}
            p = 0
            while p + 1 < len(row) and row[p] != 0 and row[p] not in context and row[p] < self.vocab_size // 2:
                context[row[p]] = row[p + 1]
                p += 2
            for i, token in enumerate(row):
                if i >= p and token in context:
                    answer = context[token]
                    if len(context) in self.wrong_pairs:
                        answer = (answer + 1) % self.vocab_size
                    out[b, i, answer] = 1.0
        return out


def test_evaluation_scores_an_oracle_perfectly_and_groups_by_pair_count():
    task = make_task("mqar", vocab_size=32, seq_len=24, num_kv_pairs=(1, 3), random_non_queries=False)
    config = TrainConfig(steps=1, batch_size=16, eval_examples=60)
    perfect = Trainer(Oracle(32), task, config).evaluate()
    assert perfect.accuracy == 1.0 and perfect.groups == {"pairs=1": 1.0, "pairs=2": 1.0, "pairs=3": 1.0}
    held_out = Trainer(Oracle(32), task, config).held_out(24)
    assert perfect.counted == int(held_out.mask.sum())
    wrong = Trainer(Oracle(32, wrong_pairs=[2]), task, config).evaluate()
    assert wrong.groups == {"pairs=1": 1.0, "pairs=2": 0.0, "pairs=3": 1.0}
    per_group = [int(held_out.mask[held_out.group == g].sum()) for g in range(3)]
    assert wrong.accuracy == pytest.approx((per_group[0] + per_group[2]) / sum(per_group))
