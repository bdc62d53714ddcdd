"""The C++ operators' boundary: torch.ops.attnkit.* are public, so each one refuses bad
shapes, dtypes, devices, layouts and integer arguments with a RuntimeError that names the
argument, and never crashes or reads out of bounds.

Every call runs in a child process (a segfault or a sanitizer's abort fails one case,
not pytest), all cases in as few children as possible: a child runs the cases in order
and reports each; when one kills it, the next child starts after that case. A valid call
of each operator runs beside its bad ones, so a check that refuses good input fails too.
scripts/asan.sh runs this file against an AddressSanitizer build of the operators.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from attnkit.kernels.cpu import build

pytestmark = pytest.mark.skipif(not build.available(), reason="the C++ operators are not built here")

#: the child: builds each case's call from the helpers below and reports one line per case
CHILD = textwrap.dedent("""
    import json, math, sys
    import torch
    from attnkit.kernels.cpu import build
    assert build.available(), build.status().reason
    torch.manual_seed(0)
    ops = torch.ops.attnkit
    inf, nan = math.inf, math.nan

    def f(*shape, dtype=torch.float32):
        return torch.randn(*shape, dtype=dtype)

    def i64(*values):
        return torch.tensor(values, dtype=torch.int64)

    NSA = dict(q=(1, 2, 8, 4), k=(1, 1, 16, 4), v=(1, 1, 16, 3), k_cmp=(1, 1, 7, 4), v_cmp=(1, 1, 7, 3),
               gates=(1, 2, 8, 3))
    NSA_INTS = dict(scale=0.5, compress_block=4, compress_stride=2, select_block=4, width=3, initial=1, local=2,
                    window=4, rescale_above=8.0, select_chunk=4, tile_rows=16, span_rows=64, window_block=4)

    def nsa(**over):
        t = {name: over.pop(name) if name in over else f(*shape) for name, shape in NSA.items()}
        a = {**NSA_INTS, **over}
        return ops.nsa_forward(t["q"], t["k"], t["v"], t["k_cmp"], t["v_cmp"], t["gates"], *a.values())

    def mixed(q=None, k=None, v=None, conv=None, pre=None, post=None, group=1, q_start=0, lo=None, hi=0, bq=32, bk=64):
        q = f(1, 4, 9, 8) if q is None else q
        k = f(1, 2, 9, 8) if k is None else k
        v = f(1, 2, 9, 6) if v is None else v
        return ops.mixed_softmax_attention(q, k, v, conv, pre, post, group, q_start, lo, hi, bq, bk)

    def mixed_back(grad_out=None, lse=None, grad_lse=None, conv=None, pre=None, post=None, group=1):
        q, k, v = f(1, 4, 9, 8), f(1, 2, 9, 8), f(1, 2, 9, 6)
        grad_out = f(1, 4, 9, 6) if grad_out is None else grad_out
        lse = f(1, 4, 9) if lse is None else lse
        return ops.mixed_softmax_attention_backward(grad_out, q, k, v, lse, grad_lse, conv, pre, post, group, 0, None, 0,
                                                    16, 64)

    def slots(B=1, H=2, L=4, held=3):
        valid = torch.zeros(B, H, L, dtype=torch.bool)
        valid[..., :held] = True
        pos = torch.arange(L).expand(B, H, L).contiguous()
        return valid, pos

    for line in sys.stdin:
        name, code = json.loads(line)
        print(json.dumps(["start", name]), flush=True)
        try:
            exec(code, dict(globals()))
        except Exception as err:  # noqa: BLE001
            print(json.dumps(["raised", name, type(err).__name__, str(err).splitlines()[0] if str(err) else ""]),
                  flush=True)
        else:
            print(json.dumps(["ok", name]), flush=True)
