"""The kv-retrieval probe (lost in the middle): JSON prompts parsed back with plain
Python, gold-pair mass against transformers' eager attention, the arena form, bad input."""

import json
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf"))
from tiny_models import build  # noqa: E402
from wordlevel import char_tokenizer, eager_answer_mass, eager_generate, tiny_llama  # noqa: E402

from attnkit.probes import ProbeModel, load_probe_model  # noqa: E402
from attnkit.probes.kv_retrieval import arena_items, kv_retrieval, text_items  # noqa: E402
from attnkit.probes.retrieval import arena_symbols  # noqa: E402

TOK = char_tokenizer()


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(len(TOK), max_positions=1024)


def _pm(model, task=None, tokenizer=TOK, max_positions=1024):
    return ProbeModel(model, tokenizer, "causal", max_positions, task, "tiny")


def _parse(text):
    """(pairs in order, asked key) from a prompt's text."""
    start, end = text.index("{"), text.index("}")
    pairs = json.loads(text[start : end + 1], object_pairs_hook=list)
    asked = json.loads(text[end + 1 :].split("Key: ")[1].split("\n")[0])
    assert text.endswith("\nValue:")
    return pairs, asked


def test_prompts_hold_the_gold_pair_at_each_position(tiny):
    items = text_items(_pm(tiny), [4, 7], [0.0, 0.5, 1.0], 2, seed=11)
    assert [(it.params["pairs"], it.params["position"]) for it in items[:3]] == [(4, 0), (4, 2), (4, 3)]
    for it in items:
        text = TOK.decode(it.ids)
        pairs, asked = _parse(text)
        n, position = it.params["pairs"], it.params["position"]
        assert len(pairs) == n and position == round(it.params["depth"] * (n - 1))
        assert [k for k, _ in pairs].index(asked) == position  # the asked key sits at the position
        assert dict(pairs)[asked] == it.answer
        for k, v in pairs:
            assert uuid.UUID(k).version == 4 and uuid.UUID(v).version == 4
        assert len({k for k, _ in pairs}) == n
        ((s, e),) = it.spans["gold"]
        assert TOK.decode(it.ids[s:e]).lstrip(", ") == f'"{asked}": "{it.answer}"'
    # one sample: the same pairs at every position, the others keeping their order
    first = [_parse(TOK.decode(it.ids))[0] for it in items[:3]]
    gold = first[0][0]
    assert all(gold in p for p in first)
    assert all([x for x in p if x != gold] == [x for x in first[0] if x != gold] for p in first)
    again = text_items(_pm(tiny), [4, 7], [0.0, 0.5, 1.0], 2, seed=11)
    other = text_items(_pm(tiny), [4, 7], [0.0, 0.5, 1.0], 2, seed=12)
    assert [x.ids for x in again] == [x.ids for x in items] != [x.ids for x in other]


def test_depths_landing_on_one_position_run_once(tiny):
    items = text_items(_pm(tiny), [2], [0.0, 0.2, 0.8, 1.0], 1, seed=0)
    assert [it.params["position"] for it in items] == [0, 1]


def test_gold_mass_and_answers_equal_eager(tiny):
    result = kv_retrieval(tiny, TOK, pairs=[3], depths=[0.0, 0.5, 1.0], samples=1, seed=2, max_new_tokens=2)
    items = text_items(_pm(tiny), [3], [0.0, 0.5, 1.0], 1, seed=2)
    for it in items:
        tokens = eager_generate(tiny, [it.ids], 2)
        mass = eager_answer_mass(tiny, [it.ids], tokens, [it.spans["gold"]])[0]
        P, position = len(it.ids), it.params["position"]
        for layer in range(mass.shape[0]):
            for head in range(mass.shape[1]):
                got = result.value("gold_mass", pairs=3, position=position, layer=layer, head=head)
                assert got == pytest.approx(float(mass[layer, head]), rel=1e-4, abs=1e-5)
        ((s, e),) = it.spans["gold"]
        assert result.value("gold_mass_uniform", pairs=3, position=position) == pytest.approx(
            ((e - s) / P + (e - s) / (P + 1)) / 2, rel=1e-12
        )
        [ex] = [x for x in result.meta["examples"] if x["position"] == position]
        assert ex["output"] == TOK.decode(tokens[0].tolist())
        assert result.value("accuracy", pairs=3, position=position) == float(it.answer in ex["output"])
    assert {f["kind"] for f in result.meta["figures"]} == {"curve"}


