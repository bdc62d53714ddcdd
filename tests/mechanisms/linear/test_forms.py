"""The parallel, chunked and recurrent forms against the token-by-token reference:
values, gradients, float64 gradcheck, chunk sizes that do not divide N, span boundaries."""

import pytest
import torch
from linear_cases import CONFIGS, betas, build, feature_dim, gates, qkv

import attnkit as ak
from attnkit.mechanisms.linear import chunked as chunked_module
from attnkit.mechanisms.linear import core
from attnkit.mechanisms.linear.state import LinearState
from helpers import TOL, assert_close

FORMS = ["parallel", "chunked", "recurrent"]


def run(mech, q, k, v, form, mask, g=None, beta=None, state=None):
    return mech(q, k, v, mask=mask, backend=form, g=g, beta=beta, initial_state=state, return_state=True)


def random_state(mech, B, H, D, Dv, seed=3):
    gen = torch.Generator().manual_seed(seed)
    Df = feature_dim(mech, D)
    memory = 0.3 * torch.randn(B, H, Df, Dv, generator=gen, dtype=torch.float64)
    normalizer = torch.rand(B, H, Df, generator=gen, dtype=torch.float64) + 0.5 if mech.normalize else None
    return LinearState(memory, normalizer, position=7)


@pytest.mark.parametrize("label,kwargs,gate", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero state", "state"])
def test_forms_match_reference(label, kwargs, gate, causal, with_state):
    mech = build(kwargs, chunk_size=5)  # 5 does not divide N = 23
    B, Hq, Hkv, N, D, Dv = 2, 4, 2, 23, 4, 3
    q, k, v = qkv(B, Hq, Hkv, N, N, D, Dv)
    g = gates(gate, B, Hkv, N, feature_dim(mech, D))  # per kv head: expanded to the query heads
    beta = betas(mech.rule, B, Hq, N)
    state = random_state(mech, B, Hq, D, Dv) if with_state else None
    mask = ak.causal() if causal else None
    ref, ref_state = run(mech, q, k, v, "reference", mask, g, beta, state)
    for form in FORMS:
        out, st = run(mech, q, k, v, form, mask, g, beta, state)
        assert_close(out, ref, msg=f"{form} output")
        assert_close(st.memory, ref_state.memory, msg=f"{form} memory")
        if mech.normalize:
            assert_close(st.normalizer, ref_state.normalizer, msg=f"{form} normalizer")
        assert st.position == ref_state.position == (7 if with_state else 0) + N


@pytest.mark.parametrize("label,kwargs,gate", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_fewer_queries_than_keys_are_the_last_positions(label, kwargs, gate):
    mech = build(kwargs, chunk_size=4)
    B, H, N, Nq, D = 1, 2, 19, 6, 4
    q, k, v = qkv(B, H, H, N, N, D, 3)
    g = gates(gate, B, H, N, feature_dim(mech, D))
    beta = betas(mech.rule, B, H, N)
    full = mech(q, k, v, mask=ak.causal(), backend="reference", g=g, beta=beta)
    for form in ["reference", *FORMS]:
        out = mech(q[:, :, N - Nq :], k, v, mask=ak.causal(), backend=form, g=g, beta=beta)
        assert_close(out, full[:, :, N - Nq :], msg=form)


@pytest.mark.parametrize("label,kwargs,gate", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gradients_match_reference(label, kwargs, gate, causal):
    mech = build(kwargs, chunk_size=4)
    B, Hq, Hkv, N, D, Dv = 1, 2, 1, 13, 3, 2
    q, k, v = qkv(B, Hq, Hkv, N, N, D, Dv, requires_grad=True)
    g = gates(gate, B, Hq, N, feature_dim(mech, D), requires_grad=True)
    beta = betas(mech.rule, B, Hq, N, requires_grad=True)
    state = random_state(mech, B, Hq, D, Dv)
    state = LinearState(state.memory.requires_grad_(), None if state.normalizer is None else state.normalizer.requires_grad_(), 0)
    leaves = [t for t in (q, k, v, g, beta, state.memory, state.normalizer) if t is not None]
    mask = ak.causal() if causal else None
    upstream = torch.randn(B, Hq, N, Dv, dtype=torch.float64, generator=torch.Generator().manual_seed(9))

    def grads(form):
        out, st = run(mech, q, k, v, form, mask, g, beta, state)
        loss = (out * upstream).sum() + st.memory.square().sum()
        return torch.autograd.grad(loss, leaves)

    expected = grads("reference")
    for form in FORMS:
        for got, want in zip(grads(form), expected):
            assert_close(got, want, msg=form)


DELTA_CONFIGS = [c for c in CONFIGS if c[1].get("rule") == "delta"]


@pytest.mark.parametrize("label,kwargs,gate", DELTA_CONFIGS, ids=[c[0] for c in DELTA_CONFIGS])
def test_delta_rule_in_chunks_beyond_one_inverse_block(label, kwargs, gate):
    """Chunks of 37 and 64 tokens build the UT transform by halves (odd sizes padded),
    unlike the small chunks above: outputs, state and gradients against the reference."""
    B, H, N, D, Dv = 1, 2, 150, 4, 3
    q, k, v = qkv(B, H, H, N, N, D, Dv, requires_grad=True)
    g = gates(gate, B, H, N, D, requires_grad=True)
    beta = betas("delta", B, H, N, requires_grad=True)
    state = random_state(build(kwargs), B, H, D, Dv)
    leaves = [t for t in (q, k, v, g, beta) if t is not None]
    upstream = torch.randn(B, H, N, Dv, dtype=torch.float64, generator=torch.Generator().manual_seed(9))

    def run_and_grads(chunk, form):
        out, st = run(build(kwargs, chunk_size=chunk), q, k, v, form, ak.causal(), g, beta, state)
        return out, st.memory, torch.autograd.grad((out * upstream).sum() + st.memory.square().sum(), leaves)

    want = run_and_grads(4, "reference")
    for chunk in (37, 64):
        out, memory, grads = run_and_grads(chunk, "chunked")
        assert_close(out, want[0], msg=f"chunk {chunk} output")
        assert_close(memory, want[1], msg=f"chunk {chunk} memory")
        for a, b in zip(grads, want[2]):
            assert_close(a, b, msg=f"chunk {chunk} gradient")


GRADCHECK = [CONFIGS[4], CONFIGS[7], CONFIGS[8], CONFIGS[9]]


@pytest.mark.parametrize("label,kwargs,gate", GRADCHECK, ids=[c[0] for c in GRADCHECK])
def test_chunked_gradcheck_float64(label, kwargs, gate):
    mech = build(kwargs, chunk_size=3)
    B, H, N, D, Dv = 1, 1, 7, 2, 2
    q, k, v = qkv(B, H, H, N, N, D, Dv, requires_grad=True)
    g = gates(gate, B, H, N, feature_dim(mech, D), requires_grad=True)
    beta = betas(mech.rule, B, H, N, requires_grad=True)
    memory = random_state(mech, B, H, D, Dv).memory.requires_grad_()
    normalizer = torch.rand(B, H, feature_dim(mech, D), dtype=torch.float64) + 0.5 if mech.normalize else None
    inputs = [t for t in (q, k, v, g, beta, memory) if t is not None]

    def f(*args):
        it = iter(args)
        qq, kk, vv = next(it), next(it), next(it)
        gg = next(it) if g is not None else None
        bb = next(it) if beta is not None else None
        state = LinearState(next(it), normalizer, 0)
        out, st = mech(qq, kk, vv, mask=ak.causal(), backend="chunked", g=gg, beta=bb, initial_state=state, return_state=True)
        return out, st.memory

    assert torch.autograd.gradcheck(f, inputs, fast_mode=True)


SPAN_CASES = [({"feature_map": "elu+1", "normalize": True}, "diag"), ({"feature_map": "silu+l2", "rule": "delta"}, "scalar")]


@pytest.mark.parametrize("kwargs,gate", SPAN_CASES, ids=["sum diag", "delta scalar"])
def test_many_spans_match_one_span(kwargs, gate, monkeypatch):
    """Tiny spans force the checkpointed backward across many span boundaries."""
    B, H, N, D = 1, 2, 50, 3
    mech = build(kwargs, chunk_size=4)
    q, k, v = qkv(B, H, H, N, N, D, 2, requires_grad=True)
    g = gates(gate, B, H, N, D, requires_grad=True)
    beta = betas(mech.rule, B, H, N, requires_grad=True)
    leaves = [t for t in (q, k, v, g, beta) if t is not None]

    def grads():
        out = mech(q, k, v, mask=ak.causal(), backend="chunked", g=g, beta=beta)
        return out, torch.autograd.grad(out.square().sum(), leaves)

    one_out, one_grads = grads()
    monkeypatch.setattr(chunked_module, "SPAN_ELEMENTS", 1)  # spans of one chunk
    monkeypatch.setattr(chunked_module, "INFERENCE_SPAN_ELEMENTS", 1)
    assert len(chunked_module.make_plan(_call(mech, q, k, v, g, beta), 4).spans) == 13
    many_out, many_grads = grads()
    assert_close(many_out, one_out)
    for a, b in zip(many_grads, one_grads):
        assert_close(a, b)
    with torch.no_grad():  # without gradients the spans follow INFERENCE_SPAN_ELEMENTS
        assert_close(mech(q, k, v, mask=ak.causal(), backend="chunked", g=g, beta=beta), one_out)


def _call(mech, q, k, v, g, beta):
    return mech._prepare(q, k, v, ak.causal(), None, None, None, False, None, False, g, beta)[0]


@pytest.mark.parametrize("m", [1, 5, 16, 17, 33, 64])
def test_unit_lower_inverse(m):
    """The delta rule's UT transform (I + N)^{-1}: one leaf block, halves of even and odd
    sizes, against a general inverse; entries of N as large as DeltaNet's (β·k_i·k_j,
    |N_ij| < 1)."""
    gen = torch.Generator().manual_seed(m)
    n = (2 * torch.rand(3, m, m, generator=gen, dtype=torch.float64) - 1).tril(-1)
    eye = torch.eye(m, dtype=torch.float64)
    torch.testing.assert_close(core.unit_lower_inverse(n), torch.linalg.inv(eye + n), rtol=1e-10, atol=1e-10)


def chunk_path(g, chunk):
    """How the chunked form factors these gates' decays (``core.ChunkDecay``): from the
    chunk "start", about its "midpoint", or "pairwise"."""
    g = g.detach().float()
    g = g.unsqueeze(-1) if g.dim() == 3 else g
    g = torch.nn.functional.pad(g, (0, 0, 0, (-g.shape[2]) % chunk))
    decay = core.ChunkDecay(g.reshape(*g.shape[:2], -1, chunk, g.shape[-1]), torch.float32)
    return "pairwise" if not decay.factored else "midpoint" if decay.midpoint else "start"


# (chunk size, gate strength, path): the strongest chunk decays by about e^-30, e^-60
# (beyond factoring at the chunk start) and e^-230 (beyond any factoring)
STRONG = [(16, 6.0, "start"), (32, 8.0, "midpoint"), (32, 30.0, "pairwise")]


@pytest.mark.parametrize("chunk,strength,path", STRONG, ids=[s[2] for s in STRONG])
@pytest.mark.parametrize("gate", ["scalar", "diag"])
@pytest.mark.parametrize("rule", ["sum", "delta"])
def test_strong_gates_in_float32(gate, rule, chunk, strength, path):
    """Cumulative decays beyond e^-FACTOR_LIMIT: the parallel form and the strongest
    chunks take the exact (pairwise) path, the others factor; no overflow either way."""
    kwargs = {"feature_map": "silu+l2", "rule": "delta"} if rule == "delta" else {"feature_map": "elu+1", "normalize": True}
    mech = build(kwargs, chunk_size=chunk)
    B, H, N, D = 1, 2, 140, 16
    q, k, v = qkv(B, H, H, N, N, D, 8)
    g = gates(gate, B, H, N, D, strength=strength)
    beta = betas(rule, B, H, N)
    assert float(g.sum(2).max()) < -core.FACTOR_LIMIT
    assert chunk_path(g, chunk) == path
    ref = mech(q, k, v, mask=ak.causal(), backend="reference", g=g, beta=beta)
    for form in FORMS:
        out = mech(
            q.float(),
            k.float(),
            v.float(),
            mask=ak.causal(),
            backend=form,
            g=g.float(),
            beta=None if beta is None else beta.float(),
        )
        assert torch.isfinite(out).all()
        assert_close(out, ref, dtype=torch.float32, msg=form)


# "delta norm" is left out: its delta-rule normaliser φ(q)ᵀz can approach 0, so float32
# rounding is amplified by the conditioning of the call, not by the algorithm.
WELL_CONDITIONED = [c for c in CONFIGS if c[0] != "delta norm"]


# (gate strength, path) over chunks of 8 tokens
STRONG_GRAD = [(8.0, "start"), (20.0, "midpoint"), (150.0, "pairwise")]


@pytest.mark.parametrize("strength,path", STRONG_GRAD, ids=[s[1] for s in STRONG_GRAD])
@pytest.mark.parametrize("gate", ["scalar", "diag"])
@pytest.mark.parametrize("rule", ["sum", "delta"])
def test_strong_gates_gradients_match_reference(gate, rule, strength, path):
    kwargs = {"feature_map": "silu+l2", "rule": "delta"} if rule == "delta" else {"feature_map": "elu+1", "normalize": True}
    mech = build(kwargs, chunk_size=8)
    B, H, N, D = 1, 2, 30, 4
    q, k, v = qkv(B, H, H, N, N, D, 3, requires_grad=True)
    g = gates(gate, B, H, N, D, strength=strength, requires_grad=True)
    beta = betas(rule, B, H, N, requires_grad=True)
    assert float(g.detach().sum(2).max()) < -core.FACTOR_LIMIT  # the parallel form's exact (pairwise) path
    assert chunk_path(g, 8) == path
    leaves = [t for t in (q, k, v, g, beta) if t is not None]
    want = torch.autograd.grad(mech(q, k, v, mask=ak.causal(), backend="reference", g=g, beta=beta).square().sum(), leaves)
    for form in FORMS:
        got = torch.autograd.grad(mech(q, k, v, mask=ak.causal(), backend=form, g=g, beta=beta).square().sum(), leaves)
        for a, b in zip(got, want):
            assert_close(a, b, msg=form)


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("label,kwargs,gate", WELL_CONDITIONED, ids=[c[0] for c in WELL_CONDITIONED])
def test_float32_chunked_matches_float64_reference(label, kwargs, gate, chunk):
    mech = build(kwargs, chunk_size=chunk)
    B, H, N, D = 1, 2, 200, 8
    q, k, v = qkv(B, H, H, N, N, D, 8)
    q, k = 0.5 * q, 0.5 * k  # keep unnormalised outputs O(1) so TOL's relative part applies
    g = gates(gate, B, H, N, feature_dim(mech, D))
    beta = betas(mech.rule, B, H, N)
    ref = mech(q, k, v, mask=ak.causal(), backend="reference", g=g, beta=beta)
    out = mech(
        q.float(),
        k.float(),
        v.float(),
        mask=ak.causal(),
        backend="chunked",
        g=None if g is None else g.float(),
        beta=None if beta is None else beta.float(),
    )
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, **TOL[torch.float32])


@pytest.mark.parametrize("name", ["gla", "gated_deltanet", "fast_weight"])
def test_gate_weight_gradients_across_spans_match_reference(name, monkeypatch):
    """Gates computed from the keys inside the chunked scan: gradients of k and of the gate
    weights, summed over many spans, equal the reference's (GQA: weights shared by heads)."""
    from attnkit.mechanisms import get_mechanism

    mech = get_mechanism(name, chunk_size=4).double()
    B, Hq, Hkv, N, D = 1, 4, 2, 30, 3
    q, k, v = qkv(B, Hq, Hkv, N, N, D, 2, requires_grad=True)
    with torch.no_grad():
        mech(q, k, v, mask=ak.causal())
        for p in mech.parameters():
            p.add_(0.3 * torch.randn_like(p))
    leaves = [q, k, v, *mech.parameters()]

    def grads(form):
        out = mech(q, k, v, mask=ak.causal(), backend=form)
        return out, torch.autograd.grad(out.square().sum(), leaves)

    ref_out, ref_grads = grads("reference")
    monkeypatch.setattr(chunked_module, "SPAN_ELEMENTS", 1)
    out, got = grads("chunked")
    assert_close(out, ref_out)
    for a, b in zip(got, ref_grads):
        assert_close(a, b)


@pytest.mark.parametrize("gate", [None, "scalar", "diag"])
def test_sum_rule_scan_blocks(gate, monkeypatch):
    """The sum rule's chunk-to-chunk states come in blocks of SCAN_BLOCK chunks: blocks of 3
    over 13 chunks (values and gradients, state carried between blocks and spans)."""
    monkeypatch.setattr(core, "SCAN_BLOCK", 3)
    mech = build({"feature_map": "elu+1", "normalize": True}, chunk_size=4)
    B, H, N, D = 1, 2, 50, 3
    q, k, v = qkv(B, H, H, N, N, D, 2, requires_grad=True)
    g = gates(gate, B, H, N, D, requires_grad=True)
    leaves = [t for t in (q, k, v, g) if t is not None]
    want = mech(q, k, v, mask=ak.causal(), backend="reference", g=g)
    got = mech(q, k, v, mask=ak.causal(), backend="chunked", g=g)
    assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got.square().sum(), leaves), torch.autograd.grad(want.square().sum(), leaves)):
        assert_close(a, b)
