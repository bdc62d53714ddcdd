"""The kv benchmark suite runs and its rows carry what the caches really hold (no
timing is asserted: only the wiring of rows, targets and byte counts)."""

import pytest

from attnkit.bench import SUITES, kv


def test_kv_suite_rows_at_a_small_size():
    assert "kv" in SUITES
    n = 64
    model = kv.tiny_llama(n)
    rows = kv.measure("knorm", {}, n, repeats=1, decode_steps=2, decode_repeats=1, model=model)
    held, decode, prefill = rows
    # 4 layers x (keys + values) x 2 KV heads x 32 dims x 4 bytes (float32) per prompt token
    per_token = 4 * 2 * 2 * 32 * 4
    assert held.extra["full_bytes"] == per_token * n
    # key norm keeps floor(budget * n) entries in every head after the prefill
    assert held.extra["policy_bytes"] == {"0.1": per_token * 6, "0.25": per_token * 16, "0.5": per_token * 32}
    assert held.ok is None and held.attnkit_ms is None
    assert decode.target == ">= 1.5x tokens/s" and decode.attnkit_ms > 0 and decode.baseline_ms > 0
    assert decode.ok == (decode.baseline_ms / decode.attnkit_ms >= 1.5)
    assert prefill.target == "<= 1.2x" and prefill.ok == (prefill.attnkit_ms / prefill.baseline_ms <= 1.2)
    assert "DynamicCache" in prefill.baseline and "sdpa" in prefill.baseline


def test_quest_holds_every_entry_in_the_bench():
    n = 64
    rows = kv.measure("quest", {}, n, repeats=1, decode_steps=1, decode_repeats=1, model=kv.tiny_llama(n))
    assert set(rows[0].extra["policy_bytes"].values()) == {rows[0].extra["full_bytes"]}  # Quest evicts nothing


def test_wide_subject_decode_rows(monkeypatch):
    """The second subject (8 KV heads of 64 dimensions) gives one decode row per policy,
    each against the full cache of the same prefill."""
    monkeypatch.setattr(kv, "POLICIES", (("streaming", {}), ("knorm", {})))
    rows = kv.wide_decode_rows(48, decode_steps=2, decode_repeats=1)
    assert [r.case.split()[0] for r in rows] == ["streaming", "knorm"]
    for r in rows:
        assert "8 KV heads of 64" in r.case and r.attnkit_ms > 0 and r.baseline_ms > 0
        assert r.ok == (r.baseline_ms / r.attnkit_ms >= 1.5)
    model = kv.tiny_llama(48, **kv.WIDE)
    assert (model.config.num_key_value_heads, model.config.head_dim, model.config.hidden_size) == (8, 64, 512)


def test_floor_row_times_a_cache_of_the_budgets_size():
    """The floor row decodes on a DynamicCache that holds a quarter of the prompt (no
    policy) against the full one, and reports (no target) the speed-up."""
    from transformers import DynamicCache

    n = 64
    made = []
    original = DynamicCache.__init__

    def tracked(self, *a, **k):
        original(self, *a, **k)
        made.append(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DynamicCache, "__init__", tracked)
        (row,) = kv.floor_row(n, decode_steps=2, decode_repeats=1, model=kv.tiny_llama(n))
    assert row.target == "report" and row.ok is None and row.attnkit_ms > 0 and row.baseline_ms > 0
    short, full = made
    # the prefill, then the warm-up and timed blocks of 2 steps each
    assert full.get_seq_length() - n == short.get_seq_length() - n // 4 > 0
    assert row.extra["speedup"] == row.baseline_ms / row.attnkit_ms