def _needle_task():
    from attnkit.arena.export import task_record
    from attnkit.arena.tasks import make_task

    return task_record(make_task("needle", seq_len=32, num_filler=8, num_keys=8, num_values=8, distractors=2))


def test_arena_prompts_are_pairs_then_the_query():
    task = _needle_task()
    pm = _pm(tiny_llama(len(task["symbols"]["tokens"])), task, tokenizer=None, max_positions=128)
    items = arena_items(arena_symbols(pm, "kv-retrieval"), [5], [0.0, 0.5, 1.0], 2, seed=0)
    tokens = task["symbols"]["tokens"]
    roles = task["symbols"]["roles"]
    for it in items:
        words = [tokens[i] for i in it.ids]
        assert len(words) == 2 * 5 + 2 and words[-2] == "Q"
        pairs = list(zip(words[:-2:2], words[1:-2:2]))
        assert all(k in roles["keys"] and v in roles["values"] for k, v in pairs)
        assert len({k for k, _ in pairs}) == 5 and len({v for _, v in pairs}) == 5
        position = it.params["position"]
        assert pairs[position] == (words[-1], it.answer)
        assert it.spans["gold"] == [(2 * position, 2 * position + 2)]


def test_needle_export_retrieves_above_chance(needle_export):
    pm = load_probe_model(needle_export)
    result = kv_retrieval(pm, pairs=[3], depths=[0.0, 0.5, 1.0], samples=16, seed=0)
    values = len(pm.task["symbols"]["roles"]["values"])
    assert result.mean("accuracy") > 1.5 / values  # above guessing a value symbol
    assert result.mean("gold_mass_max") > result.mean("gold_mass_uniform")


@pytest.mark.parametrize(
    "kwargs, keyword",
    [
        (dict(pairs=[]), "pairs"),
        (dict(pairs=[0]), "pairs"),
        (dict(pairs=[2, 2]), "pairs"),
        (dict(pairs=[40]), "pairs"),
        (dict(depths=[-0.1]), "depths"),
        (dict(depths=["a"]), "depths"),
        (dict(samples=0), "samples"),
        (dict(seed=None), "seed"),
        (dict(batch_size=-1), "batch_size"),
        (dict(max_new_tokens=1.5), "max_new_tokens"),
    ],
)
def test_bad_parameters_name_their_keyword(tiny, kwargs, keyword):
    params = dict(pairs=[2], depths=[0.5])
    params.update(kwargs)
    with pytest.raises(ValueError, match=f"^{keyword}: "):
        kv_retrieval(tiny, TOK, **params)


def test_wrong_models_are_refused(tiny):
    with pytest.raises(ValueError, match="^model: the kv-retrieval probe needs a causal"):
        kv_retrieval(build("bert"), TOK)
    from attnkit.arena.export import task_record
    from attnkit.arena.tasks import make_task

    induction = task_record(make_task("induction", vocab_size=16, seq_len=16))
    with pytest.raises(ValueError, match="^model: the kv-retrieval probe on an arena export needs a key-value task"):
        kv_retrieval(_pm(tiny, induction))
    task = _needle_task()
    arena = _pm(tiny_llama(len(task["symbols"]["tokens"])), task, tokenizer=None, max_positions=128)
    with pytest.raises(ValueError, match="^pairs: the task has 8 keys"):
        kv_retrieval(arena, pairs=[9])
