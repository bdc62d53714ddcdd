"""Contrastive decoding against the visually-ablated run, step by step against the
formula computed here from two plain runs."""

import math

import pytest
import tiny_vlms as V
import torch

from attnkit import steer, vision


@pytest.fixture(scope="module")
def llava():
    model = V.build("llava")
    inputs, _ = V.batch("llava")
    return model, inputs


def test_each_step_is_the_argmax_of_the_contrast(llava):
    model, inputs = llava
    spans = vision.image_spans(model, inputs)
    lam, plaus = 3.0, 0.001
    seq = vision.contrastive_generate(model, inputs, spans, lam, plausibility=plaus, max_new_tokens=2)
    n0 = inputs["input_ids"].shape[1]
    assert seq.shape == (2, n0 + 2)
    contrast_changed_something = False
    for t in range(2):
        ids = seq[:, : n0 + t]
        step = dict(
            inputs, input_ids=ids, attention_mask=torch.cat([inputs["attention_mask"], torch.ones(2, t, dtype=torch.long)], 1)
        )
        with torch.no_grad():
            expert = torch.log_softmax(model(**step).logits[:, -1].double(), -1)
            with steer.apply(model, steer.ablate_visual(spans)):
                amateur = torch.log_softmax(model(**step).logits[:, -1].double(), -1)
        for b in range(2):
            ok = expert[b] >= expert[b].max() + math.log(plaus)
            score = torch.where(ok, (1 + lam) * expert[b] - lam * amateur[b], -math.inf)
            assert int(seq[b, n0 + t]) == int(score.argmax())
            contrast_changed_something |= int(score.argmax()) != int(expert[b].argmax())
    assert contrast_changed_something


def test_lambda_zero_is_greedy():
    model = V.build("idefics3")
    inputs, _ = V.batch("idefics3")
    seq = vision.contrastive_generate(model, inputs, lam=0.0, plausibility=0.0, max_new_tokens=2)
    with torch.no_grad():
        greedy = model.generate(**inputs, max_new_tokens=2, do_sample=False)
    assert torch.equal(seq, greedy)


def test_bad_arguments(llava):
    model, inputs = llava
    with pytest.raises(ValueError, match="^lam: expected a finite number >= 0"):
        vision.contrastive_generate(model, inputs, lam=-1.0)
    with pytest.raises(ValueError, match="^plausibility: expected a number in"):
        vision.contrastive_generate(model, inputs, plausibility=2)
