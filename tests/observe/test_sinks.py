import torch
from dense_meters import dense, observe, qkv, sink_score

import attnkit as ak
from attnkit.observe import SinkMass
from helpers import TOL


def test_sink_score_counts_only_queries_that_see_the_first_key():
    # Under a window of 10, only queries 0..10 see key 0: Gu et al.'s mean is over them.
    q, k, v = qkv(1, 2, 2, 64, 64)
    got = observe(q, k, v, [SinkMass()], mask=ak.window(10))
    p, _, _, _ = dense(q, k, v, mask=ak.window(10))
    for h in range(2):
        torch.testing.assert_close(got[(0, h, "sink.score")], p[0, h, :11, 0].mean().item(), **TOL[torch.float64])


def test_sink_head_of_a_constructed_sink_is_found():
    # Keys: key 0 aligned with every query, the rest orthogonal -> most mass on key 0.
    n, d = 50, 4
    q = torch.zeros(1, 1, n, d, dtype=torch.float64)
    q[..., 0] = 20.0  # logit 10 on key 0, 0 elsewhere: e^10 / (e^10 + 49) > 0.99
    k = torch.zeros(1, 1, n, d, dtype=torch.float64)
    k[0, 0, 0, 0] = 1.0
    k[0, 0, 1:, 1] = 1.0
    got = observe(q, k, k.clone(), [SinkMass(epsilon=0.3)])
    assert got[(0, 0, "sink.score")] > 0.99
    assert got[(0, 0, "sink.first4")] > 0.99


def test_float32_inputs_within_float32_tolerance():
    q, k, v = qkv(1, 4, 2, 300, 300, dtype=torch.float32)
    got = observe(q, k, v, [SinkMass()], mask=ak.causal())
    p, vis, _, _ = dense(q.double(), k.double(), v.double(), mask=ak.causal())
    for h in range(4):
        torch.testing.assert_close(got[(0, h, "sink.score")], sink_score(p, vis)[h].item(), **TOL[torch.float32])
