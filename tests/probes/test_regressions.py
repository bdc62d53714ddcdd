"""Regressions found by using the probes as a new user would: answers that end early
(end-of-sequence) inside a batch, default grids on models with few positions or few
heads, ``--tasks all`` as the command line passes it, and results read from a Path."""

import pathlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wordlevel import tiny_llama, word_tokenizer  # noqa: E402

from attnkit import probes  # noqa: E402
from attnkit.probes import ProbeModel, ProbeResult  # noqa: E402
from attnkit.probes.generation import greedy_generate, left_pad  # noqa: E402
from attnkit.probes.meters import RowSpanMass  # noqa: E402

TOK = word_tokenizer(eos=True)


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(len(TOK))


class _Tok:
    pad_token_id = 0

    def __init__(self, eos):
        self.eos_token_id = eos

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _stop_token(tokens: torch.Tensor) -> int:
    """A token that some row generates early and another row never generates, so the rows
    of one batch end at different steps."""
    rows = tokens.tolist()
    for row in rows:
        for t in row[:2]:
            if any(t not in other for other in rows):
                return t
    raise AssertionError(f"no token ends one row early and another never: {rows}")


def test_a_row_that_ends_early_is_measured_on_its_own_answer_rows(tiny):
    """Eager reference: each row's mass is the mean over its own answer rows only (the last
    prompt row and the rows decoding its tokens before its end-of-sequence token), not
    the rows its batch keeps decoding after it stopped."""
    prompts = [[5, 17, 33, 2, 9, 41, 8, 12, 70], [30, 31, 32, 33, 34, 35, 36], [11, 12, 13, 14, 15, 16, 17]]
    batch = left_pad(prompts, 0)
    free = greedy_generate(tiny, _Tok(None), batch, 6)
    eos = _stop_token(free.tokens)
    steps = [row.index(eos) + 1 if eos in row else 6 for row in free.tokens.tolist()]
    assert len(set(steps)) > 1  # the rows really end at different steps
    spans = [(batch.pads[b] + 1, batch.pads[b] + 4) for b in range(3)]
    meter = RowSpanMass({"s": spans}, q_lo=batch.length - 1)
    gen = greedy_generate(tiny, _Tok(eos), batch, 6, observers=[meter])
    assert gen.steps == steps
    for b, prompt in enumerate(prompts):  # unpadded, alone, teacher-forced over its own answer
        answer = free.tokens[b, : steps[b] - 1].tolist()
        with torch.no_grad():
            out = tiny(input_ids=torch.tensor([prompt + answer]), output_attentions=True)
        a, e = spans[b][0] - batch.pads[b], spans[b][1] - batch.pads[b]
        expected = torch.stack([w[0, :, len(prompt) - 1 :, a:e].double().sum(-1).mean(-1) for w in out.attentions])
        torch.testing.assert_close(meter.per_example("s")[b], expected, rtol=1e-4, atol=1e-5)


def test_needle_masses_do_not_depend_on_the_batch_when_answers_end_early(tiny):
    """Prompts of near-equal lengths share a batch; with an end-of-sequence token some
    answers stop at once while others go on: batch_size 1 and 8 give the same rows."""
    pm = ProbeModel(tiny, TOK, "causal", 512, None, "tiny")
    kwargs = dict(lengths=[96, 100], depths=[0.0, 0.5, 1.0], samples=2, seed=1)
    # which token ends some answers early: read off a run in which nothing ends them
    free = ProbeModel(tiny, word_tokenizer(), "causal", 512, None, "tiny")
    outputs = [e["output"].split() for e in probes.run("needle", free, batch_size=1, **kwargs).meta["examples"]]
    stop = next((w for out in outputs for w in out[:3] if any(w not in o for o in outputs)), None)
    assert stop is not None, outputs
    TOK.eos_token = stop
    try:
        one = probes.run("needle", pm, batch_size=1, **kwargs)
        many = probes.run("needle", pm, batch_size=8, **kwargs)
    finally:
        TOK.eos_token = "<eos>"
    assert [e["output"] for e in one.meta["examples"]] == [e["output"] for e in many.meta["examples"]]
    words = {len(e["output"].split()) for e in one.meta["examples"]}
    assert len(words) > 1 and min(words) < 3  # some answers did end early, others did not
    assert [{k: v for k, v in r.items() if k != "value"} for r in one.rows] == [
        {k: v for k, v in r.items() if k != "value"} for r in many.rows
    ]
    for a, b in zip(one.rows, many.rows):
        assert a["value"] == pytest.approx(b["value"], rel=1e-5, abs=1e-6), a


@pytest.mark.parametrize("positions", [256, 1024])
def test_needle_default_lengths_fit_the_answer_inside_the_models_positions(tiny, positions):
    """GPT-2 has 1024 positions, Llama-2 4096: the default grid must run on them, its
    longest prompt leaving room for the answer's rows."""
    pm = ProbeModel(tiny, word_tokenizer(), "causal", positions, None, "tiny")
    result = probes.run("needle", pm, depths=[0.5], max_new_tokens=3 if positions == 1024 else None)
    lengths = result.meta["params"]["lengths"]
    new = result.meta["max_new_tokens"]
    assert max(lengths) + new - 1 == positions
    assert len(result.select("accuracy")) == len(lengths)


def test_heads_default_top_fits_a_model_with_fewer_than_five_heads():
    import transformers as T

    from attnkit.arena.tokenizer import Symbols, build_tokenizer

    config = T.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(config).eval()
    tokenizer = build_tokenizer(Symbols(tuple(f"w{i}" for i in range(32)), {}, "w0"))
    result = probes.run("heads", model, tokenizer, length=4, samples=1, needle=3, context=12, scores=["sink"])
    assert result.meta["params"]["top"] == 4 and len(result.meta["top"]["sink"]) == 4
    with pytest.raises(ValueError, match="^top: "):
        probes.run("heads", model, tokenizer, length=4, samples=1, scores=["sink"], top=5)


def test_ruler_tasks_all_as_the_command_line_passes_it():
    from attnkit.probes.ruler import _check_tasks
    from attnkit.probes.ruler_tasks import ALL

    assert _check_tasks(["all"]) == tuple(ALL) == _check_tasks("all")
    with pytest.raises(ValueError, match="^tasks: "):
        _check_tasks(["all", "vt"])


def test_result_reads_back_from_a_path_object(tmp_path):
    result = ProbeResult("demo")
    result.add("accuracy", 0.5, length=8)
    path = tmp_path / "results.json"
    result.to_json(path)
    assert isinstance(path, pathlib.Path)
    assert ProbeResult.from_json(path).rows == result.rows == ProbeResult.from_json(str(path)).rows


def test_an_arena_answer_of_the_pad_symbol_is_shown_not_dropped(needle_export):
    """An arena export's pad is its filler symbol f0: a model answering f0 must read "f0"
    in meta["examples"], not "" (skip_special_tokens would drop it)."""
    from attnkit.probes import load_probe_model

    pm = load_probe_model(needle_export)
    pad = pm.tokenizer.pad_token
    pad_id = pm.tokenizer.pad_token_id

    def answer_pad(module, args, logits):  # every answer is the pad symbol
        logits = logits.clone()
        logits[..., pad_id] = logits.max() + 10.0
        return logits

    hook = pm.model.get_output_embeddings().register_forward_hook(answer_pad)
    try:
        result = probes.run("needle", pm, lengths=[32], depths=[0.5])
    finally:
        hook.remove()
    assert [e["output"] for e in result.meta["examples"]] == [pad]
    assert result.value("accuracy", length=32, depth=0.5) == 0.0
