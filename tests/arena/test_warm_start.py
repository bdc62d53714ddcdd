"""Warm starts (``init``): from an export or a checkpoint, embeddings grown or cut, any other mismatch named."""

import pytest
import torch

from attnkit.arena import MechanismSpec, TrainConfig, Trainer, build_model, export, make_task
from attnkit.arena.runner import execute, plan
from attnkit.arena.warm_start import read_init_weights, start_from, warm_start

INDUCTION = dict(vocab_size=32, seq_len=16, min_segment=4, max_segment=8)
NEEDLE = dict(seq_len=16, num_filler=8, num_keys=8, num_values=8, distractors=1, num_depths=3)


def model_for(task, d=16, layers=1, heads=2, seed=0, mechanism="softmax", max_len=None):
    torch.manual_seed(seed)
    return build_model(task, MechanismSpec.parse(mechanism), d, layers, heads, max_len)


@pytest.fixture
def induction_dir(tmp_path):
    task = make_task("induction", **INDUCTION)
    return export(model_for(task, seed=1), task, str(tmp_path / "induction")), model_for(task, seed=1)


def test_an_export_starts_a_model_of_another_task_and_length(induction_dir):
    directory, source = induction_dir
    needle = make_task("needle", **NEEDLE)  # 25 symbols against induction's 32
    model = model_for(needle, seed=2, max_len=1024)
    fresh = model.state_dict()["blocks.0.attn.q_proj.weight"].clone()
    record = warm_start(model, directory)
    assert record["rows"] == {"embed.weight": {"source": 32, "model": 25}}
    assert torch.equal(model.embed.weight, source.embed.weight[:25])
    for name, tensor in source.state_dict().items():
        if name not in ("embed.weight", "lm_head.weight"):
            assert torch.equal(model.state_dict()[name], tensor), name
    assert not torch.equal(fresh, model.state_dict()["blocks.0.attn.q_proj.weight"])


def test_a_larger_vocabulary_grows_keeping_the_new_rows_fresh():
    needle = make_task("needle", **NEEDLE)
    small = model_for(needle, seed=1)
    big_task = make_task("needle", **{**NEEDLE, "num_filler": 16})  # 33 symbols
    big = model_for(big_task, seed=2)
    fresh_tail = big.embed.weight[25:].clone()
    start_from(big, small.state_dict())
    assert torch.equal(big.embed.weight[:25], small.embed.weight) and torch.equal(big.embed.weight[25:], fresh_tail)


def test_a_checkpoint_starts_a_model_too(tmp_path):
    needle = make_task("needle", **NEEDLE)
    trainer = Trainer(model_for(needle, seed=3), needle, TrainConfig(steps=1, batch_size=2, eval_examples=3))
    trainer.save(str(tmp_path / "c.safetensors"))
    model = model_for(needle, seed=4)
    warm_start(model, str(tmp_path / "c.safetensors"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trainer.model.state_dict().items())


@pytest.mark.parametrize("change,tensor", [(dict(d=32), "embed.weight"), (dict(layers=2), "blocks.1.attn_norm.weight")])
def test_an_incompatible_model_names_the_first_mismatching_tensor(induction_dir, change, tensor):
    directory, _ = induction_dir
    needle = make_task("needle", **NEEDLE)
    with pytest.raises(ValueError, match=f"^init: .*{tensor}"):
        warm_start(model_for(needle, **change), directory)


def test_weights_the_model_has_no_place_for_are_named():
    needle = make_task("needle", **NEEDLE)
    deep = model_for(needle, layers=2).state_dict()
    with pytest.raises(ValueError, match="^init: blocks.1.attn_norm.weight in the weights has no place in the model"):
        start_from(model_for(needle), deep)


def test_shapes_are_named_with_both_sides():
    needle = make_task("needle", **NEEDLE)
    weights = model_for(needle).state_dict()
    weights["blocks.0.mlp.w1.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"blocks.0.mlp.w1.weight has shape \(3, 3\) in the weights, the model's is"):
        start_from(model_for(needle), weights)


def test_missing_and_foreign_paths_are_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="^init: no such"):
        read_init_weights(str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="^init: .* has no config.json"):
        read_init_weights(str(tmp_path / "empty"))
    (tmp_path / "x.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        read_init_weights(str(tmp_path / "x.safetensors"))


def test_a_grid_run_with_init_records_it_and_trains_from_there(induction_dir):
    directory, _ = induction_dir
    needle = make_task("needle", **NEEDLE)
    [run] = plan(needle, "softmax", widths=[16], layers=1, heads=2, max_len=64, init=directory)
    rows, record = execute(
        run, {"steps": 2, "batch_size": 2, "eval_every": 1, "eval_examples": 3, "schedule": "16:1,32:1", "eval_lengths": [32, 64]}
    )
    assert record["init"]["init"] == directory and record["max_len"] == 64 and record["schedule"] == "16:1,32:1"
    assert [r["eval_len"] for r in rows] == [32, 64] and rows[0]["steps"] == 2
