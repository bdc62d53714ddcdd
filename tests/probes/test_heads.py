"""The heads probe: prompt rules read with plain Python, every score against the same
quantity computed from eager output_attentions on a tiny random Llama (GQA), an
induction-trained arena export against a random model of the same shape, bad input."""

import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf"))
from tiny_models import VOCAB, build  # noqa: E402

from attnkit.arena.tokenizer import Symbols, build_tokenizer
from attnkit.probes import run
from attnkit.probes.heads import SCORES, save_head_set, top_heads

PARAMS = dict(length=5, repeats=3, samples=3, needle=4, context=20, top=3, batch_size=2, seed=3)


def word_tokenizer():
    """A word-level tokenizer over the tiny models' ids: "w0" ... "w96", "w0" pads."""
    return build_tokenizer(Symbols(tuple(f"w{i}" for i in range(VOCAB)), {}, "w0"))


@pytest.fixture(scope="module")
def llama_run():
    model, tok = build("llama"), word_tokenizer()
    return model, tok, run("heads", model, tok, **PARAMS)


def test_prompt_rules(llama_run):
    model, tok, result = llama_run
    prompts = result.meta["prompts"]
    assert len(prompts["repeated"]) == PARAMS["samples"]
    for p in prompts["repeated"]:  # no BOS (the tokenizer has none): repeats copies of one segment
        n = PARAMS["length"]
        segment = p[:n]
        assert len(p) == n * PARAMS["repeats"] and p == segment * PARAMS["repeats"]
        assert len(set(segment)) == n and 0 not in segment  # distinct, never the pad (a special token)
    needle = prompts["needle"]
    for p, (a, e), answer in zip(needle["prompts"], needle["spans"], needle["answers"]):
        assert len(p) == PARAMS["context"] and e - a == PARAMS["needle"]
        chosen = p[a:e]
        assert len(set(chosen)) == len(chosen) and 0 not in p
        assert not set(chosen) & set(p[:a] + p[e:-1])  # the haystack never holds a needle token
        assert p[-1] == chosen[0] and answer == chosen[1:]
    again = run("heads", model, tok, **{**PARAMS, "scores": ["induction", "retrieval"]})
    assert again.meta["prompts"] == prompts  # same seed, same prompts, whatever is scored
    other = run("heads", model, tok, **{**PARAMS, "seed": 4, "scores": ["sink"]})
    assert other.meta["prompts"]["repeated"] != prompts["repeated"]


def _eager(model, ids):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), output_attentions=True)
    return torch.stack(out.attentions).double()  # (L, B, H, N, N)


def test_scores_equal_eager_attention(llama_run):
    model, _, result = llama_run
    L, H = 3, 4
    prompts = result.meta["prompts"]["repeated"]
    A = _eager(model, prompts)
    expected = {s: torch.zeros(L, H, dtype=torch.float64) for s in ("previous_token", "duplicate_token", "induction", "sink")}
    rows = dict.fromkeys(expected, 0)
    for b, ids in enumerate(prompts):
        for q in range(len(ids)):
            earlier = [j for j in range(q) if ids[j] == ids[q]]
            expected["sink"] += A[:, b, :, q, 0]
            rows["sink"] += 1
            if q >= 1:
                expected["previous_token"] += A[:, b, :, q, q - 1]
                rows["previous_token"] += 1
            if earlier:
                expected["duplicate_token"] += A[:, b, :, q, earlier].sum(-1)
                expected["induction"] += A[:, b, :, q, [j + 1 for j in earlier]].sum(-1)
                rows["duplicate_token"] += 1
                rows["induction"] += 1
    for score, total in expected.items():
        got = torch.tensor(result.table("layer", "head", score).values, dtype=torch.float64)
        torch.testing.assert_close(got, total / rows[score], rtol=1e-5, atol=1e-5)  # float32 weights

    _check_retrieval(model, result)


