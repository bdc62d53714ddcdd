"""C tile loops (kernels/native_pointwise.c, native_fused.c, native_mixed.c,
native_sparse.c), loaded through ctypes.

The tile loops spend as much time in chains of pointwise PyTorch kernels (sigmoid gates,
softcap's tanh, the online-softmax update, head mixing) as in their matmuls; the C loops
do each in one pass (numerics in native_common.h). Some loops go further and run whole
in C around the sgemm of the BLAS inside PyTorch (``fused_usable``), split over torch's
intra-op threads by head: sigmoid attention forward and backward, a softmax forward with
free head sizes, the top-k forward, softmax with a transform and head mixing (multi-token
attention, talking heads) forward and backward, NSA's branches.

The library is compiled once per source version and CPU with the host C compiler into
``$XDG_CACHE_HOME/attnkit`` (``~/.cache``); without a compiler, or with
``ATTNKIT_NATIVE=0``, every caller keeps its PyTorch path, which computes the same values.
Only float32, contiguous CPU tensors that autograd does not track qualify (``usable``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

Tensor = torch.Tensor

SOURCES = [Path(__file__).with_name(name) for name in ("native_common.h", "native_pointwise.c", "native_fused.c",
                                                         "native_sparse.c", "native_mixed.c")]


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnkit"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name.split()[0]):
            return name.split()[0]
    return None


def _build(target: Path) -> None:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Compile beside the target and rename: concurrent first uses never see half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [cc, "-O3", "-march=native", "-fPIC", "-shared", "-o", tmp, *(str(p) for p in SOURCES if p.suffix == ".c"), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[:500]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library, or None where it is disabled or cannot be built."""
    if os.environ.get("ATTNKIT_NATIVE", "1") == "0":
        return None
    source = b"".join(p.read_bytes() for p in SOURCES)
    # -march=native code is only valid on the CPU it was built for: key by the CPU too.
    digest = hashlib.sha256(source + torch.backends.cpu.get_cpu_capability().encode() + _cpu_model()).hexdigest()[:16]
    target = _cache_dir() / f"native-{digest}.so"
    try:
        if not target.exists():
            _build(target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return None
    f32p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.ak_sigmoid.argtypes = [f32p, i64, f32]
    lib.ak_softcap.argtypes = [f32p, f32p, i64, f32]
    lib.ak_online_softmax.argtypes = [f32p, i64, i64, f32p, f32p, f32p]
    lib.ak_mix_heads_scaled.argtypes = [f32p, f32p, f32p, f32p, i64, i64, i64, i64, i64]
    lib.ak_stick_breaking.argtypes = [f32p, i64, i64, f32p]
    lib.ak_stick_breaking_backward.argtypes = [f32p, f32p, i64, i64, f32p, f32p, f32p]
    lib.ak_stick_breaking_backward.restype = ctypes.c_int
    lib.ak_depthwise_conv2d.argtypes = [f32p, f32p, f32p, i64, i64, i64, i64, i64, i64]
    lib.ak_depthwise_conv2d_weight_grad.argtypes = [f32p, f32p, f32p, i64, i64, i64, i64, i64, i64]
    lib.ak_depthwise_conv2d_weight_grad.restype = None
    for fn in (lib.ak_sigmoid, lib.ak_softcap, lib.ak_online_softmax, lib.ak_mix_heads_scaled, lib.ak_depthwise_conv2d):
        fn.restype = None
    lib.ak_stick_breaking.restype = ctypes.c_int
    lib.ak_sigmoid_attention.argtypes = [f32p, f32p, f32p, f32p, i64, i64, i64, i64, i64, i64, i64, i64, f32, f32, i64,
                                         ctypes.c_int, i64, ctypes.c_int, i64, i64, i64, ctypes.c_void_p]
    lib.ak_sigmoid_attention.restype = ctypes.c_int
    lib.ak_sigmoid_attention_backward.argtypes = [f32p] * 7 + [i64] * 8 + [f32, f32, i64, ctypes.c_int, i64, ctypes.c_int,
                                                                          i64, i64, i64, ctypes.c_void_p]
    lib.ak_sigmoid_attention_backward.restype = ctypes.c_int
    lib.ak_softmax_attention.argtypes = [f32p] * 5 + [i64] * 5 + [f32p, f32p] + [i64] * 4 + [f32, f32, i64, ctypes.c_int, i64,
                                                                                      ctypes.c_int, i64, i64, i64, ctypes.c_void_p]
    lib.ak_softmax_attention.restype = ctypes.c_int
    lib.ak_topk_rows.argtypes = [f32p, i64, i64, i64, f32p, f32p]
    lib.ak_topk_attention.argtypes = [f32p] * 9 + [i64] * 9 + [ctypes.c_int, i64, ctypes.c_int, i64, i64, i64, ctypes.c_void_p]
    lib.ak_topk_attention.restype = ctypes.c_int
    lib.ak_topk_rows.restype = ctypes.c_int
    # native_sparse.c (NSA)
    lib.ak_nsa_select.argtypes = [f32p] * 7 + [i64] * 9 + [f32] + [i64] * 7 + [ctypes.c_void_p]
    lib.ak_nsa_select.restype = ctypes.c_int
    lib.ak_nsa_selected.argtypes = [f32p] * 7 + [i64] * 8 + [i64, i64, f32, f32, i64, i64, ctypes.c_void_p]
    lib.ak_nsa_selected.restype = ctypes.c_int
    lib.ak_nsa_window.argtypes = [f32p] * 6 + [i64] * 8 + [f32, i64, i64, ctypes.c_void_p]
    lib.ak_nsa_window.restype = ctypes.c_int
    # native_mixed.c
    lib.ak_mixed_softmax_attention.argtypes = [f32p] * 8 + [i64] * 13 + [ctypes.c_int, i64, ctypes.c_int, i64, i64, i64,
                                                                      ctypes.c_void_p]
    lib.ak_mixed_softmax_attention.restype = ctypes.c_int
    lib.ak_mixed_softmax_attention_backward.argtypes = [f32p] * 15 + [i64] * 13 + [ctypes.c_int, i64, ctypes.c_int, i64, i64, i64,
                                                                               ctypes.c_void_p]
    lib.ak_mixed_softmax_attention_backward.restype = ctypes.c_int
    return lib


@functools.cache
def _torch_cpu() -> ctypes.CDLL | None:
    lib_dir = Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        if (lib_dir / name).exists():
            try:
                return ctypes.CDLL(str(lib_dir / name))
            except OSError:
                return None
    return None


@functools.cache
def sgemm() -> int | None:
    """Address of the Fortran ``sgemm_`` of the BLAS inside PyTorch (MKL in the x86 wheels),
    so the fused C kernels multiply as fast as torch does; None where it is not exported."""
    lib = _torch_cpu()
    fn = getattr(lib, "sgemm_", None) if lib is not None else None
    return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value


def _set_blas_threads(n: int) -> int:
    """Set MKL's thread count for the calling thread only; returns the previous setting
    (0: none). The fused kernels run one thread per head range, and MKL splitting each
    small tile product across all cores again is many times slower."""
    lib = _torch_cpu()
    fn = getattr(lib, "MKL_Set_Num_Threads_Local", None) if lib is not None else None  # MKL's C interface (by value)
    if fn is None:
        return 0
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn(n)


_pools: dict[int, ThreadPoolExecutor] = {}


def _ranges(total: int, granule: int) -> list[tuple[int, int]]:
    """[0, total) cut into one range per thread of torch's intra-op pool (at most), each a
    multiple of ``granule`` long."""
    threads = torch.get_num_threads()
    units = total // granule
    parts = 1 if threads <= 1 or units <= 1 else min(threads, units)
    bounds = [granule * (units * i // parts) for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _run_parts(calls) -> None:
    """Run the C calls (thunks returning the C status; non-zero means out of memory), one
    per thread (ctypes releases the GIL), each with MKL held to one thread: MKL splitting
    each small tile product across all cores again is many times slower."""
    if len(calls) == 1:
        previous = _set_blas_threads(1)
        try:
            codes = [calls[0]()]
        finally:
            _set_blas_threads(previous)  # the caller's thread goes back to torch's setting
    else:
        parts = len(calls)
        pool = _pools.get(parts) or _pools.setdefault(parts, ThreadPoolExecutor(parts, initializer=_set_blas_threads, initargs=(1,)))
        codes = list(pool.map(lambda call: call(), calls))
    if any(codes):
        raise MemoryError("fused attention kernel: out of memory for a tile buffer")


def _over_heads(run, total: int, granule: int) -> None:
    """``run(bh0, bh1)`` over [0, total) query-head rows, split across torch's intra-op
    thread count in ranges aligned to ``granule``."""
    _run_parts([lambda u0=u0, u1=u1: run(u0, u1) for u0, u1 in _ranges(total, granule)])


def _cpu_model() -> bytes:
    """The CPU's model name and flags: a -march=native build is valid on that CPU only."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return b""
    first = {}
    for line in lines:
        key = line.split(b":")[0].strip()
        if key in (b"model name", b"flags", b"Features") and key not in first:
            first[key] = line
    return b"".join(first.values())


def _rows(s: Tensor) -> tuple[int, int]:
    """(rows, cols) of s seen as rows of its last dimension."""
    cols = s.shape[-1]
    return (s.numel() // cols if cols else 0), cols


def dense(t: Tensor | None) -> Tensor | None:
    """``t`` itself when it is contiguous, else a contiguous copy: the C loops index raw
    pointers as dense row-major arrays, so every tensor a wrapper below hands them goes
    through here (transposed, strided, expanded inputs and gradients included)."""
    return t if t is None or t.is_contiguous() else t.contiguous()


def _in_place(*tensors: Tensor) -> None:
    # In-place loops cannot copy: their callers check ``usable`` first.
    if not all(t.is_contiguous() for t in tensors):
        raise RuntimeError("attnkit native: an in-place C loop was given a non-contiguous tensor")


def usable(*tensors: Tensor) -> bool:
    """True when the C loops can run on these tensors in place of PyTorch's."""
    if library() is None:
        return False
    grad = torch.is_grad_enabled()
    return all(
        t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() and not (grad and t.requires_grad)
        for t in tensors
    )


def sigmoid_(x: Tensor, bias: float) -> Tensor:
    """``x <- sigmoid(x + bias)`` in place (-inf gives 0)."""
    _in_place(x)
    library().ak_sigmoid(x.data_ptr(), x.numel(), bias)
    return x


def softcap_(x: Tensor, cap: float) -> Tensor:
    """``x <- cap * tanh(x / cap)`` in place."""
    _in_place(x)
    library().ak_softcap(x.data_ptr(), x.data_ptr(), x.numel(), cap)
    return x


def online_softmax_step_(s: Tensor, m: Tensor, l: Tensor) -> Tensor:
    """One online-softmax tile update, rows being all leading dims of ``s``: ``s`` becomes
    exp(s - m'), ``m`` and ``l`` are updated in place; returns alpha = exp(m - m')."""
    _in_place(s, m, l)
    rows, cols = _rows(s)
    alpha = torch.empty_like(m)
    library().ak_online_softmax(s.data_ptr(), rows, cols, m.data_ptr(), l.data_ptr(), alpha.data_ptr())
    return alpha


def stick_breaking_(s: Tensor, carry: Tensor) -> Tensor:
    """One tile of stick-breaking weights, keys right to left: ``s`` (rows in all leading
    dims) becomes A, ``carry`` (one per row) the stick left for the tile on the left."""
    _in_place(s, carry)
    rows, cols = _rows(s)
    if library().ak_stick_breaking(s.data_ptr(), rows, cols, carry.data_ptr()) != 0:
        raise MemoryError("stick_breaking: out of memory for a tile buffer")
    return s


def stick_breaking_backward_(s: Tensor, dw: Tensor, carry: Tensor, carry_w: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
    """One tile of the stick-breaking backward, keys right to left: ``s`` becomes A and
    ``dw`` (dO V^T) becomes dz; ``carry`` (stick) and ``carry_w`` (sum of A dW to the right)
    move to the tile's left edge. ``delta`` = rowsum(dO * O), one per row."""
    _in_place(s, dw, carry, carry_w, delta)
    rows, cols = _rows(s)
    if library().ak_stick_breaking_backward(s.data_ptr(), dw.data_ptr(), rows, cols, carry.data_ptr(), carry_w.data_ptr(),
                                            delta.data_ptr()) != 0:
        raise MemoryError("stick_breaking: out of memory for a tile buffer")
    return s, dw


def depthwise_conv2d(x: Tensor, weight: Tensor) -> Tensor:
    """Valid depthwise 2-D correlation: x (N, H, R, C), weight (H, cq, ck) -> (N, H, R-cq+1, C-ck+1)."""
    x, weight = dense(x), dense(weight)
    N, H, R, C = x.shape
    cq, ck = weight.shape[-2:]
    y = torch.empty(N, H, max(R - cq + 1, 0), max(C - ck + 1, 0))
    library().ak_depthwise_conv2d(x.data_ptr(), weight.data_ptr(), y.data_ptr(), N, H, R, C, cq, ck)
    return y


#: the C head mixing keeps one row of coefficients on the stack
MAX_MIX_HEADS = 64


def topk_rows(s: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(values, columns) of the k largest entries of every row of s (1 <= k <= s.shape[-1]),
    unsorted; which of tied entries is kept is unspecified."""
    s = dense(s)
    rows, cols = _rows(s)
    values = torch.empty(*s.shape[:-1], k)
    columns = torch.empty(*s.shape[:-1], k, dtype=torch.int64)
    if library().ak_topk_rows(s.data_ptr(), rows, cols, k, values.data_ptr(), columns.data_ptr()) != 0:
        raise MemoryError("top-k: out of memory for a candidate buffer")
    return values, columns


def depthwise_conv2d_weight_grad(x: Tensor, dy: Tensor, kernel_size: tuple[int, int]) -> Tensor:
    """(H, cq, ck) gradient of ``depthwise_conv2d(x, weight)``'s weight for output gradient dy."""
    x, dy = dense(x), dense(dy)
    N, H, R, C = x.shape
    cq, ck = kernel_size
    dw = torch.empty(H, cq, ck)
    library().ak_depthwise_conv2d_weight_grad(x.data_ptr(), dy.data_ptr(), dw.data_ptr(), N, H, R, C, cq, ck)
    return dw


def mix_heads(mix: Tensor, x: Tensor, row_scale: Tensor | None = None) -> Tensor:
    """``out[:, g] = sum_h mix[g, h] * row_scale[:, h, :, None] * x[:, h]`` for x (Bt, H, R, C),
    mix (G, H) and row_scale (Bt, H, R) or None."""
    mix, x, row_scale = dense(mix), dense(x), dense(row_scale)
    bt, h, r, c = x.shape
    g = mix.shape[0]
    out = torch.empty((bt, g, r, c), dtype=x.dtype)
    scale = 0 if row_scale is None else row_scale.data_ptr()
    library().ak_mix_heads_scaled(mix.data_ptr(), x.data_ptr(), scale, out.data_ptr(), bt, g, h, r, c)
    return out


def fused_usable(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """True when a fused C attention kernel (C tile loops plus torch's own sgemm) can run."""
    return usable(q, k, v) and sgemm() is not None


#: (query rows, keys) of the fused kernels' tiles: one head's logits stay in L2
FUSED_TILE = (256, 256)


def _band_args(band: tuple[int | None, int | None]) -> tuple[int, int, int, int]:
    lo, hi = band
    return int(lo is not None), lo or 0, int(hi is not None), hi or 0


def sigmoid_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, bias: float, q_start: int,
                      band: tuple[int | None, int | None]) -> Tensor:
    """sigmoid(scale Q K^T + bias) V over the keys ``lo <= key - (q_start + query) <= hi``
    of ``band``; q (B, H, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) float32."""
    q, k, v = dense(q), dense(k), dense(v)
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    out = torch.empty(B, H, Nq, Dv)
    fn = library().ak_sigmoid_attention
    _over_heads(lambda bh0, bh1: fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), bh0, bh1, H, Hkv, Nq, Nk, D, Dv,
                                    scale, bias, q_start, *_band_args(band), *FUSED_TILE, sgemm()), B * H, 1)
    return out


def sigmoid_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float, bias: float, q_start: int,
                               band: tuple[int | None, int | None]) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of ``sigmoid_attention`` for ``grad_out`` (contiguous float32). Threads
    take whole GQA groups: the query heads of a group add into the same dk, dv."""
    grad_out, q, k, v = dense(grad_out), dense(q), dense(k), dense(v)
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    fn = library().ak_sigmoid_attention_backward
    ptrs = [t.data_ptr() for t in (q, k, v, grad_out, dq, dk, dv)]
    _over_heads(lambda bh0, bh1: fn(*ptrs, bh0, bh1, H, Hkv, Nq, Nk, D, Dv, scale, bias, q_start, *_band_args(band),
                                    *FUSED_TILE, sgemm()), B * H, H // Hkv)
    return dq, dk, dv


def softmax_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, q_start: int, band: tuple[int | None, int | None],
                      softcap: float = 0.0, k_heads: Tensor | None = None, v_heads: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(out, lse) of softmax(softcap(scale Q K^T)) V over the keys of ``band``, forward only.
    q (B, H, Nq, D), k (B, Hk, Nk, D), v (B, Hv, Nk, Dv) contiguous float32, D and Dv free;
    query head j reads key head ``k_heads[j]`` and value head ``v_heads[j]`` (default:
    grouped-query attention); ``softcap`` 0 means none."""
    q, k, v = dense(q), dense(k), dense(v)
    B, H, Nq, D = q.shape
    Hk, Nk, Hv, Dv = k.shape[1], k.shape[2], v.shape[1], v.shape[-1]
    heads = torch.arange(H)
    kidx = (heads // (H // Hk) if k_heads is None else k_heads).to(torch.int64).contiguous()
    vidx = (heads // (H // Hv) if v_heads is None else v_heads).to(torch.int64).contiguous()
    out, lse = torch.empty(B, H, Nq, Dv), torch.empty(B, H, Nq)
    fn = library().ak_softmax_attention
    ptrs = [t.data_ptr() for t in (q, k, v, out, lse)]
    _over_heads(lambda bh0, bh1: fn(*ptrs, bh0, bh1, H, Hk, Hv, kidx.data_ptr(), vidx.data_ptr(), Nq, Nk, D, Dv, scale, softcap,
                                    q_start, *_band_args(band), *FUSED_TILE, sgemm()), B * H, 1)
    return out, lse


#: query rows per block of the top-k kernel: their logits, rows x keys, stay in L2/L3
TOPK_BLOCK = 32


def topk_attention(q: Tensor, k: Tensor, v: Tensor, q_start: int, band: tuple[int | None, int | None], width: int):
    """Forward of softmax attention over the ``width`` largest logits of every row within
    ``band`` (q already scaled): (out, lse, chosen, weights, kept, visible) as in
    mechanisms/topk.py, float32."""
    q, k, v = dense(q), dense(k), dense(v)
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    out, lse = torch.empty(B, H, Nq, Dv), torch.empty(B, H, Nq)
    chosen = torch.empty(B, H, Nq, width, dtype=torch.int64)
    weights = torch.empty(B, H, Nq, width)
    kept, visible = torch.empty(B, H, Nq), torch.empty(B, H, Nq)
    fn = library().ak_topk_attention
    ptrs = [t.data_ptr() for t in (q, k, v, out, lse, chosen, weights, kept, visible)]
    _over_heads(lambda bh0, bh1: fn(*ptrs, bh0, bh1, H, Hkv, Nq, Nk, D, Dv, q_start, *_band_args(band), width, TOPK_BLOCK,
                                    sgemm()), B * H, 1)
    return out, lse, chosen, weights, kept, visible


# ------------------------------------------------------------------ transform and mixing (native_mixed.c)


def mixed_blocks(group: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(query rows, keys) of the blocks and tiles of the mixed-softmax kernels, forward and
    backward, for mixing groups of ``group`` heads: a block keeps every tile of its group's
    rows between two passes (the backward three per head), so larger groups take fewer rows."""
    return (max(32, min(128, 1024 // group)), 256), (max(16, min(64, 512 // group)), 256)


def _mixed_shapes(q: Tensor, k: Tensor, v: Tensor, conv: Tensor | None):
    B, H, Nq, D = q.shape
    cq, ck = (1, 1) if conv is None else conv.shape[-2:]
    return B, H, k.shape[1], Nq, k.shape[2], D, v.shape[-1], cq, ck


def _chunks(rows: int, nq: int, block: int) -> int:
    """Query chunks per (batch, group) row, so that a call with fewer rows than torch has
    threads (talking heads mixes all heads: one row per batch) still uses every thread."""
    threads = torch.get_num_threads()
    return 1 if rows >= threads else max(1, min(-(-nq // block), -(-threads // rows)))


def mixed_softmax_attention(q: Tensor, k: Tensor, v: Tensor, conv: Tensor | None, pre: Tensor | None, post: Tensor | None,
                            group: int, q_start: int, band: tuple[int | None, int | None]) -> tuple[Tensor, Tensor]:
    """(out, each head's lse before the mixing) of softmax attention over the keys of
    ``band`` with its logits transformed by a depthwise key-query convolution ``conv``
    (H, cq, ck) (multi-token attention) or a head mixing ``pre`` (H, H) (talking heads),
    never both, and its weights mixed by ``post`` (H, H); the mixings are block-diagonal in
    groups of ``group`` heads. q (B, H, Nq, D) already scaled, k (B, Hkv, Nk, D), v (B,
    Hkv, Nk, Dv), all float32."""
    q, k, v, conv, pre, post = (dense(t) for t in (q, k, v, conv, pre, post))
    B, H, Hkv, Nq, Nk, D, Dv, cq, ck = _mixed_shapes(q, k, v, conv)
    out, lse = torch.empty(B, H, Nq, Dv), torch.empty(B, H, Nq)
    fn = library().ak_mixed_softmax_attention
    ptrs = [t.data_ptr() for t in (q, k, v)] + [0 if t is None else t.data_ptr() for t in (conv, pre, post)] + [out.data_ptr(), lse.data_ptr()]
    blocks = mixed_blocks(group)[0]
    chunks = _chunks(B * H // group, Nq, blocks[0])  # each writes its own rows of out and lse
    _over_heads(lambda u0, u1: fn(*ptrs, u0, u1, chunks, H, Hkv, Nq, Nk, D, Dv, cq, ck, group, q_start, *_band_args(band),
                                  *blocks, sgemm()), B * H // group * chunks, 1)
    return out, lse


def mixed_softmax_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, conv: Tensor | None,
                                     pre: Tensor | None, post: Tensor | None, group: int, q_start: int,
                                     band: tuple[int | None, int | None]):
    """(dq of the scaled q, dk, dv, dconv, dpre, dpost; None for an absent one) of
    ``mixed_softmax_attention`` for ``grad_out``, given its per-head ``lse``."""
    grad_out, q, k, v, lse, conv, pre, post = (dense(t) for t in (grad_out, q, k, v, lse, conv, pre, post))
    B, H, Hkv, Nq, Nk, D, Dv, cq, ck = _mixed_shapes(q, k, v, conv)
    blocks = mixed_blocks(group)[1]
    chunks = _chunks(B * H // group, Nq, blocks[0])
    # Threads may share key heads (GQA) and, in chunks, groups: each adds into gradients of
    # its own, summed after.
    ranges = _ranges(B * H // group * chunks, 1)
    grads = [(torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros(B, H, cq, ck),
              torch.zeros(B, H // group, group, group), torch.zeros(B, H // group, group, group)) for _ in ranges]
    flipped = None if conv is None else conv.flip(-1, -2).contiguous()
    ptrs = [t.data_ptr() for t in (q, k, v, grad_out, lse)] + [0 if t is None else t.data_ptr() for t in (conv, flipped, pre, post)]
    fn = library().ak_mixed_softmax_attention_backward
    _run_parts([lambda u0=u0, u1=u1, own=own: fn(*ptrs, *(t.data_ptr() for t in own), u0, u1, chunks, H, Hkv, Nq, Nk, D, Dv, cq, ck,
                                                 group, q_start, *_band_args(band), *blocks, sgemm())
                for (u0, u1), own in zip(ranges, grads)])
    dq, dk, dv, dconv, dpre, dpost = (functools.reduce(Tensor.add_, parts) for parts in zip(*grads))
    block_diag = lambda per_group: torch.block_diag(*per_group.sum(0))
    return (dq, dk, dv, None if conv is None else dconv.sum(0), None if pre is None else block_diag(dpre),
            None if post is None else block_diag(dpost))


# ------------------------------------------------------------------ NSA (native_sparse.c)

def nsa_forward(q: Tensor, k: Tensor, v: Tensor, k_cmp: Tensor, v_cmp: Tensor, gates: Tensor, scale: float, *,
                compress_block: int, compress_stride: int, select_block: int, width: int, initial: int, local: int,
                window: int, rescale_above: float, select_chunk: int, tile_rows: int, span_rows: int,
                window_block: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """NSA's inference forward (arXiv 2502.11089) by the loops of native_sparse.c: q (B, Hq,
    Nq, D) are the last Nq of the Nk positions of k (B, Hkv, Nk, D) and v (B, Hkv, Nk, Dv);
    k_cmp, v_cmp (B, Hkv, Ncmp, D|Dv) the compressed blocks; gates (B, Hq, Nq, 3) the
    branch gates. Three passes add into one output: the scoring pass with the compression
    branch (queries in chunks of ``select_chunk``), the selection branch by key block
    (spans of ``span_rows`` (query, head) rows, tiles of ``tile_rows``; a row's reference
    rises only for a block more than ``rescale_above`` above it), the sliding window
    (blocks of ``window_block`` queries). Returns (out (B, Hq, Nq, Dv), chosen blocks
    (B, Hkv, Nq, width) int64 with -1 for empty slots, and the lse (B, Hq, Nq) of the
    compression, selection and window branches)."""
    q, k, v, k_cmp, v_cmp, gates = (dense(t) for t in (q, k, v, k_cmp, v_cmp, gates))
    B, Hq, Nq, D = q.shape
    Hkv, Nk, Ncmp, Dv = k.shape[1], k.shape[2], k_cmp.shape[2], v.shape[-1]
    lib, gemm = library(), sgemm()
    out = torch.empty(B, Hq, Nq, Dv)
    chosen = torch.empty(B, Hkv, Nq, width, dtype=torch.int64)
    lse_cmp, lse_slc, lse_win = torch.empty(B, Hq, Nq), torch.empty(B, Hq, Nq), torch.empty(B, Hq, Nq)
    g, qp, kp, vp, op = gates.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
    _over_heads(lambda u0, u1: lib.ak_nsa_select(qp, k_cmp.data_ptr(), v_cmp.data_ptr(), g, chosen.data_ptr(), op,
                                                 lse_cmp.data_ptr(), u0, u1, Hq, Hkv, Nq, Nk, Ncmp, D, Dv, scale,
                                                 compress_block, compress_stride, select_block, width, initial, local,
                                                 select_chunk, gemm), B * Hkv, 1)
    _over_heads(lambda u0, u1: lib.ak_nsa_selected(qp, kp, vp, chosen.data_ptr(), g, op, lse_slc.data_ptr(), u0, u1, Hq,
                                                   Hkv, Nq, Nk, D, Dv, width, select_block, scale, rescale_above,
                                                   tile_rows, span_rows, gemm), B * Hkv, 1)
    _over_heads(lambda bh0, bh1: lib.ak_nsa_window(qp, kp, vp, g, op, lse_win.data_ptr(), bh0, bh1, Hq, Hkv, Nq, Nk, D, Dv,
                                                   scale, window, window_block, gemm), B * Hq, 1)
    return out, chosen, lse_cmp, lse_slc, lse_win
