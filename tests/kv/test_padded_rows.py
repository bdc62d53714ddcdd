"""A row of a left-padded batch answers as the same prompt alone, whatever the policy
(issue 31): greedy decoding in float64, the padded row's logits equal the unpadded
prompt's to float64 rounding, its new tokens and kept entries too.

Quest cuts its pages over each row's entries, not over slots (a padded row holds its
prompt, then empty slots, then the tokens decoded); H2O and TOVA score through attnkit's
observer (GPT-2, or any model inside ``attnkit.hf.use``) on every slot of a layer whose
rows keep different counts under a token budget larger than the shorter prompt."""

import contextlib

import pytest
import torch
from eager_reference import greedy
from tiny_models import build

import attnkit
import attnkit.kv as kv
from attnkit.kernels.cpu import kv as native_kv


def batch_and_alone(n: int, pad: int, seed: int):
    """A batch of two prompts of ``n`` tokens whose second is left-padded by ``pad``, and
    that row alone, unpadded."""
    ids = torch.randint(1, 97, (2, n), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[1, :pad], mask[1, :pad] = 0, 0
    return (ids, mask), (ids[1:, pad:], mask[1:, pad:])


def same_answer(model, make_cache, batch, alone, pad: int, steps: int):
    """Greedy decoding of the batch and of the row alone: logits (to 1e-10), tokens and
    the kept positions of every layer agree."""
    tokens_b, logits_b = greedy(model, *batch, (cache_b := make_cache()), steps)
    tokens_a, logits_a = greedy(model, *alone, (cache_a := make_cache()), steps)
    torch.testing.assert_close(logits_b[1], logits_a[0], atol=1e-10, rtol=0)
    assert torch.equal(tokens_b[1], tokens_a[0])
    for i in range(len(cache_a.layers)):
        assert torch.equal(cache_b.kept_mask(i)[1, :, pad:], cache_a.kept_mask(i)[0]), f"layer {i}"


def operators(native: bool, monkeypatch) -> None:
    if not native:
        monkeypatch.setattr(native_kv, "available", lambda: False)
    elif not native_kv.available():
        pytest.skip("the C++ operators are unavailable")


QUEST = [{"page_size": 16}, {"page_size": 4}, {"page_size": 16, "heads": "group"}]


@torch.no_grad()
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("params", QUEST, ids=["pages-16", "pages-4", "group"])
def test_quest_pages_of_a_padded_row_are_those_of_the_prompt_alone(params, native, monkeypatch):
    """37 real tokens at page_size 16 are pages of 16, 16 and 5 (+ the decoded tokens), not
    16, 16, 5 and 3 as slots would cut them. The lone row takes the C++ step (or, without
    the operators, gathers its pages); the padded batch masks."""
    operators(native, monkeypatch)
    model = build("llama", "sdpa").double()
    batch, alone = batch_and_alone(50, 13, seed=31)
    same_answer(model, lambda: kv.policy_cache(model, "quest", budget=0.5, dense_layers=1, **params), batch, alone, 13, 12)


@torch.no_grad()
@pytest.mark.parametrize("name", ["streaming", "h2o", "snapkv", "tova", "pyramid", "adakv", "knorm"])
def test_every_other_policy_answers_as_the_prompt_alone(name):
    model = build("llama", "sdpa").double()
    batch, alone = batch_and_alone(30, 9, seed=32)
    same_answer(model, lambda: kv.policy_cache(model, name, budget=0.5), batch, alone, 9, 6)


@torch.no_grad()
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("name", ["h2o", "tova"])
@pytest.mark.parametrize("model_name,switched", [("gpt2", False), ("llama", True)])
def test_observed_weights_with_a_count_above_a_padded_prompt(model_name, switched, name, native, monkeypatch):
    """A budget of 16 tokens keeps all 12 of the padded row and evicts in the other: once
    both rows hold as many entries around the other's holes, the step's weights must
    still cover every slot (they crashed the eviction: 'mass must be (2, ..., 21), got
    [2, 4, 17]')."""
    operators(native, monkeypatch)
    model = build(model_name, "sdpa").double()
    batch, alone = batch_and_alone(20, 8, seed=0)
    with attnkit.hf.use(model) if switched else contextlib.nullcontext():
        same_answer(model, lambda: kv.policy_cache(model, name, budget=16), batch, alone, 8, 8)
