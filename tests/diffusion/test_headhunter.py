"""HeadHunter (attnkit.diffusion.hunt / greedy): greedy choice of perturbed heads on a toy
pipeline whose best head is known by construction, and the resumable JSON cache."""

from __future__ import annotations

import json

import diffusion_tiny as tiny
import pytest
import torch

pytest.importorskip("diffusers")

from diffusion_reference import restored  # noqa: E402

import attnkit.diffusion as ad  # noqa: E402

TARGET = ("up_blocks.1.attentions.0.transformer_blocks.0.attn1", 2)


@pytest.fixture(scope="module")
def toy():
    """A tiny pipeline in which only TARGET's head reaches the output of any self-attention
    layer (the output projection's columns of every other head are zero), so perturbing
    any other head leaves the sample as it was; the objective is the change it causes."""
    pipe, call = tiny.pipeline()
    with torch.no_grad():
        for layer in ad.attention_layers(pipe.unet):
            if layer.kind != "self":
                continue
            weight = layer.module.to_out[0].weight
            d = weight.shape[1] // layer.module.heads
            for h in range(layer.module.heads):
                if (layer.name, h) != TARGET:
                    weight[:, h * d : (h + 1) * d] = 0
        base = pipe(**call, generator=torch.Generator().manual_seed(0)).images
    calls = []

    def change(output, prompt, seed):
        calls.append(seed)
        return float((output.images - base).abs().max())

    return pipe, call, change, calls


def _prompt(call):
    return {k: call[k] for k in ("prompt_embeds", "negative_prompt_embeds")}


def _settings(call):
    return {k: v for k, v in call.items() if k not in ("prompt_embeds", "negative_prompt_embeds")}


def test_hunt_finds_the_only_head_that_changes_the_output(toy):
    pipe, call, change, calls = toy
    candidates = ad.head_candidates(pipe)
    assert len(candidates) == 16 and TARGET in candidates  # 4 self-attention layers x 4 heads
    calls.clear()
    steps = []
    result = ad.hunt(pipe, change, [_prompt(call)], seeds=[0], scale=2.0, progress=steps.append, **_settings(call))
    assert result.selected == [TARGET]
    scores = dict(result.rounds[0])
    assert scores[TARGET] > 1e-3
    assert max(v for c, v in scores.items() if c != TARGET) < 1e-4 * scores[TARGET]  # inert heads: batch rounding only
    assert result.scores == [scores[TARGET]] and result.evaluations == 16 and len(calls) == 16
    assert [(s.round, s.index, s.total, s.cached) for s in steps] == [(0, i, 16, False) for i in range(16)]
    assert all(s.selection == (s.candidate,) for s in steps)
    assert restored(pipe.unet)


def test_cache_resumes_without_sampling_again(toy, tmp_path):
    pipe, call, change, calls = toy
    cache = tmp_path / "hunt.json"
    layers = ["mid_block.attentions.0.transformer_blocks.0.attn1", TARGET[0]]
    candidates = ad.head_candidates(pipe, layers)
    assert len(candidates) == 8
    kwargs = dict(candidates=candidates, seeds=[0, 1], scale=2.0, cache=cache, **_settings(call))

    calls.clear()
    stop_after = 3

    def interrupt(step):
        if step.index + 1 == stop_after:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ad.hunt(pipe, change, [_prompt(call)], progress=interrupt, **kwargs)
    assert len(calls) == 2 * stop_after  # two seeds per evaluated set
    assert len(json.loads(cache.read_text())["scores"]) == stop_after

    calls.clear()
    first = ad.hunt(pipe, change, [_prompt(call)], **kwargs)
    assert first.evaluations == 8 - stop_after and len(calls) == 2 * (8 - stop_after)
    assert first.selected == [TARGET]

    calls.clear()
    steps = []
    again = ad.hunt(pipe, change, [_prompt(call)], progress=steps.append, **kwargs)
    assert calls == [] and again.evaluations == 0 and all(s.cached for s in steps)
    assert again.selected == first.selected and again.rounds == first.rounds

    calls.clear()
    more = ad.hunt(pipe, change, [_prompt(call)], **dict(kwargs, rounds=2))
    assert more.evaluations == 7 and len(calls) == 14  # only the second round is new
    assert more.rounds[0] == first.rounds[0] and more.selected[0] == TARGET

    with pytest.raises(ValueError, match="cache: .* other settings"):
        ad.hunt(pipe, change, [_prompt(call)], **dict(kwargs, scale=3.0))


