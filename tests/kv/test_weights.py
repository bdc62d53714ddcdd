"""The weights the policy cache computes itself (``attnkit.kv.weights``): each requested
query row's softmax over the slots it sees, summed onto the slots, against a literal
float64 loop; and the weight-reading policies keep the model on its own attention."""

import math

import pytest
import torch
from eager_reference import padded_batch, positions
from tiny_models import build

import attnkit.kv as kv
import attnkit.kv.weights as weights
from attnkit.hf.switch import active_switch
from attnkit.kernels import cpu


def literal_mass(q, q_pos, keys, valid, pos, scale, window):
    B, Hq, R, D = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    g = Hq // Hkv
    out = torch.zeros(B, Hq, L, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            for r in range(R):
                p = int(q_pos[r])
                seen = []
                for s in range(L):
                    ps = int(pos[b, h // g, s])
                    ok = bool(valid[b, h // g, s]) and ps <= p and (window is None or p - ps < window)
                    if ok or ps == p:
                        seen.append(s)
                logits = [scale * float((q[b, h, r].double() * keys[b, h // g, s].double()).sum()) for s in seen]
                top = max(logits)
                norm = sum(math.exp(x - top) for x in logits)
                for s, x in zip(seen, logits):
                    if valid[b, h // g, s]:
                        out[b, h, s] += math.exp(x - top) / norm
    return out


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_prefill_rows_equal_the_literal_softmax(window, dtype, tol, monkeypatch):
    monkeypatch.setattr(weights, "CHUNK_LOGITS", 40)  # a few rows per chunk: chunk edges are exercised
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, N, D = 2, 4, 2, 11, 8
    q = torch.randn(B, Hq, N, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Hkv, N, D, generator=g, dtype=torch.float64).to(dtype)
    valid = torch.ones(B, Hkv, N, dtype=torch.bool)
    valid[1, :, :3] = False  # a left-padded row
    pos = torch.arange(N).expand(B, Hkv, N)
    for lo, hi in [(0, N), (N - 4, N), (N - 1, N)]:  # H2O's every row, SnapKV's window, TOVA's last row
        q_pos = torch.arange(lo, hi)
        got = weights.received_mass(q[:, :, lo:hi], q_pos, k, valid, pos, 0.3, window, prefill=True)
        want = literal_mass(q[:, :, lo:hi], q_pos, k, valid, pos, 0.3, window)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # every valid (real) row's weights sum to one over the slots it sees
    full = weights.received_mass(q, torch.arange(N), k, valid, pos, 0.3, window, prefill=True)
    torch.testing.assert_close(full.sum(-1)[0], torch.full((Hq,), float(N), dtype=torch.float64), atol=tol * N, rtol=0)


@pytest.mark.parametrize("window", [None, 5])
def test_decode_rows_over_a_layout_with_holes_equal_the_literal_softmax(window):
    g = torch.Generator().manual_seed(1)
    B, Hq, Hkv, L, D = 2, 6, 3, 9, 4
    q = torch.randn(B, Hq, 2, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, L, D, generator=g, dtype=torch.float64)
    # kept entries of earlier positions in layout order, then the two new tokens at 20, 21
    pos = torch.sort(torch.randint(0, 20, (B, Hkv, L - 2), generator=g), dim=-1).values
    pos = torch.cat([pos, torch.tensor([20, 21]).expand(B, Hkv, 2)], -1)
    valid = torch.rand(B, Hkv, L, generator=g) > 0.3
    valid[..., -2:] = True
    q_pos = torch.tensor([20, 21])
    got = weights.received_mass(q, q_pos, k, valid, pos, 0.5, window, prefill=False)
    torch.testing.assert_close(got, literal_mass(q, q_pos, k, valid, pos, 0.5, window), atol=1e-12, rtol=1e-12)
    # one decoding query in the last slot (the per-token step), real or padded, with holes or none
    one = (slice(None), slice(None), slice(None, L - 1))
    for own in (True, False):
        v = valid[one].clone()
        v[..., -1] = own
        for holes in (True, False):
            vv = v if holes else torch.ones_like(v) & v[..., -1:]
            for flag in (None, bool(vv.all())):
                got = weights.received_mass(
                    q[:, :, :1], q_pos[:1], k[one], vv, pos[one], 0.5, window, prefill=False, all_valid=flag, appended=True
                )
                want = literal_mass(q[:, :, :1], q_pos[:1], k[one], vv, pos[one], 0.5, window)
                torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@torch.no_grad()
@pytest.mark.parametrize("name", ["h2o", "tova", "snapkv"])
def test_weight_policies_keep_the_model_on_its_own_attention(name, monkeypatch):
    """No attnkit switch is entered for a Llama-style model: the prefill runs under sdpa
    (H2O's in the cache's step_attention, which computes its mass with the attention);
    the one-token steps of this padded batch (whose rows keep different counts) and those
    of the policies that score every decoded token run in the cache's step_attention for
    the length of the call, and the model is back on sdpa after."""
    model = build("llama", "sdpa")
    ids, mask = padded_batch(seed=4, n=10, pads=(0, 2, 4))
    cache = kv.policy_cache(model, name, budget=0.5, **({"window": 3} if name == "snapkv" else {}))
    assert cache.direct
    seen = []
    hooks = [
        layer.self_attn.register_forward_pre_hook(lambda m, a: seen.append((m.config._attn_implementation, active_switch(m)[0])))
        for layer in model.model.layers
    ]
    try:
        model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=3, do_sample=False, pad_token_id=0)
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == 3 * 3 and all(sw is None for _, sw in seen)
    # 3 layers: the prefill (H2O's, which needs every query's weights, runs in C++ with its mass), two steps
    prefill = "attnkit_kv_step" if name == "h2o" and cpu.available() else "sdpa"
    assert [impl for impl, _ in seen] == [prefill] * 3 + ["attnkit_kv_step"] * 6
    assert model.config._attn_implementation == "sdpa"
    assert int(cache.lengths(0).max()) <= 5 + (3 if name != "snapkv" else 3)


@torch.no_grad()
def test_a_model_whose_queries_cannot_be_recomputed_reads_weights_through_attnkit(monkeypatch):
    """The fallback: without q_proj + RoPE to recompute queries, the forward runs under
    attnkit.hf.use with an observer, and keeps the same entries."""
    model = build("llama", "sdpa").double()
    ids, mask = padded_batch(seed=5, n=12, pads=(0, 3, 5))
    direct = kv.policy_cache(model, "h2o", budget=0.5)
    monkeypatch.setattr("attnkit.kv.weights.can_recompute_queries", lambda m: False)
    observed = kv.policy_cache(model, "h2o", budget=0.5)
    assert direct.direct and not observed.direct
    for cache in (direct, observed):
        model(ids, attention_mask=mask, position_ids=positions(mask), cache=cache)
        full = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
        model(torch.tensor([[3], [4], [5]]), attention_mask=full, position_ids=positions(full)[:, -1:], cache=cache)
    for layer in range(3):
        assert torch.equal(direct.kept_mask(layer), observed.kept_mask(layer))
        torch.testing.assert_close(direct.layers[layer].score, observed.layers[layer].score, atol=1e-12, rtol=1e-12)


@torch.no_grad()
@pytest.mark.parametrize("name", ["h2o", "tova"])
def test_step_attention_equals_the_model_attention_with_recomputed_weights(name, monkeypatch):
    """A scored policy's decoding step in step_attention (weights from the step's own
    softmax) gives the logits and kept sets of the model's sdpa with the weights
    recomputed beside it, over padded rows whose empty slots step_attention hides."""
    import attnkit.kv.steps as kv_steps

    model = build("llama", "sdpa").double()
    ids, mask = padded_batch(seed=6, n=12, pads=(0, 3, 5))
    forced = torch.randint(1, 97, (3, 6), generator=torch.Generator().manual_seed(7))

    def run():
        cache = kv.policy_cache(model, name, budget=0.5)
        outs = [model(ids, attention_mask=mask, position_ids=positions(mask), cache=cache).logits[:, -1]]
        full, kept = mask, []
        for s in range(forced.shape[1]):
            full = torch.cat([full, torch.ones(3, 1, dtype=full.dtype)], 1)
            outs.append(
                model(forced[:, s : s + 1], attention_mask=full, position_ids=positions(full)[:, -1:], cache=cache).logits[:, -1]
            )
            kept.append([cache.kept_positions(i) for i in range(3)])
        return torch.stack(outs, 1), kept

    stepped, stepped_kept = run()
    monkeypatch.setattr(kv_steps, "runs_in_step_attention", lambda *a: False)
    recomputed, recomputed_kept = run()
    assert stepped_kept == recomputed_kept
    torch.testing.assert_close(stepped, recomputed, atol=1e-10, rtol=1e-10)


def test_a_failing_step_leaves_the_model_on_its_own_attention():
    from transformers import AttentionInterface

    import attnkit.kv.step_attention as steps

    model = build("llama", "sdpa")
    ids, mask = padded_batch(seed=6, n=8, pads=(0, 2, 3))
    cache = kv.policy_cache(model, "tova", budget=0.5)

    def fail(*args, **kwargs):
        raise RuntimeError("step failed")

    AttentionInterface.register(steps.NAME, fail)
    try:
        with pytest.raises(RuntimeError, match="step failed"):
            model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=3, do_sample=False, pad_token_id=0)
    finally:
        AttentionInterface.register(steps.NAME, steps.step_attention)
    assert model.config._attn_implementation == "sdpa"