def _check_retrieval(model, result):
    """Wu et al.'s rule from eager weights: a teacher-forced pass over prompt + generated
    tokens, the argmax key of every row that produced a token."""
    needle = result.meta["prompts"]["needle"]
    steps = len(needle["answers"][0])
    retrieval = None
    for p, (a, e), gen in zip(needle["prompts"], needle["spans"], needle["generated"]):
        full = p + gen
        top = _eager(model, [full[:-1]])[:, 0, :, len(p) - 1 :].argmax(-1)  # (L, H, steps)
        L, H = top.shape[:2]
        retrieval = torch.zeros(L, H, dtype=torch.float64) if retrieval is None else retrieval
        for layer in range(L):
            for head in range(H):
                for t in range(steps):
                    k = int(top[layer, head, t])
                    if a <= k < e and full[k] == gen[t]:
                        retrieval[layer, head] += 1 / steps
    got = torch.tensor(result.table("layer", "head", "retrieval").values, dtype=torch.float64)
    torch.testing.assert_close(got, retrieval / len(needle["prompts"]), rtol=0, atol=1e-12)
    answers = [t for ans in needle["answers"] for t in ans]
    made = [t for gen in needle["generated"] for t in gen]
    assert result.meta["copy_accuracy"] == pytest.approx(sum(x == y for x, y in zip(answers, made)) / len(answers))


def test_rows_top_and_head_set(llama_run, tmp_path):
    _, _, result = llama_run
    assert set(result.metrics) == set(SCORES) | {"retrieval_se"}
    for score in SCORES:
        values = {(r["layer"], r["head"]): r["value"] for r in result.select(score)}
        assert len(values) == 12
        best = sorted(values, key=lambda k: (-values[k], k))[: PARAMS["top"]]
        assert result.meta["top"][score] == [list(k) for k in best]
    assert [f["metric"] for f in result.meta["figures"]] == list(SCORES)
    saved = save_head_set(result, tmp_path / "heads.json", "induction")
    data = json.loads((tmp_path / "heads.json").read_text())
    assert data == saved and data["heads"] == result.meta["top"]["induction"]
    assert sum(len(v) for v in data["layers"].values()) == PARAMS["top"]
    with pytest.raises(ValueError, match="score"):
        top_heads(result, "nonsense", 2)


def test_induction_export_has_an_induction_head(induction_export, tmp_path):
    """A model trained on repeated random segments ranks an induction head first with a
    high score; the same architecture with random weights scores far lower."""
    from transformers import AutoConfig, AutoModelForCausalLM

    trained = run("heads", induction_export, samples=4, scores=["induction", "retrieval"], top=2)
    (layer, head), _ = trained.meta["top"]["induction"]
    best = trained.value("induction", layer=layer, head=head)
    assert best > 0.5
    # the copy prompts drawn from the task's symbols: the retrieval rule equals eager's
    # on a model whose heads do copy (retrieval scores are not all zero)
    assert max(r["value"] for r in trained.select("retrieval")) > 0
    eager = AutoModelForCausalLM.from_pretrained(induction_export, local_files_only=True, attn_implementation="eager")
    _check_retrieval(eager.eval(), trained)

    config = AutoConfig.from_pretrained(induction_export, local_files_only=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    for name in os.listdir(induction_export):
        if "token" in name or name == "task.json":
            shutil.copy(os.path.join(induction_export, name), tmp_path / name)
    random_model = run("heads", str(tmp_path), samples=4, scores=["induction"], top=1)
    assert max(r["value"] for r in random_model.select("induction")) < best / 2


@pytest.fixture(scope="module")
def needle_format_model(tmp_path_factory):
    """A random Llama saved as an arena needle export (its tokenizer and task.json): the
    probe must write its retrieval prompts in the task's own format."""
    import transformers as T

    from attnkit.arena import make_task, task_symbols
    from attnkit.arena.export import task_record

    task = make_task("needle", seq_len=24, num_filler=6, num_keys=6, num_values=6, distractors=2)
    symbols = task_symbols(task)
    directory = tmp_path_factory.mktemp("needle-format")
    torch.manual_seed(0)
    config = T.LlamaConfig(
        vocab_size=task.vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=symbols.ids[symbols.pad],
        architectures=["LlamaForCausalLM"],
    )
    T.LlamaForCausalLM(config).save_pretrained(directory)
    build_tokenizer(symbols).save_pretrained(directory)
    (directory / "task.json").write_text(json.dumps(task_record(task, symbols)))
    return str(directory), symbols


def test_arena_needle_prompts_follow_the_task_format(needle_format_model):
    directory, symbols = needle_format_model
    result = run("heads", directory, samples=5, scores=["retrieval", "induction"], top=2)
    needle = result.meta["prompts"]["needle"]
    roles = symbols.roles
    for s, (p, (a, e), answer) in enumerate(zip(needle["prompts"], needle["spans"], needle["answers"])):
        words = symbols.decode(p).split()
        assert len(words) == 24 and words[-2] == "Q"
        key, value = words[a:e]
        assert e - a == 2 and a % 2 == 0 and a == 2 * round(s / 4 * (11 - 1))  # depths 0, .25, ... 1 over 11 cells
        assert words[-1] == key and key in roles["keys"] and value in roles["values"] and answer == [p[a + 1]]
        cells = [words[i : i + 2] for i in range(0, 22, 2)]
        pairs = [c for c in cells if c[0] in roles["keys"]]
        assert len(pairs) == 3 and all(c[1] in roles["values"] for c in pairs)  # needle + 2 distractors
        assert len({c[0] for c in pairs}) == 3 and len({c[1] for c in pairs}) == 3  # distinct keys, distinct values
        assert all(w in roles["filler"] for c in cells if c not in pairs for w in c)
    for p in result.meta["prompts"]["repeated"]:  # segments drawn from the task's symbols, never "Q"
        assert "Q" not in symbols.decode(p).split()
    assert len(needle["generated"][0]) == 1  # the answer step only
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, attn_implementation="eager")
    _check_retrieval(eager.eval(), result)
    with pytest.raises(ValueError, match="^needle: "):
        run("heads", directory, needle=3, scores=["retrieval"], top=1)
    with pytest.raises(ValueError, match="^context: "):
        run("heads", directory, context=25, scores=["retrieval"], top=1)