""")

Q, K, V = "f(1, 2, 5, 4)", "f(1, 1, 6, 4)", "f(1, 1, 6, 3)"

#: (case, the call, a word its RuntimeError must contain; None: the call must succeed)
CASES: list[tuple[str, str, str | None]] = [
    # ---- sigmoid attention
    ("sigmoid/good", f"ops.sigmoid_attention({Q}, {K}, {V}, 0.5, -1.0, 1, None, 0)", None),
    ("sigmoid/k-head-size", f"ops.sigmoid_attention({Q}, f(1, 1, 6, 5), {V}, 0.5, 0.0, 0, None, None)", "k must have shape"),
    (
        "sigmoid/k-head-size-larger",
        f"ops.sigmoid_attention({Q}, f(1, 1, 6, 64), {V}, 0.5, 0.0, 0, None, None)",
        "k must have shape",
    ),
    ("sigmoid/v-heads", f"ops.sigmoid_attention({Q}, {K}, f(1, 2, 6, 3), 0.5, 0.0, 0, None, None)", "v must have shape"),
    ("sigmoid/v-length", f"ops.sigmoid_attention({Q}, {K}, f(1, 1, 7, 3), 0.5, 0.0, 0, None, None)", "v must have shape"),
    ("sigmoid/batch", f"ops.sigmoid_attention({Q}, f(2, 1, 6, 4), {V}, 0.5, 0.0, 0, None, None)", "k must have shape"),
    (
        "sigmoid/heads-not-dividing",
        "ops.sigmoid_attention(f(1, 3, 5, 4), f(1, 2, 6, 4), f(1, 2, 6, 3), 0.5, 0.0, 0, None, None)",
        "k must have a number of heads",
    ),
    (
        "sigmoid/zero-kv-heads",
        f"ops.sigmoid_attention({Q}, f(1, 0, 6, 4), f(1, 0, 6, 3), 0.5, 0.0, 0, None, None)",
        "k must have a number of heads",
    ),
    (
        "sigmoid/dtype",
        f"ops.sigmoid_attention(f(1, 2, 5, 4, dtype=torch.float64), {K}, {V}, 0.5, 0.0, 0, None, None)",
        "q must be Float",
    ),
    ("sigmoid/dims", f"ops.sigmoid_attention(f(2, 5, 4), {K}, {V}, 0.5, 0.0, 0, None, None)", "q must have 4 dimensions"),
    ("sigmoid/q_start", f"ops.sigmoid_attention({Q}, {K}, {V}, 0.5, 0.0, 2**62, None, 0)", "q_start"),
    ("sigmoid/lo", f"ops.sigmoid_attention({Q}, {K}, {V}, 0.5, 0.0, 0, -2**62, 0)", "lo must be in"),
    ("sigmoid/hi", f"ops.sigmoid_attention({Q}, {K}, {V}, 0.5, 0.0, 0, None, 2**62)", "hi must be in"),
    ("sigmoid-back/good", f"ops.sigmoid_attention_backward(f(1, 2, 5, 3), {Q}, {K}, {V}, 0.5, -1.0, 1, None, 0)", None),
    (
        "sigmoid-back/grad_out",
        f"ops.sigmoid_attention_backward(f(1, 2, 5, 4), {Q}, {K}, {V}, 0.5, 0.0, 0, None, 0)",
        "grad_out must have shape",
    ),
    (
        "sigmoid-back/v-heads",
        f"ops.sigmoid_attention_backward(f(1, 2, 5, 3), {Q}, {K}, f(1, 2, 6, 3), 0.5, 0.0, 0, None, 0)",
        "v must have shape",
    ),
    (
        "sigmoid-back/k-head-size",
        f"ops.sigmoid_attention_backward(f(1, 2, 5, 3), {Q}, f(1, 1, 6, 9), {V}, 0.5, 0.0, 0, None, 0)",
        "k must have shape",
    ),
    # ---- softmax attention with head maps
    ("softmax/good", f"ops.softmax_attention({Q}, {K}, {V}, 0.5, 1, None, 0, 0.0, None, None)", None),
    ("softmax/good-boost", f"ops.softmax_attention({Q}, {K}, {V}, 0.5, 1, None, 0, 0.0, None, None, f(1, 2, 6).abs())", None),
    (
        "softmax/boost-shape",
        f"ops.softmax_attention({Q}, {K}, {V}, 0.5, 1, None, 0, 0.0, None, None, f(1, 2, 5))",
        "boost must have shape",
    ),
    (
        "softmax/boost-dtype",
        f"ops.softmax_attention({Q}, {K}, {V}, 0.5, 1, None, 0, 0.0, None, None, f(1, 2, 6, dtype=torch.float64))",
        "boost must be Float",
    ),
    (
        "softmax/good-maps",
        "ops.softmax_attention(f(1, 2, 5, 4), f(1, 4, 6, 4), f(1, 3, 6, 2), 0.5, 0, None, None, 30.0, i64(3, 1), i64(0, 2))",
        None,
    ),
    (
        "softmax/k-head-size",
        f"ops.softmax_attention({Q}, f(1, 1, 6, 8), {V}, 0.5, 0, None, None, 0.0, None, None)",
        "k must have shape",
    ),
    (
        "softmax/more-key-heads",
        "ops.softmax_attention(f(1, 2, 5, 4), f(1, 4, 6, 4), f(1, 1, 6, 3), 0.5, 0, None, None, 0.0, None, None)",
        "k_heads",
    ),
    (
        "softmax/more-value-heads",
        "ops.softmax_attention(f(1, 2, 5, 4), f(1, 1, 6, 4), f(1, 3, 6, 3), 0.5, 0, None, None, 0.0, None, None)",
        "v_heads",
    ),
    (
        "softmax/zero-key-heads",
        "ops.softmax_attention(f(1, 2, 5, 4), f(1, 0, 6, 4), f(1, 1, 6, 3), 0.5, 0, None, None, 0.0, None, None)",
        "k's heads",
    ),
    ("softmax/map-range", f"ops.softmax_attention({Q}, {K}, {V}, 0.5, 0, None, None, 0.0, i64(0, 1), None)", "k_heads"),
    ("softmax/map-negative", f"ops.softmax_attention({Q}, {K}, {V}, 0.5, 0, None, None, 0.0, None, i64(0, -1))", "v_heads"),
    ("softmax/map-length", f"ops.softmax_attention({Q}, {K}, {V}, 0.5, 0, None, None, 0.0, i64(0, 0, 0), None)", "k_heads"),
    ("softmax/map-dtype", f"ops.softmax_attention({Q}, {K}, {V}, 0.5, 0, None, None, 0.0, torch.zeros(2), None)", "k_heads"),
    (
        "softmax/v-length",
        f"ops.softmax_attention({Q}, {K}, f(1, 1, 4, 3), 0.5, 0, None, None, 0.0, None, None)",
        "v must have shape",
    ),
    (
        "softmax/dtype",
        f"ops.softmax_attention({Q}, f(1, 1, 6, 4, dtype=torch.float16), {V}, 0.5, 0, None, None, 0.0, None, None)",
        "k must be Float",
    ),
    ("softmax/softcap", f"ops.softmax_attention({Q}, {K}, {V}, 0.5, 0, None, None, -1.0, None, None)", "softcap"),
    ("softmax/softcap-nan", f"ops.softmax_attention({Q}, {K}, {V}, 0.5, 0, None, None, nan, None, None)", "softcap"),
    # ---- top-k attention
    ("topk/good", f"ops.topk_attention({Q}, {K}, {V}, 1, None, 0, 3)", None),
    ("topk/width-wider-than-keys", f"ops.topk_attention({Q}, {K}, {V}, 1, None, 0, 10)", None),
    ("topk/width", f"ops.topk_attention({Q}, {K}, {V}, 0, None, 0, 0)", "width"),
    ("topk/v-heads", f"ops.topk_attention({Q}, {K}, f(1, 2, 6, 3), 0, None, 0, 2)", "v must have shape"),
    ("topk/k-head-size", f"ops.topk_attention({Q}, f(1, 1, 6, 3), {V}, 0, None, 0, 2)", "k must have shape"),
    # ---- mixed (convolution, head mixing)
    ("mixed/good-conv", "mixed(conv=f(4, 2, 3))", None),
    ("mixed/good-mixing", "mixed(pre=f(4, 4), post=f(4, 4), group=2)", None),
    ("mixed/k-head-size", "mixed(k=f(1, 2, 9, 7))", "k must have shape"),
    ("mixed/v-heads", "mixed(v=f(1, 4, 9, 6))", "v must have shape"),
    ("mixed/group-zero", "mixed(group=0)", "group"),
    ("mixed/group-not-dividing", "mixed(pre=f(4, 4), group=3)", "group"),
    ("mixed/conv-heads", "mixed(conv=f(3, 2, 3))", "conv must have shape"),
    ("mixed/conv-no-taps", "mixed(conv=f(4, 0, 3))", "conv's query taps"),
    ("mixed/conv-dims", "mixed(conv=f(4, 3))", "conv must have 3 dimensions"),
    ("mixed/conv-and-pre", "mixed(conv=f(4, 2, 3), pre=f(4, 4))", "conv and pre"),
    ("mixed/pre-shape", "mixed(pre=f(4, 3))", "pre must have shape"),
    ("mixed/post-shape", "mixed(post=f(2, 4))", "post must have shape"),
    ("mixed/post-dtype", "mixed(post=f(4, 4, dtype=torch.float64))", "post must be Float"),
    ("mixed/block_q", "mixed(bq=0)", "block_q"),
    ("mixed/block_k", "mixed(bk=-4)", "block_k"),
    ("mixed/q_start", "mixed(q_start=-2**60)", "q_start"),
    ("mixed-back/good", "mixed_back(conv=f(4, 2, 3), grad_lse=f(1, 4, 9))", None),
    ("mixed-back/grad_out", "mixed_back(grad_out=f(1, 4, 9, 8))", "grad_out must have shape"),
    ("mixed-back/lse", "mixed_back(lse=f(1, 4, 3))", "lse must have shape"),
    ("mixed-back/lse-dims", "mixed_back(lse=f(4, 9))", "lse must have 3 dimensions"),
    ("mixed-back/grad_lse", "mixed_back(grad_lse=f(1, 4, 2))", "grad_lse must have shape"),
    ("mixed-back/grad_lse-dtype", "mixed_back(grad_lse=f(1, 4, 9, dtype=torch.float64))", "grad_lse must be Float"),
    # ---- native sparse attention
    ("nsa/good", "nsa()", None),
    ("nsa/good-no-compressed", "nsa(k_cmp=f(1, 1, 0, 4), v_cmp=f(1, 1, 0, 3))", None),
    ("nsa/k-head-size", "nsa(k=f(1, 1, 16, 6))", "k must have shape"),
    ("nsa/k_cmp-dims", "nsa(k_cmp=f(1, 7, 4))", "k_cmp must have 4 dimensions"),
    ("nsa/k_cmp-head-size", "nsa(k_cmp=f(1, 1, 7, 5))", "k_cmp must have shape"),
    ("nsa/k_cmp-heads", "nsa(k_cmp=f(1, 2, 7, 4))", "k_cmp must have shape"),
    ("nsa/v_cmp-length", "nsa(v_cmp=f(1, 1, 6, 3))", "v_cmp must have shape"),
    ("nsa/v_cmp-size", "nsa(v_cmp=f(1, 1, 7, 4))", "v_cmp must have shape"),
    ("nsa/gates", "nsa(gates=f(1, 2, 8, 2))", "gates must have shape"),
    ("nsa/queries-after-keys", "nsa(q=f(1, 2, 17, 4), gates=f(1, 2, 17, 3))", "q must hold the last"),
    ("nsa/select_block-zero", "nsa(select_block=0)", "select_block"),
    ("nsa/select_chunk-zero", "nsa(select_chunk=0)", "select_chunk"),
    ("nsa/compress_stride-zero", "nsa(compress_stride=0)", "compress_stride"),
    ("nsa/compress_block-zero", "nsa(compress_block=0)", "compress_block"),
    ("nsa/compress_block-multiple", "nsa(compress_block=5)", "compress_block must be a multiple"),
    ("nsa/select_block-multiple", "nsa(select_block=3)", "select_block must be a multiple"),
    ("nsa/width-zero", "nsa(width=0, initial=0, local=1)", "width"),
    ("nsa/forced-over-width", "nsa(width=2, initial=1, local=2)", "width must hold the forced blocks"),
    (
        "nsa/good-forced-over-blocks",
        "nsa(k=f(1, 1, 8, 4), v=f(1, 1, 8, 3), k_cmp=f(1, 1, 3, 4), v_cmp=f(1, 1, 3, 3), width=2, initial=2, local=2)",
        None,
    ),
    ("nsa/initial-negative", "nsa(initial=-1)", "initial"),
    ("nsa/local-zero", "nsa(local=0)", "local"),
    ("nsa/window-zero", "nsa(window=0)", "window"),
    ("nsa/tile_rows-zero", "nsa(tile_rows=0)", "tile_rows"),
    ("nsa/span_rows-zero", "nsa(span_rows=0)", "span_rows"),
    ("nsa/window_block-zero", "nsa(window_block=0)", "window_block"),
    ("nsa/rescale_above-nan", "nsa(rescale_above=nan)", "rescale_above"),
    ("nsa/dtype", "nsa(gates=f(1, 2, 8, 3, dtype=torch.float64))", "gates must be Float"),
    # ---- pointwise tile steps
    (
        "pointwise/good",
        "x = f(3, 5); ops.sigmoid_(x, 0.5); ops.softcap_(x, 2.0); m, l = f(3), f(3).abs(); "
        "ops.online_softmax_(f(3, 5), m, l); ops.stick_breaking_(f(3, 5), torch.ones(3)); "
        "ops.stick_breaking_backward_(f(3, 5), f(3, 5), torch.ones(3), f(3), f(3)); "
        "ops.depthwise_conv2d(f(2, 3, 6, 7), f(3, 2, 3)); ops.depthwise_conv2d_weight_grad(f(2, 3, 6, 7), f(2, 3, 5, 5), 2, 3); "
        "ops.topk_rows(f(4, 9), 3); ops.mix_heads(f(2, 3), f(2, 3, 4, 5), f(2, 3, 4)); ops.abs_boost_(f(2, 3, 5), f(2, 5))",
        None,
    ),
    ("sigmoid_/non-contiguous", "ops.sigmoid_(f(5, 3).t(), 0.0)", "x must be contiguous"),
    ("sigmoid_/dtype", "ops.sigmoid_(f(5, 3, dtype=torch.float64), 0.0)", "x must be Float"),
    ("softcap_/cap", "ops.softcap_(f(5, 3), 0.0)", "cap"),
    ("softcap_/cap-nan", "ops.softcap_(f(5, 3), nan)", "cap"),
    ("abs_boost_/columns", "ops.abs_boost_(f(2, 3, 5), f(2, 4))", "columns"),
    ("abs_boost_/groups", "ops.abs_boost_(f(3, 5), f(2, 5))", "groups of rows"),
    ("abs_boost_/t-dims", "ops.abs_boost_(f(2, 3, 5), f(10))", "t must have 2 dimensions"),
    ("abs_boost_/t-layout", "ops.abs_boost_(f(2, 5), f(5, 2).t())", "t must be contiguous"),
    ("abs_boost_/s-layout", "ops.abs_boost_(f(5, 2).t(), f(1, 5))", "s must be contiguous"),
    ("online_softmax_/m", "ops.online_softmax_(f(3, 5), f(2), f(3))", "m must hold"),
    ("online_softmax_/l", "ops.online_softmax_(f(3, 5), f(3), f(4))", "l must hold"),
    ("online_softmax_/s-layout", "ops.online_softmax_(f(5, 3).t(), f(3), f(3))", "s must be contiguous"),
    ("stick_breaking_/carry", "ops.stick_breaking_(f(3, 5), f(2))", "carry must hold"),
    ("stick_breaking_backward_/dw", "ops.stick_breaking_backward_(f(3, 5), f(3, 4), f(3), f(3), f(3))", "dw must have"),
    ("stick_breaking_backward_/delta", "ops.stick_breaking_backward_(f(3, 5), f(3, 5), f(3), f(3), f(2))", "delta must hold"),
    ("stick_breaking_backward_/carry_w", "ops.stick_breaking_backward_(f(3, 5), f(3, 5), f(3), f(1), f(3))", "carry_w must hold"),
    ("depthwise_conv2d/weight-heads", "ops.depthwise_conv2d(f(2, 3, 6, 7), f(2, 2, 3))", "weight"),
    ("depthwise_conv2d/weight-no-taps", "ops.depthwise_conv2d(f(2, 3, 6, 7), f(3, 0, 3))", "weight"),
    ("depthwise_conv2d/x-dims", "ops.depthwise_conv2d(f(3, 6, 7), f(3, 2, 3))", "x must have 4 dimensions"),
    ("depthwise_conv2d_weight_grad/cq", "ops.depthwise_conv2d_weight_grad(f(2, 3, 6, 7), f(2, 3, 7, 5), 0, 3)", "cq"),
    ("depthwise_conv2d_weight_grad/ck", "ops.depthwise_conv2d_weight_grad(f(2, 3, 6, 7), f(2, 3, 5, 8), 2, -1)", "ck"),
    (
        "depthwise_conv2d_weight_grad/dy",
        "ops.depthwise_conv2d_weight_grad(f(2, 3, 6, 7), f(2, 3, 5, 6), 2, 3)",
        "dy must have shape",
    ),
    ("topk_rows/k-zero", "ops.topk_rows(f(4, 9), 0)", "k must be in"),
    ("topk_rows/k-over", "ops.topk_rows(f(4, 9), 10)", "k must be in"),
    ("topk_rows/dims", "ops.topk_rows(torch.tensor(1.0), 1)", "s must have at least one dimension"),
    ("mix_heads/mix", "ops.mix_heads(f(2, 4), f(2, 3, 4, 5), None)", "mix must be"),
    ("mix_heads/too-many-heads", "ops.mix_heads(f(2, 65), f(1, 65, 2, 2), None)", "mix must be"),
    ("mix_heads/row_scale", "ops.mix_heads(f(2, 3), f(2, 3, 4, 5), f(2, 3, 5))", "row_scale must be"),
    # ---- KV cache steps (kv.cpp, kv_attention.cpp)
    (
        "kv_evict/good",
        "valid, pos = slots(); ops.kv_evict_lowest(f(1, 4, 4), valid, pos, i64(2, 2).view(1, 2), "
        "torch.zeros(1, 2, 4, dtype=torch.float64), 1, 0.5)",
        None,
    ),
    (
        "kv_evict/mode",
        "valid, pos = slots(); ops.kv_evict_lowest(f(1, 2, 4), valid, pos, i64(2, 2).view(1, 2), None, 2, 0.0)",
        "mode",
    ),
    (
        "kv_evict/recent",
        "valid, pos = slots(); ops.kv_evict_lowest(f(1, 2, 4), valid, pos, i64(1, 1).view(1, 2), "
        "torch.zeros(1, 2, 4, dtype=torch.float64), 1, 2.0)",
        "recent",
    ),
    (
        "kv_evict/capacity-negative",
        "valid, pos = slots(); ops.kv_evict_lowest(f(1, 2, 4), valid, pos, "
        "i64(-3, 2).view(1, 2), torch.zeros(1, 2, 4, dtype=torch.float64), 1, 0.5)",
        "capacity",
    ),
    (
        "kv_evict/capacity-shape",
        "valid, pos = slots(); ops.kv_evict_lowest(f(1, 2, 4), valid, pos, i64(2, 2), None, 0, 0.0)",
        "capacity",
    ),
    (
        "kv_evict/valid-dtype",
        "valid, pos = slots(); ops.kv_evict_lowest(f(1, 2, 4), valid.long(), pos, i64(2, 2).view(1, 2), None, 0, 0.0)",
        "valid",
    ),
    (
        "kv_evict/mass",
        "valid, pos = slots(); ops.kv_evict_lowest(f(1, 3, 4), valid, pos, i64(2, 2).view(1, 2), None, 0, 0.0)",
        "mass",
    ),
    (
        "kv_evict/pos-not-distinct",
        "valid, pos = slots(H=1); pos.fill_(2**63 - 1); "
        "ops.kv_evict_lowest(f(1, 1, 4), valid, pos, i64(2).view(1, 1), None, 0, 0.0)",
        "pos",
    ),
    (
        "kv_fill/good",
        "valid, pos = slots(); keys, values = f(1, 2, 4, 3), f(1, 2, 4, 5); "
        "ops.kv_fill_hole(keys, values, valid, pos, None, None, f(1, 2, 1, 3), f(1, 2, 1, 5), i64(7), 7)",
        None,
    ),
    (
        "kv_fill/rope_new",
        "valid, pos = slots(); ops.kv_fill_hole(f(1, 2, 4, 3), f(1, 2, 4, 5), valid, pos, None, None, "
        "f(1, 2, 1, 3), f(1, 2, 1, 5), i64(7, 8), 7)",
        "rope_new",
    ),
    (
        "kv_fill/keys",
        "valid, pos = slots(); ops.kv_fill_hole(f(1, 2, 3, 3), f(1, 2, 4, 5), valid, pos, None, None, "
        "f(1, 2, 1, 3), f(1, 2, 1, 5), i64(7), 7)",
        "keys",
    ),
    (
        "kv_fill/key_new",
        "valid, pos = slots(); ops.kv_fill_hole(f(1, 2, 4, 3), f(1, 2, 4, 5), valid, pos, None, None, "
        "f(1, 2, 1, 4), f(1, 2, 1, 5), i64(7), 7)",
        "new key",
    ),
    (
        "kv_fill/full",
        "valid, pos = slots(held=4); ops.kv_fill_hole(f(1, 2, 4, 3), f(1, 2, 4, 5), valid, pos, None, None, "
        "f(1, 2, 1, 3), f(1, 2, 1, 5), i64(7), 7)",
        "no empty slot",
    ),
    (
        "kv_step/good",
        "ops.kv_step_attention(f(1, 4, 1, 8), f(1, 2, 5, 8), f(1, 2, 5, 6), torch.zeros(1, 2, 5, dtype=torch.bool), 0.3)",
        None,
    ),
    ("kv_step/keys-head-size", "ops.kv_step_attention(f(1, 4, 1, 8), f(1, 2, 5, 7), f(1, 2, 5, 6), None, 0.3)", "keys"),
    (
        "kv_step/hide",
        "ops.kv_step_attention(f(1, 4, 1, 8), f(1, 2, 5, 8), f(1, 2, 5, 6), torch.zeros(1, 2, 4, dtype=torch.bool), 0.3)",
        "hide",
    ),
    ("kv_step/query-tokens", "ops.kv_step_attention(f(1, 4, 2, 8), f(1, 2, 5, 8), f(1, 2, 5, 6), None, 0.3)", "query"),
    ("rows/good", "ops.rows_attention(f(2, 4, 3, 8), f(2, 2, 5, 8), f(2, 2, 5, 6), 0.3)", None),
    ("rows/query-dims", "ops.rows_attention(f(4, 3, 8), f(2, 2, 5, 8), f(2, 2, 5, 6), 0.3)", "query"),
    ("rows/keys-head-size", "ops.rows_attention(f(2, 4, 3, 8), f(2, 2, 5, 7), f(2, 2, 5, 6), 0.3)", "keys"),
    ("rows/heads", "ops.rows_attention(f(2, 3, 3, 8), f(2, 2, 5, 8), f(2, 2, 5, 6), 0.3)", "keys"),
    ("rows/values-length", "ops.rows_attention(f(2, 4, 3, 8), f(2, 2, 5, 8), f(2, 2, 4, 6), 0.3)", "values"),
    ("rows/dtype", "ops.rows_attention(f(2, 4, 3, 8), f(2, 2, 5, 8).double(), f(2, 2, 5, 6), 0.3)", "dtype"),
    ("rows/empty", "ops.rows_attention(f(2, 4, 3, 8), f(2, 2, 0, 8), f(2, 2, 0, 6), 0.3)", None),
    ("kv_prefill/good", "ops.kv_prefill_attention(f(2, 4, 5, 8), f(2, 2, 5, 8), f(2, 2, 5, 6), 0.3, i64(0, 2))", None),
    ("kv_prefill/start", "ops.kv_prefill_attention(f(2, 4, 5, 8), f(2, 2, 5, 8), f(2, 2, 5, 6), 0.3, i64(0, 6))", "start"),
    ("kv_prefill/k", "ops.kv_prefill_attention(f(2, 4, 5, 8), f(2, 2, 5, 7), f(2, 2, 5, 6), 0.3, i64(0, 2))", "k (B"),
    (
        "kv_packed/good",
        "ops.kv_packed_attention(f(1, 4, 1, 8), f(6, 8), f(6, 5), torch.tensor([[[0, 1, 5], [2, 3, 5]]], "
        "dtype=torch.int32), 5, 0.3)",
        None,
    ),
    (
        "kv_packed/source-row",
        "ops.kv_packed_attention(f(1, 4, 1, 8), f(6, 8), f(6, 5), torch.tensor([[[0, 1, 9], "
        "[2, 3, 5]]], dtype=torch.int32), 5, 0.3)",
        "source",
    ),
    (
        "kv_packed/k_rows",
        "ops.kv_packed_attention(f(1, 4, 1, 8), f(6, 7), f(6, 5), torch.zeros(1, 2, 3, dtype=torch.int32), 5, 0.3)",
        "k_rows",
    ),
    (
        "kv_quest/good",
        "ops.kv_quest_attention(f(1, 4, 1, 8), f(1, 2, 9, 8), f(1, 2, 9, 6), torch.zeros(1, 2, 3, 8, "
        "dtype=torch.float64), torch.zeros(1, 2, 3, 8, dtype=torch.float64), torch.ones(1, 2, 3, dtype=torch.bool), "
        "i64(8), 4, 8, False, 0.3, True)",
        None,
    ),
    (
        "kv_quest/page_size",
        "ops.kv_quest_attention(f(1, 4, 1, 8), f(1, 2, 9, 8), f(1, 2, 9, 6), torch.zeros(1, 2, 3, 8, "
        "dtype=torch.float64), torch.zeros(1, 2, 3, 8, dtype=torch.float64), torch.ones(1, 2, 3, dtype=torch.bool), "
        "i64(8), 0, 8, False, 0.3, True)",
        "page_size",
    ),
    (
        "kv_quest/kmin",
        "ops.kv_quest_attention(f(1, 4, 1, 8), f(1, 2, 9, 8), f(1, 2, 9, 6), torch.zeros(1, 2, 3, 8), "
        "torch.zeros(1, 2, 3, 8, dtype=torch.float64), torch.ones(1, 2, 3, dtype=torch.bool), i64(8), 4, 8, False, 0.3, "
        "True)",
        "kmin",
    ),
    (
        "kv_quest/has",
        "ops.kv_quest_attention(f(1, 4, 1, 8), f(1, 2, 9, 8), f(1, 2, 9, 6), torch.zeros(1, 2, 3, 8, "
        "dtype=torch.float64), torch.zeros(1, 2, 3, 8, dtype=torch.float64), torch.ones(1, 2, 1, dtype=torch.bool), "
        "i64(8), 4, 8, False, 0.3, True)",
        "has",
    ),
    (
        "kv_quest/budget",
        "ops.kv_quest_attention(f(1, 4, 1, 8), f(1, 2, 9, 8), f(1, 2, 9, 6), torch.zeros(1, 2, 3, 8, "
        "dtype=torch.float64), torch.zeros(1, 2, 3, 8, dtype=torch.float64), torch.ones(1, 2, 3, dtype=torch.bool), "
        "i64(8, 8), 4, 8, False, 0.3, True)",
        "budget",
    ),
    (
        "kv_quest/keys-short",
        "ops.kv_quest_attention(f(1, 4, 1, 8), f(1, 2, 8, 8), f(1, 2, 8, 6), torch.zeros(1, 2, 3, 8, "
        "dtype=torch.float64), torch.zeros(1, 2, 3, 8, dtype=torch.float64), torch.ones(1, 2, 3, dtype=torch.bool), "
        "i64(8), 4, 8, False, 0.3, True)",
        "keys",
    ),
    # ---- the private helpers
    ("_gemm_mode/range", "ops._gemm_mode(7)", "mode"),
    ("_threads_used/range", "ops._threads_used(0)", "parts"),
]


def _run_all() -> dict[str, list]:
    """Each case's report: ["ok"], ["raised", type, message] or ["crashed", how]."""
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    results: dict[str, list] = {}
    todo = list(CASES)
    while todo:
        lines = "".join(json.dumps([name, code]) + "\n" for name, code, _ in todo)
        proc = subprocess.run([sys.executable, "-c", CHILD], input=lines, capture_output=True, text=True, timeout=300, env=env)
        started = None
        for line in proc.stdout.splitlines():
            if not line.startswith("["):
                continue
            report = json.loads(line)
            if report[0] == "start":
                started = report[1]
            else:
                results[report[1]] = report[:1] + report[2:]
                started = None
        done = {name for name, _, _ in todo if name in results}
        if started is None and len(done) < len(todo):  # died before its first case: nothing more to learn
            for name, _, _ in todo:
                results.setdefault(name, ["crashed", f"rc {proc.returncode}: {proc.stderr[-2000:]}"])
            break
        if started is not None:  # this case killed the child: report it, go on after it
            results[started] = ["crashed", f"rc {proc.returncode}: {proc.stderr[-2000:]}"]
        todo = [case for case in todo if case[0] not in results]
    return results


