"""The benchmark harness: memory probes see what a call allocates, tables and steps are
faithful. No timing is asserted (the machine is shared)."""

import json

import pytest

from attnkit.bench import SUITES, format_table, suite_module, write_json
from attnkit.bench.harness import Row, peak_rss_growth, run_steps, time_pair


def test_peak_rss_growth_sees_the_body_and_not_the_setup():
    # The set-up touches 400 MB and frees it: the allocator may keep those pages, and a
    # probe that compared against the process's all-time peak would report 0 for a body
    # that touches 256 MB (what the old ru_maxrss probe did at N=65536).
    setup = "x = torch.ones(100 * 2**20); del x"
    res = peak_rss_growth(setup, "y = torch.ones(64 * 2**20)")
    assert "error" not in res, res
    assert 240 <= res["growth_mb"] <= 400, res
    assert res["peak_mb"] >= res["growth_mb"]


def test_peak_rss_growth_reports_the_error_of_a_failing_body():
    res = peak_rss_growth("", "raise ValueError('nope')")
    assert res == {"error": "ValueError: nope"}


def test_time_pair_runs_both_alternately_after_the_warmup():
    calls = []
    cand, base = time_pair(lambda: calls.append("c"), lambda: calls.append("b"), repeats=3, warmup=1)
    assert calls == ["c", "b"] * 4
    assert cand >= 0 and base >= 0
    assert time_pair(lambda: None, None, repeats=2)[1] is None


def test_table_json_and_steps(tmp_path):
    rows = [
        Row("s", "case a", "N=1", 2.0, "sdpa", 4.0, "<= 1x", True, "note"),
        Row("s", "memory", "N=2", None, "-", None, "<= 1 MB", False),
    ]
    assert rows[0].ratio == 0.5 and rows[1].ratio is None
    table = format_table(rows)
    assert "0.50" in table and "yes  (note)" in table and "NO" in table
    write_json(rows, tmp_path / "rows.json", {"torch": "x"})
    data = json.loads((tmp_path / "rows.json").read_text())
    assert data["meta"] == {"torch": "x"} and data["rows"][0]["ratio"] == 0.5
    seen = []
    out = run_steps([("one", lambda: [1]), ("two", lambda: [2, 3])], seen.append)
    assert out == [1, 2, 3] and seen == ["one", "two"]


def test_every_suite_is_importable_and_unknown_ones_are_refused():
    for name in SUITES:
        module = suite_module(name)
        assert callable(module.run) and module.STEPS >= 1
    with pytest.raises(ValueError, match="suite: expected one of"):
        suite_module("nope")
