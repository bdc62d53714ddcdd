"""Head selection: rank_heads equals the span mass read from eager output_attentions;
profile_heads steers each head alone (checked against removing the head from the
weights), reports progress, resumes from its cache; bad input."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "probes"))
from wordlevel import tiny_llama, word_tokenizer  # noqa: E402

from attnkit.steer import HeadRanking, profile_heads, rank_heads, scale  # noqa: E402
from helpers import TOL  # noqa: E402

PROMPTS = [
    "the sky is blue . red tiger opens door . What opens the door ?",
    "silver falcon and quiet otter . the grass is green . Which does open ?",
]
SPANS = ["red tiger opens door", "quiet otter"]
SPAN_TOKENS = [(5, 9), (3, 5)]  # the same spans counted by hand: one token per word or mark


@pytest.fixture(scope="module")
def subject():
    tok = word_tokenizer()
    return tiny_llama(len(tok)), tok


def eager_mass(model, ids, span, lo):
    """(L, H): mean over query rows >= lo of the weight on the span, from output_attentions."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True)
    a, b = span
    return torch.stack([att[0, :, lo:, a:b].sum(-1).mean(-1).double() for att in out.attentions])


def test_the_hand_counted_spans_are_the_substrings(subject):
    _, tok = subject
    for prompt, span, (a, b) in zip(PROMPTS, SPANS, SPAN_TOKENS):
        ids = tok(prompt)["input_ids"]
        assert tok.decode(ids[a:b]) == span


@pytest.mark.parametrize("queries", ["after", "last"])
def test_rank_heads_equals_the_eager_mass_ranking(subject, queries):
    model, tok = subject
    want = torch.zeros(2, 4, dtype=torch.float64)
    for prompt, span in zip(PROMPTS, SPAN_TOKENS):
        ids = tok(prompt)["input_ids"]
        want += eager_mass(model, ids, span, span[1] if queries == "after" else len(ids) - 1)
    want /= len(PROMPTS)
    ranking = rank_heads(model, tok, PROMPTS, SPANS, queries=queries)
    torch.testing.assert_close(ranking.scores, want, **TOL[torch.float32])
    flat = want.flatten().tolist()
    assert ranking.order() == [divmod(i, 4) for i in sorted(range(8), key=lambda i: -flat[i])]
    assert ranking.top(3) == ranking.order()[:3] and ranking.metric == "span_mass"
    # token-id prompts with token ranges give the same
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    again = rank_heads(model, tok, ids, SPAN_TOKENS, queries=queries)
    torch.testing.assert_close(again.scores, ranking.scores, rtol=0, atol=0)


def test_rank_heads_adds_the_masses_of_several_spans(subject):
    model, tok = subject
    ids = tok(PROMPTS[0])["input_ids"]
    got = rank_heads(model, tok, [ids], [[(0, 2), (5, 7)]]).scores
    want = eager_mass(model, ids, (0, 2), 7) + eager_mass(model, ids, (5, 7), 7)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_head_ranking_orders_ties_by_layer_then_head_and_skips_nan():
    r = HeadRanking(torch.tensor([[1.0, math.nan], [2.0, 1.0]], dtype=torch.float64), "m")
    assert r.order() == [(1, 0), (0, 0), (1, 1)]
    assert [row["value"] for row in r.rows()] == [2.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="^k: expected an int >= 1"):
        r.top(0)


# -- profile_heads ------------------------------------------------------------------------------


