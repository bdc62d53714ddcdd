"""steer.apply: restore on exit and after errors, nesting with hf.use (meters see the
steered weights) and with itself, head sets from `attnkit probe heads`, substring spans
through tokenizer offsets, and bad input."""

import json

import pytest
import torch
from steer_reference import outputs, run_dense
from tiny_models import VOCAB, build
from wordlevel import tiny_llama, word_tokenizer

import attnkit.hf as akhf
from attnkit import steer
from attnkit.hf.attention import EDITS
from attnkit.probes.meters import RowSpanMass
from attnkit.probes.result import ProbeResult
from helpers import assert_close

N = 12


@pytest.fixture(scope="module")
def llama():
    return build("llama").double()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(1, VOCAB, (2, N), generator=torch.Generator().manual_seed(3))


def untouched(model):
    return (
        all(m not in EDITS for m in model.modules())
        and model.config._attn_implementation == "eager"
        and all(not m._forward_hooks for m in model.modules())
    )


def test_restored_after_exit_and_after_an_exception(llama, ids):
    with torch.no_grad():
        before = outputs(llama(input_ids=ids))
        with steer.apply(llama, steer.scale({0: [1]}, 3.0), steer.prune_layers(llama, 1)):
            assert not untouched(llama)
        assert untouched(llama)
        with pytest.raises(RuntimeError, match="boom"):
            with steer.apply(llama, steer.temperature("all", 0.1)):
                raise RuntimeError("boom")
        assert untouched(llama)
        assert torch.equal(outputs(llama(input_ids=ids)), before)


def test_meters_inside_hf_use_see_the_steered_weights(llama, ids):
    """PASTA on one row: the span's mass m becomes m / (m + alpha (1 - m)) on steered heads
    of layer 0 (its inputs are not steered), and stays m on the others."""
    span, alpha = (3, 7), 0.1
    spans = {"s": [span, span]}

    def masses(*interventions):
        meter = RowSpanMass(spans, q_lo=N - 1)
        with torch.no_grad():
            if interventions:
                with steer.apply(llama, *interventions), akhf.use(llama, observers=[meter]):
                    llama(input_ids=ids)
            else:
                with akhf.use(llama, observers=[meter]):
                    llama(input_ids=ids)
        return meter.per_example("s")[:, 0]  # (B, H) layer 0, last row

    plain = masses()
    steered = masses(steer.emphasize([span], {0: [0, 3], 1: [2]}, alpha=alpha))
    want = plain.clone()
    for h in (0, 3):
        m = plain[:, h]
        want[:, h] = m / (m + alpha * (1 - m))
    assert_close(steered, want)
    assert (steered[:, 0] > plain[:, 0]).all()


def test_steer_inside_a_switch_keeps_the_switch_and_its_observers(llama, ids):
    meter = RowSpanMass({"s": [(0, 4), (0, 4)]}, q_lo=N - 1)
    with torch.no_grad(), akhf.use(llama, observers=[meter]) as switch:
        with steer.apply(llama, steer.temperature({1: [0]}, 0.5)):
            llama(input_ids=ids)
        assert akhf.switch.active_switch(llama)[0] is switch
    assert meter.per_example("s").shape == (2, 3, 4)


def test_nested_apply_adds_to_the_outer_interventions(llama, ids):
    a, b = steer.temperature({0: [1]}, 0.4), steer.scale({2: [3]}, 2.0)
    with torch.no_grad():
        with steer.apply(llama, a, b):
            both = outputs(llama(input_ids=ids))
        with steer.apply(llama, a):
            with steer.apply(llama, b):
                nested = outputs(llama(input_ids=ids))
            only_a = outputs(llama(input_ids=ids))
        with steer.apply(llama, a):
            again_a = outputs(llama(input_ids=ids))
    assert torch.equal(nested, both)
    assert torch.equal(only_a, again_a)
    assert untouched(llama)


def test_head_set_saved_by_probe_heads_selects_its_heads(llama, ids, tmp_path):
    from attnkit.probes.heads import save_head_set

    result = ProbeResult("heads")
    scores = {(0, 1): 0.9, (2, 3): 0.8, (1, 0): 0.1}
    for layer in range(3):
        for head in range(4):
            result.add("retrieval", scores.get((layer, head), 0.0), layer=layer, head=head)
    path = tmp_path / "heads.json"
    save_head_set(result, path, "retrieval", k=2)
    with torch.no_grad():
        with steer.apply(llama, steer.ablate(str(path))) as steering:
            from_file = outputs(llama(input_ids=ids))
        assert steering.interventions[0].heads == {0: (1,), 2: (3,)}
        with steer.apply(llama, steer.ablate(json.loads(path.read_text()))):
            from_dict = outputs(llama(input_ids=ids))
        with steer.apply(llama, steer.ablate([(0, 1), (2, 3)])):
            from_pairs = outputs(llama(input_ids=ids))
        with steer.apply(llama, steer.ablate({"0": [1], 2: 3})):
            from_mapping = outputs(llama(input_ids=ids))
    assert torch.equal(from_file, from_pairs) and torch.equal(from_dict, from_pairs) and torch.equal(from_mapping, from_pairs)


