"""attnkit.hf.use under the decoding contract (tests/mechanisms/decoding_contract.py), for
every registered mechanism on a tiny random float64 Llama:

- a prefix call, the full call, token-by-token decoding with the model's cache, and
  ``generate`` with and without ``use_cache`` give the same logits;
- mechanisms that cannot decode refuse the cache with a ValueError saying why;
- padding that holds NaN or inf (the embeddings of pad tokens replaced by a hook) never
  reaches the outputs: a padded batch gives the logits of its rows run alone, left and
  right padded, in a forward pass and in ``generate``. Mechanisms that cannot honour a
  kind of padding refuse it with a ValueError.

float64 model, TOL[float64]."""

import os
import sys

import pytest
import torch
from tiny_models import VOCAB, build

import attnkit.hf as akhf
from attnkit.mechanisms import available
from helpers import assert_close

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "mechanisms"))
import decoding_contract as dc  # noqa: E402

N = 12
PAD = 3
#: padding each mechanism refuses, and the words of its error
REFUSED_PADDING = {"nsa": {"left"}, "block_sparse": {"left", "right"}, "hyper_attention": {"left", "right"}}


@pytest.fixture(scope="module")
def llama():
    model = build("llama").double()
    poison = {}

    def nan_padding(module, args, out):
        # Pad slots hold NaN or inf, as an untrained pad embedding might.
        keep = poison.get("keep")
        if keep is None or out.shape[1] != keep.shape[1]:
            return out
        bad = torch.tensor([float("nan"), float("inf")], dtype=out.dtype)[torch.arange(out.shape[-1]) % 2]
        return torch.where(keep[..., None], out, bad)

    model.model.embed_tokens.register_forward_hook(nan_padding)
    model.poison = poison
    return model


@pytest.fixture(scope="module")
def ids():
    return torch.randint(1, VOCAB, (2, N), generator=torch.Generator().manual_seed(3))


def params(name):
    return dict(dc.PARAMS.get(name, {}))


def step_by_step(model, ids, prefill=5):
    out = model(ids[:, :prefill], use_cache=True)
    cache, logits = out.past_key_values, [out.logits]
    for t in range(prefill, ids.shape[1]):
        out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits.append(out.logits)
    return torch.cat(logits, dim=1)


