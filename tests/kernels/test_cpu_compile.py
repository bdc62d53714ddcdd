"""torch.compile(fullgraph=True) traces attnkit.attention on the whole-call paths of the
CPU operators (their fake kernels give the shapes, their autograd the backward), forward
and backward, with the same values and gradients as eager: sigmoid attention, softmax
with a band mask and softcap (the softmax operator) or ALiBi (torch's flash kernel per
tile segment), top-k, multi-token attention, talking heads, NSA inference."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit.kernels import cpu
from attnkit.mechanisms import get_mechanism

pytestmark = pytest.mark.slow

CASES = {  # id: (attention keyword arguments, whether the call is trained)
    "sigmoid": (lambda: dict(mask=attnkit.causal(), mechanism=get_mechanism("sigmoid")), True),
    "softmax band + softcap": (lambda: dict(mask=attnkit.causal() & attnkit.window(40), score=attnkit.softcap(5.0)), True),
    "softmax band + alibi": (lambda: dict(mask=attnkit.causal() & attnkit.window(40), score=attnkit.alibi(2)), True),
    "topk": (lambda: dict(mask=attnkit.causal(), mechanism=get_mechanism("topk", k=8)), True),
    "multi-token": (lambda: dict(mask=attnkit.causal(), mechanism=get_mechanism("multi_token", num_heads=2)), True),
    "talking heads": (lambda: dict(mask=attnkit.causal(), mechanism=get_mechanism("talking_heads", num_heads=2)), True),
    "nsa inference": (
        lambda: dict(
            mask=attnkit.causal(),
            mechanism=get_mechanism("nsa", compress_block=8, compress_stride=4, select_block=8, num_selected=4, window=16),
        ),
        False,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_whole_call_equals_eager(case):
    if not cpu.available():
        pytest.skip(f"operators unavailable: {cpu.status().reason}")
    make, trained = CASES[case]
    kwargs = make()
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(1, 2, 64, 16, generator=g) for _ in range(3)]
    go = torch.randn(1, 2, 64, 16, generator=g)
    fn = lambda q, k, v: attnkit.attention(q, k, v, **kwargs)  # noqa: E731

    def run(f):
        ins = [t.clone().requires_grad_(trained) for t in base]
        with torch.set_grad_enabled(trained):
            out = f(*ins)
            return [out.detach(), *(torch.autograd.grad(out, ins, go) if trained else [])]

    torch._dynamo.reset()
    # "eager" keeps the test quick: dynamo still traces every op on fake tensors (the
    # operators' fake kernels) and the custom backward, and fullgraph fails on any break
    got = run(torch.compile(fn, fullgraph=True, backend="eager"))
    want = run(fn)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_constant_for_compile_sets_the_mark_torch_sets():
    """attnkit marks ``available()`` and the linear kernels' thread count as torch's
    ``assume_constant_result`` would, without importing torch._dynamo at import time;
    the marks must stay the ones torch's decorator sets."""
    from attnkit.kernels.compile_constant import constant_for_compile

    def ours():
        return 1

    def theirs():
        return 1

    constant_for_compile(ours)
    torch.compiler.assume_constant_result(theirs)
    assert vars(ours) == vars(theirs) and vars(theirs)