def target_logit(model, tokenizer, example):
    ids = torch.tensor([tokenizer(example["prompt"])["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    return float(logits[tokenizer.convert_tokens_to_ids(example["answer"])])


EXAMPLES = [
    {"prompt": PROMPTS[0], "span": SPANS[0], "answer": "red"},
    {"prompt": PROMPTS[1], "span": SPANS[1], "answer": "otter"},
]


def without_head(model, layer, head):
    """The model with head (layer, head) removed from the weights: its slice of o_proj's
    input zeroed (an independent way to silence one head)."""
    import copy

    clone = copy.deepcopy(model)
    d = clone.config.hidden_size // clone.config.num_attention_heads
    with torch.no_grad():
        clone.model.layers[layer].self_attn.o_proj.weight[:, head * d : (head + 1) * d] = 0
    return clone


def test_profile_heads_steers_each_head_alone(subject):
    model, tok = subject
    lines = []
    result = profile_heads(
        model,
        tok,
        EXAMPLES,
        target_logit,
        heads=[(0, 1), (1, 2), (1, 3)],
        make=lambda head: scale([head], 0.0),
        progress=lines.append,
    )
    for layer, head in [(0, 1), (1, 2), (1, 3)]:
        clone = without_head(model, layer, head)
        want = sum(target_logit(clone, tok, e) for e in EXAMPLES) / 2
        assert result.scores[layer, head].item() == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert math.isnan(result.scores[0, 0].item())  # not profiled
    assert result.meta["baseline"] == pytest.approx(sum(target_logit(model, tok, e) for e in EXAMPLES) / 2, rel=1e-6)
    assert len(lines) == 3 and lines[0].startswith("head 1/3: layer 0 head 1 score ")
    assert result.order()[0] in [(0, 1), (1, 2), (1, 3)] and len(result.order()) == 3


def test_profile_heads_passes_the_example_to_two_argument_factories(subject):
    model, tok = subject
    seen = []

    def make(head, example):
        seen.append((head, example["answer"]))
        return scale([head], 0.0)

    two = profile_heads(model, tok, EXAMPLES, target_logit, heads=[(1, 1)], make=make)
    one = profile_heads(model, tok, EXAMPLES, target_logit, heads=[(1, 1)], make=lambda head: scale([head], 0.0))
    assert seen == [((1, 1), "red"), ((1, 1), "otter")]
    assert two.scores[1, 1].item() == one.scores[1, 1].item()


def test_profile_heads_by_default_emphasizes_the_example_span(subject):
    from attnkit.steer import apply, emphasize

    model, tok = subject
    result = profile_heads(model, tok, EXAMPLES, target_logit, heads=[(1, 0)], alpha=0.05)
    want = 0.0
    for e in EXAMPLES:
        with apply(model, emphasize(e["span"], [(1, 0)], 0.05, text=e["prompt"], tokenizer=tok)):
            want += target_logit(model, tok, e) / 2
    assert result.scores[1, 0].item() == pytest.approx(want, rel=1e-6)
    assert result.scores[1, 0].item() != pytest.approx(result.meta["baseline"], rel=1e-6)  # the emphasis changed it


class Stop(Exception):
    pass


def test_profile_heads_resumes_from_its_cache(subject, tmp_path):
    model, tok = subject
    cache = tmp_path / "profile.json"
    heads = [(0, 0), (0, 1), (1, 0), (1, 1)]
    calls = []

    def counting(model, tokenizer, example):
        calls.append(1)
        if len(calls) > 6:  # baseline (2 calls) and two heads (4 calls), then the run dies
            raise Stop
        return target_logit(model, tokenizer, example)

    make = lambda head: scale([head], 0.5)  # noqa: E731
    with pytest.raises(Stop):
        profile_heads(model, tok, EXAMPLES, counting, heads=heads, make=make, cache=cache)
    saved = json.loads(cache.read_text())
    assert sorted(saved["scores"]) == ["0,0", "0,1"] and saved["baseline"] is not None
    calls.clear()
    lines = []

    def resumed(model, tokenizer, example):
        calls.append(1)
        return target_logit(model, tokenizer, example)

    # the same score function name is part of the cache key: resume with a function of the same name
    resumed.__qualname__ = counting.__qualname__
    result = profile_heads(model, tok, EXAMPLES, resumed, heads=heads, make=make, cache=cache, progress=lines.append)
    assert len(calls) == 4  # only the two heads left, two examples each; no baseline again
    assert lines[0].endswith("(cached)") and lines[1].endswith("(cached)") and not lines[2].endswith("(cached)")
    fresh = profile_heads(model, tok, EXAMPLES, target_logit, heads=heads, make=make)
    torch.testing.assert_close(result.scores, fresh.scores, rtol=0, atol=0, equal_nan=True)
    assert result.meta["baseline"] == fresh.meta["baseline"]
    # a cache of other examples is not silently reused
    with pytest.raises(ValueError, match="^cache: .* holds a profile of another"):
        profile_heads(model, tok, EXAMPLES[:1], resumed, heads=heads, make=make, cache=cache)
    # nor a cache of other weights under the same config
    other = tiny_llama(len(tok), seed=1)
    with pytest.raises(ValueError, match="^cache: .* holds a profile of another"):
        profile_heads(other, tok, EXAMPLES, resumed, heads=heads, make=make, cache=cache)
    cache.write_text('{"not": 1}')
    with pytest.raises(ValueError, match="^cache: .* is not a head-profile cache"):
        profile_heads(model, tok, EXAMPLES, resumed, heads=heads, make=make, cache=cache)


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompts, spans, kwargs, message",
    [
        ([], [], {}, "^prompts: expected a non-empty list"),
        (PROMPTS, SPANS[:1], {}, r"^spans: expected one entry per prompt \(2\), got 1"),
        (PROMPTS, SPANS, {"queries": "first"}, "^queries: expected one of after, last"),
        (PROMPTS, ["no such words", SPANS[1]], {}, "^spans: substring 'no such words' not found"),
        ([PROMPTS[0]], [(5, 100)], {}, r"^spans: \(5, 100\) of prompt 0 ends past its 15 tokens"),
        ([PROMPTS[0]], [(10, 15)], {}, "^spans: the span of prompt 0 ends at its last token"),
        ([[1, 2, 3]], ["sky"], {}, "^spans: prompt 0 is given as token ids"),
        ([42], [(0, 1)], {}, "^prompts: prompt 0 must be a non-empty string or a list of token ids"),
        ([PROMPTS[0]], [(3, 3)], {}, r"^spans: expected token ranges \(start, end\) with 0 <= start < end"),
    ],
)
def test_rank_heads_bad_input(subject, prompts, spans, kwargs, message):
    model, tok = subject
    with pytest.raises(ValueError, match=message):
        rank_heads(model, tok, prompts, spans, **kwargs)


def test_profile_heads_bad_input(subject):
    model, tok = subject
    with pytest.raises(ValueError, match="^examples: expected a non-empty list"):
        profile_heads(model, tok, [], target_logit)
    with pytest.raises(ValueError, match="^score_fn: expected a callable"):
        profile_heads(model, tok, EXAMPLES, "accuracy")
    with pytest.raises(ValueError, match="^heads: "):
        profile_heads(model, tok, EXAMPLES, target_logit, heads=[(5, 0)])
    with pytest.raises(ValueError, match="^examples: the default intervention .* needs each example as a dict"):
        profile_heads(model, tok, ["just text"], lambda m, t, e: 1.0, heads=[(0, 0)])
    with pytest.raises(ValueError, match="^score_fn: expected a finite number for example 0, got nan"):
        profile_heads(model, tok, EXAMPLES, lambda m, t, e: float("nan"), heads=[(0, 0)])
    calls = []
    with pytest.raises(ValueError, match="^alpha: expected a number in"):
        profile_heads(model, tok, EXAMPLES, lambda m, t, e: calls.append(1) or 1.0, heads=[(0, 0)], alpha=2.0)
    assert calls == []  # refused before any run
    with pytest.raises(ValueError, match="^cache: the directory of .* does not exist"):
        profile_heads(model, tok, EXAMPLES, target_logit, heads=[(0, 0)], cache="/no/such/dir/profile.json")
