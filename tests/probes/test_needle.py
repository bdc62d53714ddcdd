"""The needle probe: prompts read back with plain Python, needle mass against transformers'
eager attention weights, behaviour on the needle-trained arena export, bad input."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf"))
from tiny_models import build  # noqa: E402
from wordlevel import eager_answer_mass, eager_generate, tiny_llama, word_tokenizer  # noqa: E402

from attnkit.probes import ProbeModel, load_probe_model  # noqa: E402
from attnkit.probes.haystack import FILLER  # noqa: E402
from attnkit.probes.needle import INTRO, arena_items, needle, text_items  # noqa: E402

TOK = word_tokenizer()


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(len(TOK))


def _pm(model, task=None, max_positions=512):
    return ProbeModel(model, TOK if task is None else _arena_tokenizer(task), "causal", max_positions, task, "tiny")


def _arena_tokenizer(task):
    from attnkit.arena.tokenizer import Symbols, build_tokenizer

    return build_tokenizer(Symbols.from_dict(task["symbols"]))


def _needle_task(**params):
    from attnkit.arena.export import task_record
    from attnkit.arena.tasks import make_task

    return task_record(make_task("needle", **params))


# -- (a) the prompts ------------------------------------------------------------------------


def test_text_prompts_follow_the_haystack_rules(tiny):
    items, needed = text_items(_pm(tiny), [80, 150], [0.0, 0.4, 1.0], 2, seed=5)
    assert len(items) == 2 * 3 * 2
    filler_words = {w for s in FILLER for w in TOK.convert_ids_to_tokens(TOK.encode(s, add_special_tokens=False))}
    for it in items:
        words = TOK.convert_ids_to_tokens(it.ids)
        assert len(it.ids) == it.params["length"]  # the question's buffer kept: the length is exact
        ((start, end),) = it.spans["needle"]
        needle_words = words[start:end]
        key = it.extra["key"]
        assert " ".join(needle_words) == f"The special code of the {key} is {' '.join(it.answer)} ."
        assert it.answer.isdigit() and len(it.answer) == 7
        # the prompt ends with the question about the same key and the answer's opening words
        text = " ".join(words)
        assert text.endswith(f"Question : What is the special code of the {key} ? Answer : The special code of the {key} is")
        # haystack: from the end of the intro to the question, needle removed
        intro_end = len(TOK.encode(INTRO, add_special_tokens=False))
        question = len(words) - words[::-1].index("Question")
        hay = words[intro_end:start] + words[end : question - 1]
        assert set(hay) <= filler_words
        at, n = start - intro_end, len(hay)
        target = round(it.params["depth"] * n)
        starts = [0] + [i + 1 for i, w in enumerate(hay) if w == "." and i + 1 < n]
        assert at == (n if target >= n else max(s for s in starts if s <= target))
    assert needed == 7  # seven digits, one token each


def test_same_seed_same_prompts_and_depths_share_a_sample(tiny):
    a, _ = text_items(_pm(tiny), [100], [0.0, 1.0], 2, seed=1)
    b, _ = text_items(_pm(tiny), [100], [0.0, 1.0], 2, seed=1)
    c, _ = text_items(_pm(tiny), [100], [0.0, 1.0], 2, seed=2)
    assert [x.ids for x in a] == [x.ids for x in b] and [x.ids for x in a] != [x.ids for x in c]
    # sample 0 at depth 0 and depth 1: same key and value; samples differ
    assert a[0].answer == a[1].answer and a[0].extra == a[1].extra
    assert (a[0].answer, a[0].extra["key"]) != (a[2].answer, a[2].extra["key"])


def test_custom_needle_question_and_answer(tiny):
    items, _ = text_items(
        _pm(tiny), [60], [0.5], 1, 0, needle="The key {key} opens door 3 .", question="Which door does {key} open?", answer="3"
    )
    it = items[0]
    ((s, e),) = it.spans["needle"]
    assert TOK.decode(it.ids[s:e]) == f"The key {it.extra['key']} opens door 3 ."
    assert it.answer == "3" and TOK.decode(it.ids).endswith("open ? Answer :")


def test_arena_prompts_are_the_needle_tasks_format(tiny):
    task = _needle_task(seq_len=32, num_filler=8, num_keys=8, num_values=8, distractors=2)
    sym = task["symbols"]["roles"]
    model = tiny_llama(len(task["symbols"]["tokens"]))
    items = arena_items(_pm(model, task), [32, 64], [0.0, 0.5, 1.0], 3, seed=0)
    assert len(items) == 2 * 3 * 3
    for it in items:
        words = task["symbols"]["tokens"]
        tokens = [words[i] for i in it.ids]
        n = it.params["length"]
        cells = (n - 2) // 2
        assert len(tokens) == n and tokens[-2] == "Q" and tokens[-1] == it.extra["key"]
        cell = round(it.params["depth"] * (cells - 1))
        assert it.spans["needle"] == [(2 * cell, 2 * cell + 2)]
        assert tokens[2 * cell : 2 * cell + 2] == [it.extra["key"], it.answer]
        pairs = [(tokens[2 * c], tokens[2 * c + 1]) for c in range(cells) if tokens[2 * c] in sym["keys"]]
        assert len(pairs) == 3  # the needle and the task's 2 distractors
        assert len({k for k, _ in pairs}) == 3 and len({v for _, v in pairs}) == 3
        assert all(v in sym["values"] for _, v in pairs)
        others = [t for c in range(cells) for t in tokens[2 * c : 2 * c + 2] if tokens[2 * c] not in sym["keys"]]
        assert set(others) <= set(sym["filler"])
        assert it.words  # scored as whole symbols


# -- (b) the attention side against eager weights --------------------------------------------


def test_needle_mass_and_answers_equal_eager_generate_and_output_attentions(tiny):
    lengths, depths = [90, 131], [0.0, 0.5, 1.0]
    result = needle(tiny, TOK, lengths=lengths, depths=depths, samples=1, seed=3, batch_size=2, max_new_tokens=3)
    items, _ = text_items(_pm(tiny), lengths, depths, 1, seed=3)
    for it in items:
        length, depth = it.params["length"], it.params["depth"]
        tokens = eager_generate(tiny, [it.ids], 3)
        mass = eager_answer_mass(tiny, [it.ids], tokens, [it.spans["needle"]])[0]  # (L, H)
        for layer in range(mass.shape[0]):
            for head in range(mass.shape[1]):
                got = result.value("needle_mass", length=length, depth=depth, layer=layer, head=head)
                assert got == pytest.approx(float(mass[layer, head]), rel=1e-4, abs=1e-5)  # float32 weights
        assert result.value("needle_mass_max", length=length, depth=depth) == pytest.approx(float(mass.max()), rel=1e-4)
        ((s, e),) = it.spans["needle"]
        uniform = sum((e - s) / (length + r) for r in range(3)) / 3  # rows at positions length-1 .. length+1
        assert result.value("needle_mass_uniform", length=length, depth=depth) == pytest.approx(uniform, rel=1e-12)
        [example] = [x for x in result.meta["examples"] if x["length"] == length and x["depth"] == depth]
        assert example["output"] == TOK.decode(tokens[0].tolist())
    assert result.meta["figures"][0] == {
        "kind": "heatmap",
        "rows": "depth",
        "cols": "length",
        "metric": "accuracy",
        "title": result.meta["figures"][0]["title"],
    }
    assert result.table("depth", "length", "accuracy").values is not None


def test_accuracy_is_string_match_of_the_answer(tiny):
    # answer = the needle's first word: the model does not need to find it, only to say it.
    result = needle(tiny, TOK, lengths=[80], depths=[0.5], samples=3, seed=0, max_new_tokens=2)
    for ex in result.meta["examples"]:
        assert ex["score"] == float(ex["answer"].lower() in ex["output"].lower())
    assert result.value("accuracy", length=80, depth=0.5) == pytest.approx(sum(ex["score"] for ex in result.meta["examples"]) / 3)


# -- (c) behaviour on a model trained on the needle task ------------------------------------


@pytest.fixture(scope="module")
def needle_model(needle_export):
    return load_probe_model(needle_export)


def test_arena_scores_equal_eager_argmax(needle_model):
    pm = needle_model
    result = needle(pm, lengths=[32, 64], depths=[0.0, 0.5, 1.0], samples=4, seed=0)
    items = arena_items(pm, [32, 64], [0.0, 0.5, 1.0], 4, seed=0)
    values = pm.task["symbols"]["tokens"]
    with torch.no_grad():
        for it in items:
            logits = pm.model(input_ids=torch.tensor([it.ids])).logits[0, -1]
            expected = float(values[int(logits.argmax())] == it.answer)
            [ex] = [
                x
                for x in result.meta["examples"]
                if (x["length"], x["depth"], x["sample"]) == (it.params["length"], it.params["depth"], it.params["sample"])
            ]
            assert ex["score"] == expected


def test_needle_export_finds_the_needle_with_few_heads(needle_model):
    pm = needle_model
    train = pm.task["seq_len"]
    result = needle(pm, lengths=[train], depths=[0.0, 0.25, 0.5, 0.75, 1.0], samples=8, seed=0)
    accuracy = result.mean("accuracy", length=train)
    assert accuracy >= 0.9  # where training reached, the probe's prompts are answered
    recorded = pm.task.get("training", {}).get("accuracy", {}).get(str(train))
    if recorded is not None:  # the probe's prompts are the task's held-out distribution
        assert abs(accuracy - recorded) < 0.15
    heads = result.table("layer", "head", "needle_mass", length=train)
    best = max(max(row) for row in heads.values)
    uniform = result.mean("needle_mass_uniform", length=train)
    assert best > 2.5 * uniform  # some head looks at the needle far more than an even spread would
    every = [v for row in heads.values for v in row]
    assert best > 2 * sum(every) / len(every)  # and few heads do: the best is far above the mean head


# -- (d) bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, keyword",
    [
        (dict(lengths=[]), "lengths"),
        (dict(lengths=[0]), "lengths"),
        (dict(lengths="64"), "lengths"),
        (dict(lengths=[100, 100]), "lengths"),
        (dict(lengths=[600]), "lengths"),
        (dict(lengths=[10]), "lengths"),
        (dict(depths=[1.5]), "depths"),
        (dict(depths=[50]), "depths"),
        (dict(depths=[]), "depths"),
        (dict(samples=0), "samples"),
        (dict(samples=1.5), "samples"),
        (dict(seed="x"), "seed"),
        (dict(batch_size=0), "batch_size"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(needle="no value here"), "needle"),
        (dict(needle="{nope} {value}"), "needle"),
        (dict(question=""), "question"),
        (dict(answer="{x}"), "answer"),
        (dict(haystack="/no/such/file"), "haystack"),
        (dict(progress=3), "progress"),
    ],
)
def test_bad_parameters_name_their_keyword(tiny, kwargs, keyword):
    params = dict(lengths=[100], depths=[0.5])
    params.update(kwargs)
    with pytest.raises(ValueError, match=f"^{keyword}: "):
        needle(tiny, TOK, **params)


def test_encoder_and_wrong_arena_task_are_refused(tiny):
    with pytest.raises(ValueError, match="^model: the needle probe needs a causal"):
        needle(build("bert"), TOK, lengths=[64])
    from attnkit.arena.export import task_record
    from attnkit.arena.tasks import make_task

    induction = task_record(make_task("induction", vocab_size=16, seq_len=16))
    with pytest.raises(ValueError, match="^model: the needle probe on an arena export needs a key-value task"):
        needle(_pm(tiny, induction), lengths=[16])
    task = _needle_task(seq_len=32, num_filler=8, num_keys=8, num_values=8, distractors=2)
    arena = _pm(tiny_llama(len(task["symbols"]["tokens"])), task, max_positions=128)
    with pytest.raises(ValueError, match="^lengths: the needle task cuts"):
        needle(arena, lengths=[33])
    with pytest.raises(ValueError, match="^lengths: a prompt of 256 tokens is longer than the 128"):
        needle(arena, lengths=[256])
    with pytest.raises(ValueError, match="^needle: an arena export"):
        needle(arena, lengths=[32], needle="x {value}")