@pytest.mark.parametrize(
    "bad, keyword",
    [
        (dict(top=0), "top"),
        (dict(top=13), "top"),
        (dict(length=1), "length"),
        (dict(length=200), "length"),
        (dict(repeats=1), "repeats"),
        (dict(samples=0), "samples"),
        (dict(needle=1), "needle"),
        (dict(needle=96), "needle"),
        (dict(context=5), "context"),
        (dict(context=300), "context"),
        (dict(scores=["induction", "magic"]), "scores"),
        (dict(scores=[]), "scores"),
        (dict(batch_size=0), "batch_size"),
        (dict(seed="1"), "seed"),
        (dict(length=2.5), "length"),
    ],
)
def test_bad_input_names_the_keyword(bad, keyword):
    model, tok = build("llama"), word_tokenizer()
    lines = []
    with pytest.raises(ValueError, match=f"^{keyword}: "):
        run("heads", model, tok, **{**PARAMS, **bad, "progress": lines.append})
    assert lines == []  # refused before the model ran


def test_too_long_and_wrong_model():
    model, tok = build("llama"), word_tokenizer()
    with pytest.raises(ValueError, match="^length: "):  # 3 x 90 tokens > the model's 256 positions
        run("heads", model, tok, length=90, repeats=3, scores=["induction"])
    with pytest.raises(ValueError, match="^model: "):
        run("heads", build("bert"), tok)


def test_retrieval_standard_error_of_one_token_answers(needle_export):
    # A needle export answers one token, so a head's per-prompt retrieval hit is 0 or 1 and
    # the sample standard deviation of n such hits at mean p is sqrt(n p (1 - p) / (n - 1)):
    # the standard error is sqrt(p (1 - p) / (n - 1)), a formula of the mean alone.
    n = 24
    result = run("heads", needle_export, samples=n, scores=["retrieval"])
    for row in result.select("retrieval"):
        p = row["value"]
        se = result.value("retrieval_se", layer=row["layer"], head=row["head"])
        assert se == pytest.approx(math.sqrt(p * (1 - p) / (n - 1)), abs=1e-12)
