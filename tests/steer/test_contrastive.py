"""HICD contrastive decoding and its head selection against the formulas computed here
on the dense float64 reference (full sequences, no cache)."""

import math

import pytest
import torch
from steer_reference import run_dense
from wordlevel import eager_generate, tiny_llama, word_tokenizer

from attnkit import steer

HEADS = {0: [1], 1: [0, 3]}


@pytest.fixture(scope="module")
def setup():
    tok = word_tokenizer()
    return tiny_llama(len(tok)).double(), tok


def reference_generate(model, ids, heads, lam, strength, steps, plausibility):
    ids = list(ids)
    new = []
    for _ in range(steps):
        x = torch.tensor([ids])
        p = torch.log_softmax(run_dense(model, {}, input_ids=x).logits[0, -1], -1)
        q = torch.log_softmax(run_dense(model, dict(disperse=strength, heads=heads), input_ids=x).logits[0, -1], -1)
        score = (1 + lam) * p - lam * q
        if plausibility > 0:
            score = torch.where(p >= p.max() + math.log(plausibility), score, torch.tensor(-math.inf, dtype=score.dtype))
        token = int(score.argmax())
        new.append(token)
        ids.append(token)
    return new


@pytest.mark.parametrize("lam, strength, plausibility", [(1.0, 1.0, 0.1), (0.5, 0.6, 0.0), (3.0, 1.0, 0.0)])
def test_contrastive_generate_equals_the_formula(setup, lam, strength, plausibility):
    model, tok = setup
    prompt = "the secret code is 42 . What is the code ?"
    got = steer.contrastive_generate(
        model, tok, prompt, HEADS, lam, strength=strength, max_new_tokens=6, plausibility=plausibility
    )
    want = reference_generate(model, tok(prompt)["input_ids"], HEADS, lam, strength, 6, plausibility)
    assert got.ids == want
    assert got.text == tok.decode(want)


def test_lambda_zero_is_greedy_decoding(setup):
    model, tok = setup
    prompt = "Read the text below and answer : the value is 7"
    ids = tok(prompt)["input_ids"]
    got = steer.contrastive_generate(model, tok, prompt, HEADS, 0.0, max_new_tokens=5, plausibility=0.0)
    model.set_attn_implementation("eager")
    assert got.ids == eager_generate(model, [ids], 5)[0].tolist()


def test_a_large_lambda_changes_the_output(setup):
    model, tok = setup
    prompt = "the secret code is 42 . What is the code ?"
    greedy = steer.contrastive_generate(model, tok, prompt, HEADS, 0.0, max_new_tokens=6, plausibility=0.0)
    contrast = steer.contrastive_generate(model, tok, prompt, HEADS, 3.0, max_new_tokens=6, plausibility=0.0)
    assert contrast.ids != greedy.ids


def test_inducing_heads_rank_by_the_drop_of_the_predicted_token(setup):
    model, tok = setup
    prompts = torch.tensor(
        [
            tok("the secret code is 42 . What is the code ?")["input_ids"],
            tok("Read the text below : the value is 7 and the key is")["input_ids"][:12],
        ]
    )
    base = torch.log_softmax(run_dense(model, {}, input_ids=prompts).logits[:, -1], -1)
    target = base.argmax(-1, keepdim=True)
    drops = []
    for layer in range(2):
        for head in range(4):
            lp = torch.log_softmax(
                run_dense(model, dict(disperse=1.0, heads={layer: [head]}), input_ids=prompts).logits[:, -1], -1
            )
            drops.append((float((base.gather(-1, target) - lp.gather(-1, target)).mean()), layer, head))
    drops.sort(key=lambda d: (-d[0], d[1], d[2]))
    assert steer.inducing_heads(model, prompts, 3) == [[layer, head] for _, layer, head in drops[:3]]


def test_bad_input(setup):
    model, tok = setup
    with pytest.raises(ValueError, match="lam: expected a finite number >= 0"):
        steer.contrastive_generate(model, tok, "the code", HEADS, -1.0)
    with pytest.raises(ValueError, match="heads: expected a head index below 4"):
        steer.contrastive_generate(model, tok, "the code", {0: [9]}, 1.0)
    with pytest.raises(ValueError, match="max_new_tokens: expected an int >= 1"):
        steer.contrastive_generate(model, tok, "the code", HEADS, 1.0, max_new_tokens=0)
    with pytest.raises(ValueError, match="tokenizer: a text prompt needs the tokenizer"):
        steer.contrastive_generate(model, None, "the code", HEADS, 1.0)
    with pytest.raises(ValueError, match=r"k: expected an int in \[1, 8\]"):
        steer.inducing_heads(model, torch.tensor([[1, 2, 3]]), 9)
    assert model.config._attn_implementation == "eager"