@pytest.fixture(scope="module")
def reports() -> dict[str, list]:
    return _run_all()


def test_every_operator_is_covered() -> None:
    """Each registered operator of the namespace has a case here (a new one must add its own)."""
    import torch

    registered = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("attnkit::")}
    covered = {"nsa_forward", "mixed_softmax_attention", "mixed_softmax_attention_backward"}  # the child's helpers
    for _, code, _ in CASES:
        covered |= {part.split("(")[0] for part in code.split("ops.")[1:]}
    assert registered <= covered, f"operators without a boundary case: {sorted(registered - covered)}"


@pytest.mark.parametrize(("name", "code", "expect"), CASES, ids=[c[0] for c in CASES])
def test_boundary(reports: dict[str, list], name: str, code: str, expect: str | None) -> None:
    report = reports[name]
    assert report[0] != "crashed", f"{name}: the call crashed the process: {report[1]}"
    if expect is None:
        assert report[0] == "ok", f"{name}: a valid call was refused: {report}"
        return
    assert report[0] == "raised", f"{name}: a bad call was accepted: {code}"
    kind, message = report[1], report[2]
    assert kind == "RuntimeError", f"{name}: expected a RuntimeError, got {kind}: {message}"
    assert expect in message, f"{name}: the message should name {expect!r}: {message}"
    assert message.startswith("attnkit:"), f"{name}: the message is not the operator's own check: {message}"
