"""torch.compile(fullgraph=True) traces every mechanism given by name (issue 25).

``attnkit.attention(q, k, v, mechanism=NAME, mask=causal())`` under
``torch.compile(..., fullgraph=True)`` must trace without a graph break, forward and
backward, and give what the eager call gives. ``backend="eager"`` keeps the test fast:
Dynamo still traces every line (a break under fullgraph is an error), only the graph runs
without Inductor.

Compiled calls take a few paths of their own where the eager path branches on data
(``torch.compiler.is_compiling()``): decays summed in float64 and applied pairwise, padded
gathers of a data-dependent count of blocks, a dense form. They agree with eager to
rounding, so float32 results are compared with the float32 tolerance of ``helpers.TOL``
(a few ulps of accumulated rounding). The last tests run those paths eagerly at sizes
where the eager path's choices differ, in float64, against the eager path.

Which mechanisms can be called by name at all is read from the mechanisms themselves: a
mechanism whose by-name call (no parameters, causal mask) refuses, saying what to build,
is skipped with its own message (learned tables that need ``num_heads``, thresholds to
calibrate, a neighbourhood built for causal masks).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import attnkit as ak
from attnkit.mechanisms import available, get_mechanism
from helpers import TOL

# mods/masks.py caches its index tensors with functools.lru_cache, which Dynamo traces
# through with a warning per call site; the cached values are pure functions of ints.
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`:UserWarning")

SHAPE = (1, 2, 32, 8)  # B, H, N, D: above the linear family's recurrent cut-off (16 keys)


def _inputs(dtype=torch.float32, shape=SHAPE, kv_heads=None, k_len=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, H, N, D = shape
    kv_shape = (B, kv_heads or H, k_len or N, D)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in (shape, kv_shape, kv_shape)]


def _run(fn, base, grad: bool, params=()):
    """The output and, with ``grad``, the gradients of a fixed random projection of it
    with respect to q, k, v (then ``params``)."""
    ins = [t.clone().requires_grad_(grad) for t in base]
    with torch.set_grad_enabled(grad):
        out = fn(*ins)
        out = out[0] if isinstance(out, tuple) else out
        if not grad:
            return [out]
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
        grads = torch.autograd.grad((out * weight).sum(), [*ins, *params], allow_unused=True)
    return [out.detach(), *grads]


def _by_name(name):
    return lambda q, k, v: ak.attention(q, k, v, mechanism=name, mask=ak.causal())


def _refusal(name) -> str | None:
    """Why ``name`` cannot be called by name with a causal mask (its own message), or None."""
    try:
        _by_name(name)(*_inputs())
    except ValueError as e:
        return str(e)
    return None


def _compare(got, want, dtype, what):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        label = f"{what}: {'output' if i == 0 else 'grad of ' + 'qkv'[i - 1]}"
        if a is None or b is None:
            assert a is None and b is None, label
            continue
        torch.testing.assert_close(a, b, **TOL[dtype], msg=label)


@pytest.mark.parametrize("name", available())
def test_compiles_by_name_forward_and_backward(name):
    refusal = _refusal(name)
    if refusal is not None:
        # Not callable by name: the refusal must say what to build instead.
        assert "build" in refusal, refusal
        pytest.skip(f"{name} is not callable by name with a causal mask: {refusal}")
    base = _inputs()
    for grad in (False, True):
        want = _run(_by_name(name), base, grad)
        torch._dynamo.reset()
        got = _run(torch.compile(_by_name(name), fullgraph=True, backend="eager"), base, grad)
        _compare(got, want, torch.float32, f"{name} ({'backward' if grad else 'forward'})")
        if grad:
            assert any(g is not None for g in want[1:]), f"{name}: no gradient reaches q, k or v"
    torch._dynamo.reset()


# Mechanisms built before compiling (learned weights given their sizes), at sizes where the
# by-name defaults would take no data-dependent path: several selection blocks, GQA, fewer
# queries than keys, LSH pieces, a learned span. Parameters must receive gradients too.
BUILT = [
    (
        "block_sparse",
        dict(block_size=8, last_q=16, vertical_size=8, slash_size=8, sink_tokens=2, local_tokens=2),
        dict(kv_heads=1, k_len=60),
    ),
    ("nsa", dict(compress_block=8, compress_stride=4, select_block=8, num_selected=3, window=16, num_heads=2), dict(kv_heads=1)),
    ("hyper_attention", dict(block_size=8, sample_size=8, min_seq_len=16), dict(k_len=40)),
    ("adaptive_span", dict(max_span=24, ramp=4, init=0.3, num_heads=2), {}),
    ("gla", dict(heads=2, head_dim=8), dict(k_len=48)),
    ("gated_deltanet", dict(heads=2, head_dim=8, kv_heads=1, short_conv=3), dict(kv_heads=1)),
]


@pytest.mark.parametrize("name, params, sizes", BUILT, ids=[b[0] for b in BUILT])
def test_compiles_built_instances_with_their_parameters(name, params, sizes):
    mech = get_mechanism(name, **params)
    base = _inputs(**sizes)

    def call(q, k, v):
        return mech(q, k, v, mask=ak.causal())

    params = list(mech.parameters())
    want = _run(call, base, True, params)
    torch._dynamo.reset()
    got = _run(torch.compile(call, fullgraph=True, backend="eager"), base, True, params)
    torch._dynamo.reset()
    assert all(g is not None for g in want[4:]), f"{name}: a parameter gets no gradient"
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), i
        if a is not None:
            torch.testing.assert_close(a, b, **TOL[torch.float32], msg=f"{name}: item {i}")


def test_a_lazy_gate_built_outside_refuses_to_compile_saying_what_to_build():
    mech = get_mechanism("gla")  # its gate's weights would take their shapes from the first call
    compiled = torch.compile(lambda q, k, v: mech(q, k, v, mask=ak.causal()), fullgraph=True, backend="eager")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="build the mechanism with heads= and head_dim="):
        compiled(*_inputs())
    torch._dynamo.reset()


# The paths compiled calls take, run eagerly (``is_compiling`` patched during the forward
# and the backward) in float64, where the eager paths choose otherwise: decays strong
# enough for the eager path's float64 and pairwise fallbacks, selections of several blocks
# per query, a span whose flat part and ramp split.
TRACED_PATHS = [
    (
        "block_sparse",
        dict(block_size=8, last_q=16, vertical_size=8, slash_size=8, sink_tokens=2, local_tokens=2),
        (2, 4, 2, 100, 100),
    ),
    (
        "block_sparse",
        dict(block_size=8, last_q=16, vertical_size=8, slash_size=8, sink_tokens=2, local_tokens=2),
        (1, 2, 2, 37, 300),
    ),
    ("nsa", dict(compress_block=8, compress_stride=4, select_block=8, num_selected=4, window=16), (2, 4, 2, 100, 100)),
    ("hyper_attention", dict(block_size=8, sample_size=8, min_seq_len=16), (1, 4, 2, 70, 130)),
    ("selective", {}, (2, 2, 2, 100, 100)),
    ("adaptive_span", dict(max_span=64, ramp=8, init=0.2), (1, 2, 2, 100, 100)),
    ("adaptive_span", dict(max_span=64, ramp=8, init=0.0), (1, 2, 2, 40, 40)),
    ("lightning", {}, (1, 8, 8, 200, 200)),
    ("retnet", {}, (1, 4, 4, 200, 200)),
    ("gla", {}, (1, 2, 2, 200, 200)),
    ("gated_deltanet", {}, (1, 8, 8, 200, 200)),
]


@pytest.mark.parametrize("name, params, shape", TRACED_PATHS, ids=[f"{c[0]}-{c[2][3]}x{c[2][4]}" for c in TRACED_PATHS])
def test_compiled_paths_equal_the_eager_paths(name, params, shape):
    B, Hq, Hkv, Nq, Nk = shape
    base = _inputs(torch.float64, (B, Hq, Nq, 8), kv_heads=Hkv, k_len=Nk)

    def run(traced: bool):
        with mock.patch("torch.compiler.is_compiling", return_value=traced):
            mech = get_mechanism(name, **params)
            return _run(lambda q, k, v: mech(q, k, v, mask=ak.causal()), base, True)

    _compare(run(True), run(False), torch.float64, name)
