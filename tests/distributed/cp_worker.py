"""One rank of a context-parallel test group (run as a script by test_context_parallel.py).

Every rank builds the same whole-sequence inputs from one seed, computes the literal
dense float64 reference of the whole call itself, runs attnkit.distributed.attention on
its shard, and compares its shard of the output, the logsumexp and the gradients (the
gradients of shared parameters summed over the group). A failed check raises: the
process exits non-zero with the message on stderr.

usage: cp_worker.py RANK WORLD INIT_FILE MODE   (MODE: checks | crash)
"""

from __future__ import annotations

import math
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import attnkit as ak
import attnkit.distributed as cp
from attnkit.mechanisms import get_mechanism
from attnkit.mods import alibi_slopes
from attnkit.mechanisms.linear import LinearAttention

torch.set_num_threads(1)
TOL = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),  # rounding of sums over < 100 terms
    # float32 against the float64 reference: unit roundoff 6e-8 grown by sums over < 100
    # terms and by the exp of logits of size ~5 in the gradients
    torch.float32: dict(atol=1e-4, rtol=1e-4),
}


def dense_reference(q, k, v, mask=None, score=None, sinks=None, gate=None):
    """Literal softmax (or sigmoid, with ``gate`` = its bias b) attention, float64, all pairs."""
    B, H, N, D = q.shape
    rep = H // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    qi = torch.arange(N).view(1, 1, N, 1)
    ki = torch.arange(N).view(1, 1, 1, N)
    if score is not None:
        s = score(s, b, h, qi, ki)
    visible = torch.ones(B, H, N, N, dtype=torch.bool) if mask is None else mask(b, h, qi, ki).expand(B, H, N, N)
    if gate is not None:
        w = torch.sigmoid(s + gate) * visible
        return w @ v, None
    s = s.masked_fill(~visible, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, H, 1, 1).expand(B, H, N, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.where(torch.isneginf(lse)[..., None], 0.0, torch.exp(s - lse[..., None]))
    return p[..., :N] @ v, lse


def inputs(B, Hq, Hkv, N, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, N, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, N, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, N, D, generator=g, dtype=torch.float64)
    w = torch.randn(B, Hq, N, D, generator=g, dtype=torch.float64)  # loss weights
    return q, k, v, w


def close(name, actual, expected):
    torch.testing.assert_close(actual.double(), expected.double(), **TOL[actual.dtype], msg=lambda m: f"{name}: {m}")


def check_softmax(name, layout, N, Hq=4, Hkv=2, mask=None, score=None, sinks=None, params=(), mechanism=None, gate=None, seed=0, dtype=torch.float64):
    """One sharded call against the dense reference: output, lse, dq, dk, dv, parameter grads."""
    rank = dist.get_rank()
    q, k, v, w = inputs(2, Hq, Hkv, N, 8, seed)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = dense_reference(*full, mask=mask, score=score, sinks=sinks, gate=gate)
    (ref_out * w).sum().backward()
    ref_param_grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None

    local = [cp.shard(t, 2, layout=layout).to(dtype).requires_grad_() for t in (q, k, v)]
    softmax = mechanism is None
    result = cp.attention(*local, mask=mask, score=score, sinks=sinks, layout=layout, mechanism=mechanism, return_lse=softmax)
    out, lse = result if softmax else (result, None)
    (out * cp.shard(w, 2, layout=layout)).sum().backward()
    close(f"{name} out", out, cp.shard(ref_out, 2, layout=layout))
    if softmax:
        close(f"{name} lse", lse, cp.shard(ref_lse, 2, layout=layout))
    for label, t, ref in zip("qkv", local, full):
        close(f"{name} d{label}", t.grad, cp.shard(ref.grad, 2, layout=layout))
    for i, p in enumerate(params):
        g = p.grad.clone()
        dist.all_reduce(g)
        close(f"{name} param {i} grad", g, ref_param_grads[i])
        p.grad = None
    return rank


def check_lse_gradient(N):
    """Gradients that flow through the returned lse (not only the output)."""
    q, k, v, w = inputs(1, 2, 2, N, 8, seed=3)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = dense_reference(*full, mask=ak.causal())
    ((out * w).sum() + (lse * lse).sum()).backward()
    local = [cp.shard(t, 2).requires_grad_() for t in (q, k, v)]
    o, l = cp.attention(*local, mask=ak.causal(), return_lse=True)
    ((o * cp.shard(w, 2)).sum() + (l * l).sum()).backward()
    for label, t, ref in zip("qkv", local, full):
        close(f"lse-grad d{label}", t.grad, cp.shard(ref.grad, 2))


def check_linear(name, mech, layout, N, seed=5):
    """State passing against the mechanism's literal token-by-token reference form."""
    q, k, v, w = inputs(2, 2, 2, N, 8, seed)
    q, k = q * 0.3, k * 0.3
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = mech(*full, mask=ak.causal(), backend="reference")
    (ref * w).sum().backward()
    params = [p for p in mech.parameters() if p.requires_grad]
    ref_param_grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    local = [cp.shard(t, 2, layout=layout).requires_grad_() for t in (q, k, v)]
    out = cp.attention(*local, mask=ak.causal(), mechanism=mech, layout=layout)
    (out * cp.shard(w, 2, layout=layout)).sum().backward()
    close(f"{name} out", out, cp.shard(ref, 2, layout=layout))
    for label, t, r in zip("qkv", local, full):
        close(f"{name} d{label}", t.grad, cp.shard(r.grad, 2, layout=layout))
    for i, p in enumerate(params):
        g = p.grad.clone()
        dist.all_reduce(g)
        close(f"{name} gate param {i} grad", g, ref_param_grads[i])
    return params


def check_shards_and_errors(world, N):
    """shard/unshard/positions round trip, and bad input on one rank raising on every rank."""
    x = torch.arange(3 * N, dtype=torch.float64).view(3, N)
    for layout in ("zigzag", "contiguous"):
        part = cp.shard(x, 1, layout=layout)
        assert torch.equal(part, x[:, cp.positions(N, layout=layout)])
        assert torch.equal(cp.unshard(part, 1, layout=layout), x)
    q, k, v, _ = inputs(1, 2, 2, N, 8, 0)
    local = [cp.shard(t, 2) for t in (q, k, v)]
    if dist.get_rank() == 0:
        local[1] = local[1][..., :4]  # wrong head dim on rank 0 only
    try:
        cp.attention(*local, mask=ak.causal())
    except ValueError as err:
        expected = "head dim" if dist.get_rank() == 0 else "rank(s) [0] of the group rejected"
        assert expected in str(err), err
    else:
        raise AssertionError("bad input on rank 0 was not refused")
    try:  # contiguous shards passed as zigzag (lengths differ when N % 2P != 0)
        cp.attention(*(cp.shard(t, 2, layout="contiguous") for t in (q, k, v)), layout="zigzag")
    except ValueError as err:
        assert "are not the 'zigzag' layout" in str(err), err
    else:
        raise AssertionError("shards of the wrong layout were not refused")


def check_hf_model(name, N):
    """A tiny transformers model: sharded prefill logits and (summed) weight gradients equal
    the single-process run's."""
    import transformers as T

    import attnkit.hf

    common = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    config = {"llama": lambda: T.LlamaConfig(**common),
              "mistral": lambda: T.MistralConfig(**common, sliding_window=3)}[name]()
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation="eager").double().eval()
    ids = torch.randint(0, 97, (1, N), generator=torch.Generator().manual_seed(2))
    # the single-process run through attnkit (transformers' eager path rounds the softmax
    # to float32, so it is no float64 reference; tests/hf hold attnkit.hf to it)
    with attnkit.hf.use(model):
        ref = model(ids, use_cache=False).logits
    ref.square().mean().backward()
    weight = model.model.layers[0].self_attn.q_proj.weight
    ref_grad = weight.grad.clone()
    model.zero_grad()
    with attnkit.hf.use(model, context_parallel=dist.group.WORLD):
        logits = model(cp.shard(ids, 1), position_ids=cp.positions(N)[None], use_cache=False).logits
    close(f"{name} logits", logits, cp.shard(ref, 1))
    # the mean over the whole sequence, written as this rank's share
    (logits.square().sum() / ref.numel()).backward()
    grad = weight.grad.clone()
    dist.all_reduce(grad)
    close(f"{name} q_proj grad", grad, ref_grad)


