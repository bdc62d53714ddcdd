"""The KV evaluation protocols (attnkit.kv.protocol): the question asked through the cache
after the context. Held to plain greedy decoding on the full cache, to each policy's
budget-1.0 identity, and to what each protocol lets the policy see."""

import pytest
import torch

from attnkit.kv.protocol import FULL, KVSetting, ask
from attnkit.probes.generation import greedy_generate, left_pad
from attnkit.probes.model import load_probe_model
from attnkit.probes.needle import arena_items


@pytest.fixture(scope="module")
def needle(needle_export):
    pm = load_probe_model(needle_export)
    items = arena_items(pm, [32], [0.0, 0.5, 1.0], 4, 0)
    return pm, items, left_pad([it.ids for it in items], 0)


def test_the_full_cache_answers_as_plain_greedy_decoding(needle):
    pm, items, batch = needle
    plain = greedy_generate(pm.model, pm.tokenizer, batch, 2, stop_at_eos=False).tokens
    for protocol in ("agnostic", "aware"):
        answer = ask(pm.model, batch.input_ids, batch.attention_mask, 2, KVSetting(FULL, protocol=protocol), 2)
        if protocol == "agnostic":  # the same sequence fed, the question one token at a time
            assert torch.equal(answer.tokens, plain)
        assert answer.kept == 1.0 and answer.decode_steps == 3  # two question tokens and one more answer step
    full_bytes = ask(pm.model, batch.input_ids, batch.attention_mask, 2, KVSetting(FULL), 1).kv_bytes
    layers, heads, dim = 2, pm.model.config.num_key_value_heads, pm.model.config.head_dim
    assert full_bytes == 2 * layers * batch.input_ids.shape[0] * heads * batch.input_ids.shape[1] * dim * 4


@pytest.mark.parametrize("policy", ["snapkv", "adakv", "knorm", "quest", "pyramid"])
def test_a_policy_keeping_everything_answers_as_the_full_cache(needle, policy):
    pm, items, batch = needle
    full = ask(pm.model, batch.input_ids, batch.attention_mask, 2, KVSetting(FULL), 1)
    kept = ask(pm.model, batch.input_ids, batch.attention_mask, 2, KVSetting(policy, 1.0), 1)
    assert torch.equal(kept.tokens, full.tokens)


def test_only_the_aware_protocol_lets_the_policy_see_the_question(needle):
    # SnapKV votes with its last `window` prompt rows: question-aware those rows are the
    # question, so asking another key changes what layer 1 keeps; question-agnostic they
    # are context, and the kept sets cannot depend on the key asked
    pm, items, batch = needle
    other = batch.input_ids.clone()
    other[:, -1] = batch.input_ids[:, -1].roll(1)  # another row's key asked
    kept = {}
    for protocol in ("agnostic", "aware"):
        for name, ids in (("asked", batch.input_ids), ("other", other)):
            answer = ask(pm.model, ids, batch.attention_mask, 2, KVSetting("snapkv", 4, (("window", 2),), protocol), 1)
            positions = answer.cache.kept_positions(1)
            kept[protocol, name] = [[[p for p in head if p < ids.shape[1] - 2] for head in row] for row in positions]
    assert kept["agnostic", "asked"] == kept["agnostic", "other"]
    assert kept["aware", "asked"] != kept["aware", "other"]


def test_settings_parse_and_refuse_with_the_argument_named():
    s = KVSetting.parse("snapkv:budget=0.25:protocol=aware:window=8")
    assert (s.policy, s.budget, s.params, s.protocol) == ("snapkv", 0.25, (("window", 8),), "aware")
    assert KVSetting.parse("streaming:budget=64").budget == 64  # an int is a token count
    for text, message in [
        ("nope", "policy: unknown policy 'nope'"),
        ("snapkv:budget=2.5", "budget:"),
        ("snapkv:protocol=both", "protocol: expected one of agnostic, aware"),
        ("snapkv:windw=8", "windw: not a parameter"),
        ("snapkv:8", "kv: expected NAME=VALUE"),
        ("full:window=3", "window: the full cache takes no parameters"),
        ("selective:budget=0.5", "policy: 'selective' needs a model trained"),
    ]:
        with pytest.raises(ValueError, match=message):
            KVSetting.parse(text)


def test_bad_question_lengths_are_refused(needle):
    pm, items, batch = needle
    for question in (0, batch.input_ids.shape[1], True):
        with pytest.raises(ValueError, match="^question: expected an int"):
            ask(pm.model, batch.input_ids, batch.attention_mask, question, KVSetting(FULL), 1)