def generated_logits(model, ids, use_cache, attention_mask=None):
    out = model.generate(
        ids,
        attention_mask=attention_mask,
        max_new_tokens=4,
        do_sample=False,
        use_cache=use_cache,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences, torch.stack(out.logits, dim=1)


@pytest.mark.parametrize("name", sorted(set(available()) - dc.NO_CACHE))
def test_prefix_full_cached_and_generate_agree(llama, ids, name):
    with torch.no_grad(), akhf.use(llama, mechanism=name, **params(name)):
        full = llama(ids).logits
        assert_close(llama(ids[:, :7]).logits, full[:, :7], msg=f"{name}: prefix call")
        assert_close(step_by_step(llama, ids), full, msg=f"{name}: cached decoding")
        seq_cached, cached = generated_logits(llama, ids[:, :6], use_cache=True)
        seq_full, recomputed = generated_logits(llama, ids[:, :6], use_cache=False)
    assert torch.equal(seq_cached, seq_full)
    assert_close(cached, recomputed, msg=f"{name}: generate with and without the cache")


@pytest.mark.parametrize("name", sorted(dc.NO_CACHE))
def test_mechanisms_that_cannot_decode_refuse_the_cache(llama, ids, name):
    with torch.no_grad(), akhf.use(llama, mechanism=name, **params(name)):
        with pytest.raises(ValueError, match=f"mechanism: '{name}' cannot decode against a KV cache"):
            generated_logits(llama, ids[:, :6], use_cache=True)
        seq, _ = generated_logits(llama, ids[:, :6], use_cache=False)
    assert seq.shape == (2, 10)


def padded(ids, side):
    """Row 1 shortened by PAD tokens and padded on ``side``; (ids, attention_mask, position_ids)."""
    out = ids.clone()
    mask = torch.ones_like(ids)
    if side == "left":
        out[1, PAD:], out[1, :PAD], mask[1, :PAD] = ids[1, : N - PAD], 0, 0
    else:
        out[1, N - PAD :], mask[1, N - PAD :] = 0, 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    return out, mask, positions


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", available())
def test_nan_in_padding_never_reaches_the_outputs(llama, ids, name, side):
    batch, mask, positions = padded(ids, side)
    real = mask[1].bool()
    with torch.no_grad(), akhf.use(llama, mechanism=name, **params(name)):
        llama.poison["keep"] = mask.bool()
        try:
            if side in REFUSED_PADDING.get(name, ()):
                with pytest.raises(ValueError, match="cannot take this padding"):
                    llama(batch, attention_mask=mask, position_ids=positions)
                return
            got = llama(batch, attention_mask=mask, position_ids=positions).logits
        finally:
            llama.poison.clear()
        alone = llama(ids[1:, : N - PAD]).logits[0]
        first = llama(ids[:1]).logits[0]
    assert_close(got[1, real], alone, msg=f"{name}: padded row")
    assert_close(got[0], first, msg=f"{name}: unpadded row of a padded batch")


@pytest.mark.parametrize("name", sorted(set(available()) - dc.NO_CACHE - {"nsa"}))
def test_generate_on_a_left_padded_batch_with_nan_padding(llama, ids, name):
    prompt, mask = _left_prompt(ids)
    with torch.no_grad(), akhf.use(llama, mechanism=name, **params(name)):
        llama.poison["keep"] = mask.bool()
        try:
            seq, logits = generated_logits(llama, prompt, use_cache=True, attention_mask=mask)
        finally:
            llama.poison.clear()
        seq_alone, logits_alone = generated_logits(llama, prompt[1:, PAD:], use_cache=True)
    assert torch.equal(seq[1, prompt.shape[1] :], seq_alone[0, prompt.shape[1] - PAD :])
    assert_close(logits[1], logits_alone[0], msg=f"{name}: generate on a padded row")


def _left_prompt(ids):
    """An 8-token prompt batch whose row 1 holds 5 tokens after PAD pad tokens."""
    prompt = ids[:, :8].clone()
    mask = torch.ones_like(prompt)
    prompt[1, PAD:], prompt[1, :PAD], mask[1, :PAD] = ids[1, : 8 - PAD], 0, 0
    return prompt, mask


def test_context_comes_from_max_position_embeddings_unless_given(llama, ids):
    import math

    with torch.no_grad():
        with akhf.use(llama, mechanism="sigmoid") as switch:
            llama(ids)
        assert {m.context for m in switch.mechanisms.values()} == {256}
        assert switch.mechanisms[0].bias == -math.log(256)
        with akhf.use(llama, mechanism="sigmoid", context=10) as switch:
            llama(ids)
        assert switch.mechanisms[0].bias == -math.log(10)
        with akhf.use(llama, mechanism="cosformer") as switch:
            llama(ids)
        assert switch.mechanisms[0].feature_map.max_len == 256


def test_neighborhood_without_a_bias_table_builds_from_the_layer():
    """hf.use passes the layer's head count only to a neighbourhood with a bias table."""
    with torch.no_grad():
        model = build("llama").double()
        x = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
        with akhf.use(model, mechanism="neighborhood", kernel=3, causal=True) as switch:
            got = model(x).logits
        assert switch.mechanisms[0].rpb is None and bool(torch.isfinite(got).all())
        with pytest.raises(ValueError, match="build it with causal=True"):
            with akhf.use(model, mechanism="neighborhood", kernel=3):
                model(x)
        bert = build("bert")
        with akhf.use(bert, mechanism="neighborhood", kernel=3):  # bidirectional: no causal mask
            assert bool(torch.isfinite(bert(x).last_hidden_state).all())


@pytest.mark.parametrize("name", ["selective", "multi_token"])
def test_state_of_earlier_queries_must_come_from_the_same_switch(llama, ids, name):
    with torch.no_grad():
        cache = llama(ids[:, :6], use_cache=True).past_key_values  # filled by the model's own attention
        with akhf.use(llama, mechanism=name), pytest.raises(ValueError, match="inside the same attnkit.hf.use block"):
            llama(ids[:, 6:7], past_key_values=cache, use_cache=True)
