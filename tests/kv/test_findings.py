"""What the KV-cache policies do to a model that retrieves: findings measured on the
shipped needle-1k organism (docs/kv.md, "Findings on the organisms"), rerun here on the
same seeded prompts with fewer samples.

Thresholds come from the measured rates and the binomial spread of n prompts: a rate
measured at p on 20 prompts per cell has a standard deviation of sqrt(p(1-p)/20), at
most 0.11; each bound below sits at least 3 such deviations from the rate measured on
the docs' 20 samples (and further from the rate of the other side of the finding)."""

import warnings

import pytest

from attnkit.kv.protocol import KVSetting, ask
from attnkit.probes.generation import left_pad
from attnkit.probes.model import load_probe_model
from attnkit.probes.needle import arena_items
from attnkit.probes.retrieval import run_items

pytestmark = pytest.mark.slow
SAMPLES = 20


@pytest.fixture(scope="module")
def needle_1k():
    return load_probe_model("needle-1k")


def accuracy(pm, depth: float, setting: KVSetting) -> float:
    items = arena_items(pm, [1024], [depth], SAMPLES, 0)
    outcomes, _ = run_items(pm, items, 1, SAMPLES, lambda line: None, "findings", kv=setting)
    return sum(o.score for o in outcomes) / len(outcomes)


def test_streaming_loses_the_middle_where_snapkv_keeps_it(needle_1k):
    # measured (docs): at 25%, question-agnostic, depth 0.5: StreamingLLM 0.10, SnapKV 1.00, the full cache 1.00
    full = accuracy(needle_1k, 0.5, KVSetting("full", 1.0))
    streaming = accuracy(needle_1k, 0.5, KVSetting("streaming", 0.25))
    snapkv = accuracy(needle_1k, 0.5, KVSetting("snapkv", 0.25))
    assert full >= 0.85
    assert streaming <= 0.45  # 0.10 + 3 x 0.11 (p = 0.1: sd 0.07)
    assert snapkv >= 0.75


def test_streaming_keeps_the_ends(needle_1k):
    # its sinks hold depth 0, its recent window depth 1 (measured: 1.00 and 1.00 at 25%)
    for depth in (0.0, 1.0):
        assert accuracy(needle_1k, depth, KVSetting("streaming", 0.25)) >= 0.8


def test_tova_needs_the_question_in_its_scoring_row(needle_1k):
    # TOVA ranks the prefill's entries by the last prompt row's attention alone. Asked
    # question-agnostic, that row is the needle's own value token at depth 1, whose layer-1
    # heads look elsewhere: the needle's value entry survived the prefill in layer 1 in 8 of
    # 20 prompts, and 0.40 were answered; question-aware, the row is the asked key,
    # whose retrieval heads look at the needle (measured 1.00).
    agnostic = accuracy(needle_1k, 1.0, KVSetting("tova", 0.25, protocol="agnostic"))
    aware = accuracy(needle_1k, 1.0, KVSetting("tova", 0.25, protocol="aware"))
    assert agnostic <= 0.75
    assert aware >= 0.85
    assert aware - agnostic >= 0.25


def test_pyramid_warns_when_its_schedule_starves_the_last_layer(needle_1k):
    items = arena_items(needle_1k, [1024], [0.5], 2, 0)
    batch = left_pad([it.ids for it in items], 0)
    with pytest.warns(UserWarning, match=r"pyramid: with 2 layers and beta=20, layer 1 keeps 13 entries"):
        ask(needle_1k.model, batch.input_ids, batch.attention_mask, 2, KVSetting("pyramid", 0.25), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # beta=2 gives the last layer 64 entries, above the 32-row window
        ask(needle_1k.model, batch.input_ids, batch.attention_mask, 2, KVSetting("pyramid", 0.25, (("beta", 2),)), 1)
