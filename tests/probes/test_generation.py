"""Greedy generation through attnkit, and the per-example meters, against transformers'
own eager model (generate, output_attentions) on tiny random models."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf"))
from tiny_models import build  # noqa: E402

from attnkit.probes.generation import greedy_generate, left_pad
from attnkit.probes.meters import RowSpanMass, StepTopKey


class _Tok:
    """The least a probe needs of a tokenizer: ids in, text out."""

    pad_token_id = 0
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


PROMPTS = [[5, 17, 33, 2, 9, 41, 8, 12, 70], [3, 4, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17]]


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_greedy_tokens_equal_transformers_generate(name):
    model = build(name)
    ours = greedy_generate(model, _Tok(), PROMPTS, 6)
    for b, prompt in enumerate(PROMPTS):  # unpadded, one at a time: no padding to get wrong
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert ours.tokens[b].tolist() == ref[0, len(prompt) :].tolist()


def _eager_answer_rows(model, prompts, tokens):
    """Eager attention weights (L, B, H, rows, keys) of the rows that produce the answer,
    from one full teacher-forced forward of prompt + generated tokens."""
    full = torch.cat([prompts.input_ids, tokens[:, :-1]], dim=1)
    mask = torch.cat([prompts.attention_mask, torch.ones_like(tokens[:, :-1])], dim=1)
    out = model(input_ids=full, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0), output_attentions=True)
    return torch.stack(out.attentions)[:, :, :, prompts.length - 1 :].double()


def test_row_span_mass_and_top_keys_equal_eager_weights():
    model = build("llama")
    prompts = left_pad(PROMPTS, 0)
    spans = [(prompts.pads[b] + 1, prompts.pads[b] + 4) for b in range(3)]
    mass, top = RowSpanMass({"s": spans}, q_lo=prompts.length - 1), StepTopKey(q_lo=prompts.length - 1)
    gen = greedy_generate(model, _Tok(), prompts, 5, observers=[mass, top])
    with torch.no_grad():
        weights = _eager_answer_rows(model, prompts, gen.tokens)
    expected = torch.stack([weights[:, b, :, :, a:e].sum(-1).mean(-1) for b, (a, e) in enumerate(spans)])
    torch.testing.assert_close(mass.per_example("s"), expected, rtol=1e-4, atol=1e-5)  # float32 weights
    for layer in range(weights.shape[0]):
        assert torch.equal(top.top_keys(layer), weights[layer].argmax(-1))
