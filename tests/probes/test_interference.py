"""The interference probe (PI-LLM): update streams read back with plain Python, last- and
stale-value masses against transformers' eager attention, behaviour, bad input."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf"))
from tiny_models import build  # noqa: E402
from wordlevel import char_tokenizer, eager_answer_mass, eager_generate, tiny_llama  # noqa: E402

from attnkit.probes import ProbeModel, load_probe_model  # noqa: E402
from attnkit.probes.interference import arena_items, interference, text_items  # noqa: E402
from attnkit.probes.retrieval import arena_symbols  # noqa: E402

TOK = char_tokenizer()


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(len(TOK), max_positions=1024)


def _pm(model, task=None, tokenizer=TOK, max_positions=1024):
    return ProbeModel(model, tokenizer, "causal", max_positions, task, "tiny")


def _parse(text):
    """(updates as (key, value) in order, asked key) from a prompt's text."""
    lines = text.split("\n")
    updates = [tuple(part.strip() for part in line.split(":")) for line in lines[1:-1]]
    last = lines[-1]
    assert last.startswith("Question: What is the last value of ")
    asked = last[len("Question: What is the last value of ") :].split("?")[0]
    assert last.endswith(f"Answer: The last value of {asked} is")
    return updates, asked


@pytest.mark.parametrize("n", [1, 3, 5])
def test_every_key_is_updated_n_times_and_the_answer_is_the_last_value(tiny, n):
    items = text_items(_pm(tiny), [n], 3, 4, seed=0)
    for it in items:
        updates, asked = _parse(TOK.decode(it.ids))
        keys = {k for k, _ in updates}
        assert len(keys) == 3 and asked in keys and len(updates) == 3 * n
        for key in keys:
            values = [v for k, v in updates if k == key]
            assert len(values) == n and len(set(values)) == n  # n distinct values per key
        # distinct over the whole stream: naming another key's value never scores
        assert len({v for _, v in updates}) == len(updates)
        history = [v for k, v in updates if k == asked]
        assert it.answer == history[-1] and it.extra["stale"] == history[:-1]
        ((s, e),) = it.spans["last"]
        assert TOK.decode(it.ids[s:e]) == " " + history[-1]
        stale = it.spans.get("stale", [])
        assert [TOK.decode(it.ids[a:b]).strip() for a, b in stale] == history[:-1]
        assert all(b <= s for _, b in stale)  # the stale values come before the last one
    assert text_items(_pm(tiny), [n], 3, 4, seed=0)[0].ids == items[0].ids
    assert text_items(_pm(tiny), [n], 3, 4, seed=1)[0].ids != items[0].ids


def test_arena_streams_use_the_tasks_symbols():
    from attnkit.arena.export import task_record
    from attnkit.arena.tasks import make_task

    task = task_record(make_task("needle", seq_len=32, num_filler=8, num_keys=8, num_values=8, distractors=2))
    pm = _pm(tiny_llama(len(task["symbols"]["tokens"])), task, tokenizer=None, max_positions=128)
    tokens, roles = task["symbols"]["tokens"], task["symbols"]["roles"]
    for it in arena_items(arena_symbols(pm, "interference"), [4], 2, 3, seed=0):
        words = [tokens[i] for i in it.ids]
        assert words[-2] == "Q" and len(words) == 2 * 2 * 4 + 2
        updates = list(zip(words[:-2:2], words[1:-2:2]))
        assert all(k in roles["keys"] and v in roles["values"] for k, v in updates)
        history = [v for k, v in updates if k == words[-1]]
        assert len(history) == 4 and it.answer == history[-1] and it.extra["stale"] == history[:-1]
        where = [i for i, (k, _) in enumerate(updates) if k == words[-1]]
        assert it.spans["last"] == [(2 * where[-1] + 1, 2 * where[-1] + 2)]  # the value token of the last update
        assert it.spans["stale"] == [(2 * i + 1, 2 * i + 2) for i in where[:-1]]


def test_last_and_stale_mass_equal_eager(tiny):
    result = interference(tiny, TOK, updates=[1, 3], keys=2, samples=2, seed=4, max_new_tokens=2)
    for n in (1, 3):
        items = text_items(_pm(tiny), [n], 2, 2, seed=4)
        if n == 3:  # two prompts of different lengths in one batch: the left-padded path
            assert len({len(it.ids) for it in items}) == 2
        masses = {"last": [], "stale": []}
        for it in items:
            tokens = eager_generate(tiny, [it.ids], 2)
            masses["last"].append(eager_answer_mass(tiny, [it.ids], tokens, [it.spans["last"]])[0])
            if n > 1:
                masses["stale"].append(eager_answer_mass(tiny, [it.ids], tokens, [it.spans["stale"]])[0])
        for name in ("last", "stale") if n > 1 else ("last",):
            mean = sum(masses[name]) / len(masses[name])  # mean over the samples
            for layer in range(mean.shape[0]):
                for head in range(mean.shape[1]):
                    got = result.value(f"{name}_mass", n=n, layer=layer, head=head)
                    assert got == pytest.approx(float(mean[layer, head]), rel=1e-4, abs=1e-5)
    assert not result.select("stale_mass", n=1)  # one update: nothing stale


def test_needle_export_suffers_interference(needle_export):
    pm = load_probe_model(needle_export)
    result = interference(pm, updates=[1, 8], keys=3, samples=24, seed=0)
    assert result.value("accuracy", n=1) > result.value("accuracy", n=8)
    assert result.value("stale_answer", n=1) == 0  # nothing stale to name
    assert result.value("stale_answer", n=8) > 0.25  # the wrong answers are earlier values of the key
    assert result.value("last_mass_max", n=1) > result.value("last_mass_max", n=8)


@pytest.mark.parametrize(
    "kwargs, keyword",
    [
        (dict(updates=[]), "updates"),
        (dict(updates=[0]), "updates"),
        (dict(updates=[2, 2]), "updates"),
        (dict(updates=[200]), "updates"),
        (dict(keys=0), "keys"),
        (dict(keys=99), "keys"),
        (dict(samples=-2), "samples"),
        (dict(seed=1.5), "seed"),
        (dict(batch_size=0), "batch_size"),
        (dict(max_new_tokens=0), "max_new_tokens"),
    ],
)
def test_bad_parameters_name_their_keyword(tiny, kwargs, keyword):
    params = dict(updates=[1], keys=2, samples=1)
    params.update(kwargs)
    with pytest.raises(ValueError, match=f"^{keyword}: "):
        interference(tiny, TOK, **params)


def test_encoder_is_refused():
    with pytest.raises(ValueError, match="^model: the interference probe needs a causal"):
        interference(build("bert"), TOK)