def run_checks(world):
    N = 11 if world == 2 else 14  # neither divides into 2P equal chunks
    torch.manual_seed(0)
    check_shards_and_errors(world, N)
    check_softmax("causal gqa zigzag", "zigzag", N, mask=ak.causal())
    check_softmax("window", "contiguous", N, mask=ak.window(2))
    # float32 takes the kernels' fused C loops, which read the shifted mask's band
    sig32 = get_mechanism("sigmoid", bias=-1.0)
    check_softmax("sigmoid window float32", "zigzag", N, mask=ak.window(3), mechanism=sig32, gate=-1.0, dtype=torch.float32)
    if world == 2:  # cases whose paths the 4-rank group would only repeat
        check_softmax("causal contiguous", "contiguous", N, mask=ak.causal())
        check_softmax("window float32", "zigzag", N, mask=ak.window(3), dtype=torch.float32)
        check_softmax("causal float32", "zigzag", N, mask=ak.causal(), dtype=torch.float32)
        check_softmax("no mask", "zigzag", N, Hq=2, Hkv=2)
    ids = torch.tensor([[0] * 3 + [1] * 5 + [2] * (N - 8), [0] * (N - 2) + [1] * 2])
    check_softmax("document per row & causal", "zigzag", N, mask=ak.causal() & ak.document(ids))
    slopes = alibi_slopes(4).double().requires_grad_()
    sinks = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    check_softmax("alibi slopes + sinks", "zigzag", N, mask=ak.causal(), score=ak.alibi(slopes=slopes), sinks=sinks, params=[slopes, sinks])
    check_softmax("softcap + callable mask", "zigzag", N, mask=lambda b, h, qi, ki: (qi - ki) % 3 != 1, score=ak.softcap(2.0) >> (lambda s, b, h, qi, ki: s + 0.05 * ki))
    # rows that see no key at all: lse -inf, zeros, no NaN
    check_softmax("empty rows", "zigzag", N, mask=lambda b, h, qi, ki: (ki < qi) & (qi % 4 != 0))
    check_lse_gradient(N)
    if world == 2:
        sig = get_mechanism("sigmoid", bias=-1.0)
        check_softmax("sigmoid causal", "zigzag", N, mask=ak.causal(), mechanism=sig, gate=-1.0)
        check_hf_model("llama", N)
        check_hf_model("mistral", N)
    check_linear("retnet", get_mechanism("retnet"), "zigzag", N)
    torch.manual_seed(7)  # learned gates: the same weights on every rank
    gdn = LinearAttention(feature_map="identity", rule="delta", beta="learned", decay="mamba2", heads=2, head_dim=8).double()
    check_linear("gated delta rule", gdn, "contiguous", N)
    try:
        cp.attention(*(cp.shard(t, 2) for t in inputs(1, 2, 2, N, 8, 0)[:3]), mechanism="differential")
    except ValueError as err:
        assert "cannot be sharded exactly" in str(err), err
    else:
        raise AssertionError("differential attention should refuse to shard")


def main():
    rank, world, init, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    timeout = timedelta(seconds=60 if mode == "checks" else 4)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=timeout)
    if mode == "checks":
        run_checks(world)
    elif mode == "crash":
        dist.barrier()  # every rank has finished joining: the failure below is the call's
        if rank == world - 1:
            raise SystemExit("rank failed on purpose before the call")
        q = torch.randn(1, 2, 4, 8)
        try:
            cp.attention(q, q, q, mask=ak.causal())
        except RuntimeError as err:
            assert "attnkit.distributed" in str(err) and "failed during" in str(err), err
            print("CLEAR ERROR:", str(err).splitlines()[0], flush=True)
            # gloo's background threads may abort the interpreter's teardown once the
            # peer is gone ("terminate called without an active exception"), which is
            # torch's behaviour, not the call's: leave without tearing down.
            os._exit(0)
        raise AssertionError("the call returned although a rank had failed")
    dist.barrier()
    dist.destroy_process_group()
    print("OK")


if __name__ == "__main__":
    main()
