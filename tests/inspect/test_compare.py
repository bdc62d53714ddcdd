"""compare(): per-head change and KL of distance profiles."""

import math

import pytest
import torch

from attnkit.inspection import AttentionProfile, compare, kl_divergence


def profile(bins_by_head, extra=0.0):
    rows = []
    for head, masses in enumerate(bins_by_head):
        for label, m in masses.items():
            rows.append((0, head, f"distance.{label}", m))
        rows.append((0, head, "entropy.norm", 0.5 + head + extra))
    return AttentionProfile(rows)


def test_kl_against_the_literal_formula():
    p = {"0": 0.5, "1": 0.3, "2-3": 0.2}
    q = {"0": 0.2, "1": 0.2, "2-3": 0.6}
    a, b = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    want = float((a * (a / b).log()).sum())
    assert kl_divergence(p, q, epsilon=1e-12) == pytest.approx(want, rel=1e-9)
    assert kl_divergence(p, p) == pytest.approx(0.0, abs=1e-12)
    # a bin empty in q: finite (floored), and large
    assert 5 < kl_divergence({"0": 1.0}, {"1": 1.0}) < math.inf


def test_compare_reports_changes_and_drift():
    before = profile([{"0": 0.5, "1": 0.5}, {"0": 0.9, "1": 0.1}])
    after = profile([{"0": 0.5, "1": 0.5}, {"0": 0.1, "1": 0.9}], extra=0.25)
    cmp = compare(before, after)
    changes = {(lay, h, m): c for lay, h, m, _, _, c in cmp.rows}
    assert changes[(0, 0, "entropy.norm")] == pytest.approx(0.25)
    assert changes[(0, 1, "distance.0")] == pytest.approx(-0.8)
    assert cmp.drift[(0, 0)] == pytest.approx(0.0, abs=1e-9)
    assert cmp.drift[(0, 1)] == pytest.approx(0.9 * math.log(9) + 0.1 * math.log(1 / 9), rel=1e-6)
    assert cmp.largest("distance.0", 1)[0][:2] == (0, 1)
    assert "distance.kl" in cmp.to_csv() and before.compare(after).drift == cmp.drift


def test_compare_refuses_unrelated_inputs():
    with pytest.raises(ValueError, match="before"):
        compare("x", profile([{"0": 1.0}]))
    with pytest.raises(ValueError, match="share no"):
        compare(profile([{"0": 1.0}]), AttentionProfile([(5, 5, "other", 1.0)]))