def test_cache_files_are_checked(tmp_path):
    score = lambda selection: 1.0  # noqa: E731
    pairs = [("a", 0), ("a", 1)]
    bad = tmp_path / "bad.json"
    for text in (
        "{not json",
        "[1, 2]",
        json.dumps({"version": 1, "fingerprint": "", "scores": {'[["a", 0]]': "x"}}),
        json.dumps({"version": 1, "fingerprint": "", "scores": {"a:0": 1.0}}),
        json.dumps({"version": 1, "fingerprint": "", "scores": {'[["a", 0]]': float("nan")}}),
        json.dumps({"version": 99, "fingerprint": "", "scores": {}}),
    ):
        bad.write_text(text)
        with pytest.raises(ValueError, match="cache"):
            ad.greedy(pairs, score, cache=bad)
    good = tmp_path / "good.json"
    ad.greedy(pairs, score, cache=good, fingerprint="f")
    with pytest.raises(ValueError, match="other settings"):
        ad.greedy(pairs, score, cache=good, fingerprint="g")


def test_greedy_adds_the_best_candidate_each_round():
    weights = {("a", 0): 3.0, ("a", 1): 0.5, ("b", 0): -1.0, ("b", 1): 1.0}
    seen = []

    def score(selection):
        seen.append(selection)
        bonus = 5.0 if {("a", 1), ("b", 0)} <= set(selection) else 0.0
        return sum(weights[c] for c in selection) + bonus

    result = ad.greedy(list(weights), score, rounds=3)
    # round 1: a0 (3); round 2: a0+b1 (4) beats a0+a1 (3.5) and a0+b0 (2);
    # round 3: a0+b1+a1 (4.5) beats a0+b1+b0 (3)
    assert result.selected == [("a", 0), ("b", 1), ("a", 1)]
    assert result.scores == [3.0, 4.0, 4.5]
    assert len(seen) == 4 + 3 + 2 and all(s == tuple(sorted(s)) for s in seen)
    low = ad.greedy(list(weights), score, rounds=2, maximize=False)
    # minimising: b0 (-1), then b0+b1 (0) below b0+a0 (2) and b0+a1 (-0.5 + 5)
    assert low.selected == [("b", 0), ("b", 1)] and low.scores == [-1.0, 0.0]


def test_hunt_rejects_bad_arguments(toy):
    pipe, call, change, _ = toy
    with pytest.raises(ValueError, match="objective"):
        ad.hunt(pipe, "not callable", [_prompt(call)], **_settings(call))
    with pytest.raises(ValueError, match="candidates"):
        ad.hunt(
            pipe,
            change,
            [_prompt(call)],
            candidates=[("mid_block.attentions.0.transformer_blocks.0.attn2", 0)],
            **_settings(call),
        )
    with pytest.raises(ValueError, match="rounds"):
        ad.hunt(pipe, change, [_prompt(call)], candidates=[TARGET], rounds=2, **_settings(call))
    with pytest.raises(ValueError, match="seeds"):
        ad.hunt(pipe, change, [_prompt(call)], seeds=[], **_settings(call))
    with pytest.raises(ValueError, match="generator"):
        ad.hunt(pipe, change, [_prompt(call)], generator=torch.Generator(), **_settings(call))
    with pytest.raises(ValueError, match="objective"):
        ad.hunt(pipe, lambda o, p, s: float("nan"), [_prompt(call)], candidates=[TARGET], **_settings(call))


def test_print_progress_writes_one_line_per_evaluation(capsys):
    ad.greedy([("x.attn1", 0), ("x.attn1", 1)], lambda s: float(s[0][1]), progress=ad.print_progress)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["headhunter round 1 [1/2] x.attn1:0 score 0", "headhunter round 1 [2/2] x.attn1:1 score 1"]


def test_whole_set_objective_sees_every_prompt_and_seed_once_per_set(toy):
    pipe, call, _, _ = toy
    prompts = [_prompt(call), dict(_prompt(call), prompt_embeds=call["prompt_embeds"] * 0.5)]
    seen = []
    with torch.no_grad():
        base = {(id(p), s): pipe(**call | p, generator=torch.Generator().manual_seed(s)).images for p in prompts for s in (3, 4)}

    def spread(samples):  # the total change the perturbation causes over the set
        seen.append([(id(prompt), seed) for _, prompt, seed in samples])
        return sum(float((output.images - base[(id(prompt), seed)]).abs().max()) for output, prompt, seed in samples)

    pairs = [TARGET, ("mid_block.attentions.0.transformer_blocks.0.attn1", 0)]
    result = ad.hunt(pipe, spread, prompts, seeds=[3, 4], candidates=pairs, whole_set=True, **_settings(call))
    assert result.selected == [TARGET]
    expected = [(id(p), s) for p in prompts for s in (3, 4)]
    assert seen == [expected, expected]  # one call per candidate set, with all four samples