def test_substring_spans_map_through_offsets_per_padded_row():
    tok = word_tokenizer()
    model = tiny_llama(len(tok)).double()
    prompts = ["the secret code is 42 . What is the code ?", "Read the text below : the value is 7"]
    enc = tok(prompts, padding=True, return_offsets_mapping=True, return_tensors="pt")
    with pytest.raises(ValueError, match="spans: substring 'secret code is 42' not found in prompt 1 of text"):
        steer.emphasize(["secret code is 42"], {1: [0]}, text=prompts, tokenizer=tok)  # one list for every row
    iv = steer.emphasize([["secret code is 42", "What"], ["the value"]], {1: [0, 2]}, alpha=0.05, text=prompts, tokenizer=tok)
    pad0 = int((enc["attention_mask"][0] == 0).sum())
    pad1 = int((enc["attention_mask"][1] == 0).sum())
    # tokens: the secret code is 4 2 . What ... (digits one token each) / Read the text below : the value is 7
    assert iv.rows == [[(pad0 + 1, pad0 + 6), (pad0 + 7, pad0 + 8)], [(pad1 + 5, pad1 + 7)]]
    assert tok.convert_ids_to_tokens(enc["input_ids"][0, pad0 + 1 : pad0 + 6].tolist()) == ["secret", "code", "is", "4", "2"]
    inputs = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    inputs["position_ids"] = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    keep = enc["attention_mask"].bool()
    inside = torch.zeros_like(keep)
    for b, ranges in enumerate(iv.rows):
        for a, e in ranges:
            inside[b, a:e] = True
    want = outputs(run_dense(model, dict(emphasize=(inside, 0.05), heads={1: [0, 2]}, keep=keep), **inputs))
    with torch.no_grad(), steer.apply(model, iv):
        got = outputs(model(**inputs))
    assert_close(got[keep], want[keep])


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: steer.ablate({3: [0]}), r"heads: expected a layer index below 3, got 3"),
        (lambda: steer.ablate([(0, 4)]), r"heads: expected a head index below 4 \(layer 0\), got 4"),
        # indices count from 0, not from the end: a negative one is refused as such, not as too large
        (lambda: steer.ablate([(-1, 0)]), r"heads: expected a layer index >= 0 and below 3, got -1$"),
        (lambda: steer.ablate({1: [-2]}), r"heads: expected a head index >= 0 and below 4 \(layer 1\), got -2$"),
        (lambda: steer.ablate([]), r"heads: the selection names no head"),
        (lambda: steer.ablate("missing.json"), r"heads: cannot read a head set"),
        (lambda: steer.ablate([(0, 1)], mode="max"), r"mode: expected one of zero, mean"),
        (lambda: steer.ablate([(0, 1)], mode="mean"), r"reference: mode='mean' needs a reference batch"),
        (lambda: steer.temperature([(0, 1)], 0.0), r"t: expected a number > 0"),
        (lambda: steer.disperse([(0, 1)], 1.5), r"strength: expected a number <= 1"),
        (lambda: steer.emphasize([(0, 3)], [(0, 1)], alpha=0.0), r"alpha: expected a number in \(0, 1\]"),
        (lambda: steer.emphasize([(3, 3)], [(0, 1)]), r"spans: expected token ranges"),
        (
            lambda: steer.emphasize(["zebra"], [(0, 1)], text="the code", tokenizer=word_tokenizer()),
            r"spans: substring 'zebra' not found",
        ),
        (lambda: steer.emphasize(["code"], [(0, 1)]), r"text: substrings in spans need the prompt text"),
        (lambda: steer.prune_layers(build("llama"), 4), r"k: expected an int in \[0, 3\]"),
    ],
)
def test_bad_input_names_the_argument(llama, make, match):
    with pytest.raises(ValueError, match=match):
        with steer.apply(llama, make()):
            pass
    assert untouched(llama)


def test_spans_outside_the_prompt_fail_and_leave_the_model_as_it_was(llama, ids):
    with torch.no_grad():
        before = outputs(llama(input_ids=ids))
        with pytest.raises(ValueError, match=r"spans: \(10, 20\) of batch row 0 lies outside the prompt of 12 tokens"):
            with steer.apply(llama, steer.emphasize([(10, 20)], {0: [0]})):
                llama(input_ids=ids)
        with pytest.raises(ValueError, match="spans: given for 3 batch rows, but the call has a batch of 2"):
            with steer.apply(llama, steer.emphasize([[(0, 2)]] * 3, {0: [0]})):
                llama(input_ids=ids)
        assert untouched(llama)
        assert torch.equal(outputs(llama(input_ids=ids)), before)


def test_a_model_attnkit_cannot_switch_gets_a_clear_error():
    with pytest.raises(ValueError, match="model: expected a transformers PreTrainedModel"):
        with steer.apply(torch.nn.Linear(2, 2), steer.scale([(0, 0)], 2.0)):
            pass
    with pytest.raises(ValueError, match="interventions: argument 1 is a str"):
        with steer.apply(build("llama"), "ablate"):
            pass


def test_score_steering_refuses_a_switch_that_splits_heads(llama, ids):
    """A mechanism on some heads runs them as a call of their own, renumbered: steering
    that names heads of the whole layer cannot follow, and says so."""
    with torch.no_grad():
        with pytest.raises(ValueError, match="heads: attnkit.steer's interventions name heads of the whole layer"):
            with steer.apply(llama, steer.temperature({0: [1]}, 0.5)), akhf.use(llama, mechanism="sigmoid", heads=[0]):
                llama(input_ids=ids)
        # output transforms act on the merged heads, so they run with such a switch
        with steer.apply(llama, steer.ablate({0: [1]})), akhf.use(llama, mechanism="sigmoid", heads=[0]):
            llama(input_ids=ids)
    assert untouched(llama)
