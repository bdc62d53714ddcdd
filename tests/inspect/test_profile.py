"""AttentionProfile: tidy rows, tables, CSV and JSON."""

import csv
import io
import math

import pytest
import torch

from attnkit.inspection import AttentionProfile


def small_profile():
    rows = [
        (layer, head, metric, float(layer * 10 + head + i / 4))
        for layer in range(2)
        for head in range(3)
        for i, metric in enumerate(("sink.score", "entropy.norm"))
    ]
    rows.append((2, 0, "entropy.norm", 0.5))  # layer 2 measured on head 0 only
    arrays = {
        "top_keys": {
            (0, 1): {"q_start": 0, "index": torch.tensor([[[0, -1]]], dtype=torch.int32), "weight": torch.tensor([[[1.0, 0.0]]])}
        }
    }
    return AttentionProfile(rows, ["a", "<b>", "c"], {"model": "m", "tokens": 3}, arrays)


def test_rows_read_back_by_value_and_table():
    p = small_profile()
    assert p.metrics == ["sink.score", "entropy.norm"]
    assert p.layers == [0, 1, 2] and (2, 0) in p.heads and (2, 1) not in p.heads
    assert p.value(1, 2, "entropy.norm") == 12.25
    t = p.table("entropy.norm")
    assert t.shape == (3, 3) and t[1, 2] == 12.25 and t[2, 0] == 0.5
    assert math.isnan(t[2, 1]) and math.isnan(t[2, 2])  # not measured
    with pytest.raises(ValueError, match="metric"):
        p.table("nope")
    with pytest.raises(KeyError, match="nope"):
        p.value(0, 0, "nope")


def test_csv_is_tidy_and_exact():
    p = small_profile()
    parsed = list(csv.reader(io.StringIO(p.to_csv())))
    assert parsed[0] == ["layer", "head", "metric", "value"]
    assert [(int(a), int(b), c, float(d)) for a, b, c, d in parsed[1:]] == p.rows


def test_json_round_trip_keeps_everything(tmp_path):
    p = small_profile()
    path = tmp_path / "p.json"
    p.to_json(str(path))
    q = AttentionProfile.from_json(path.read_text())
    assert q.rows == p.rows and q.tokens == p.tokens and q.meta == p.meta
    assert torch.equal(q.arrays["top_keys"][(0, 1)]["index"], p.arrays["top_keys"][(0, 1)]["index"].long())
    with pytest.raises(ValueError, match="AttentionProfile"):
        AttentionProfile.from_json('{"rows": []}')
