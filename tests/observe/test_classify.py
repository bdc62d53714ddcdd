"""The head classifier on heads built to have one behaviour each."""

import pytest
import torch
from test_other_mechanisms import tiles_of

from attnkit.observe import CallInfo, DistanceProfile, Entropy, SinkMass, SpanMass, classify_heads, feed

N = 300


def constructed_heads():
    """(1, 6, N, N) causal attention rows: sink, previous-token, local, broad, span, mixed."""
    w = torch.zeros(6, N, N, dtype=torch.float64)
    for i in range(N):
        uniform = torch.full((i + 1,), 1.0 / (i + 1), dtype=torch.float64)
        w[0, i, : i + 1] = 0.2 * uniform
        w[0, i, 0] += 0.8  # sink: 0.8 on key 0
        w[1, i, max(i - 1, 0)] = 1.0  # previous token (row 0: itself)
        lo = max(i - 4, 0)
        w[2, i, lo : i + 1] = 1.0 / (i + 1 - lo)  # local: the last 5 keys
        w[3, i, : i + 1] = uniform  # broad
        if i >= 30:  # span-focused: 0.7 on keys 20..29, the rest spread
            w[4, i, : i + 1] = 0.3 / (i + 1)
            w[4, i, 20:30] += 0.07
        else:
            w[4, i, : i + 1] = uniform
        if i >= 16:  # mixed: keys 16..31 back, neither local, nor broad, nor a sink
            w[5, i, i - 31 if i >= 31 else 0 : i - 15] = 1.0 / len(range(i - 31 if i >= 31 else 0, i - 15))
        else:
            w[5, i, : i + 1] = uniform
    return w.unsqueeze(0)


def test_each_constructed_head_gets_its_label():
    w = constructed_heads()
    assert torch.allclose(w.sum(-1), torch.ones(1, 6, N, dtype=torch.float64))
    call = CallInfo(1, 6, N, N, 0, layer=0, mechanism="softmax")
    meters = [SinkMass(), Entropy(), DistanceProfile(), SpanMass({"doc": (20, 30)}, queries=(30, None))]
    # logits of these rows: log w on the causal triangle (a finite floor where w = 0: the
    # key is visible, only unattended), -inf above it
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    scores = torch.where(causal, torch.log(w.clamp_min(1e-30)), float("-inf"))
    feed(meters, call, tiles_of(w, call, 64, 64, scores))
    classes = classify_heads([r for m in meters for r in m.rows()])
    labels = {h: classes[(0, h)].label for h in range(6)}
    assert labels == {0: "sink", 1: "previous-token", 2: "local", 3: "broad", 4: "span-focused", 5: "mixed"}
    assert "local" in classes[(0, 1)].labels  # a previous-token head is local too
    assert classes[(0, 0)].evidence["sink.score"] > 0.8


def test_missing_meters_leave_their_labels_out():
    rows = [(0, 0, "entropy.norm", 0.9), (0, 1, "entropy.norm", 0.1)]
    classes = classify_heads(rows)
    assert classes[(0, 0)].labels == ("broad",) and classes[(0, 1)].labels == ("mixed",)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"sink_epsilon": 0}, "sink_epsilon"),
        ({"broad_min": 2}, "broad_min"),
        ({"local_window": 1}, "local_window"),
        ({"span_lift": 0.5}, "span_lift"),
    ],
)
def test_bad_thresholds_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=name):
        classify_heads([], **kwargs)


def test_an_even_head_over_a_short_context_is_broad_not_local():
    # 12 keys, uniform rows: most mass lies within distance 8, yet nothing is local about it
    n = 12
    w = torch.zeros(1, 1, n, n, dtype=torch.float64)
    for i in range(n):
        w[0, 0, i, : i + 1] = 1.0 / (i + 1)
    call = CallInfo(1, 1, n, n, 0, layer=0)
    meters = [Entropy(), DistanceProfile()]
    feed(meters, call, tiles_of(w, call, 4, 4, torch.where(w > 0, w.log(), float("-inf"))))
    c = classify_heads([r for m in meters for r in m.rows()])[(0, 0)]
    assert c.evidence["distance<8"] > 0.5 and c.labels == ("broad",)
