"""attnkit on a CUDA GPU, in one short run: is every path right there, and how fast is the core call?

    python benchmarks/gpu.py                        # needs CUDA; exits at once (status 0) without it
    python benchmarks/gpu.py --json gpu.json        # also write the rows as JSON
    python benchmarks/gpu.py --device cpu --tiny    # the same code paths on CPU at tiny sizes

One table, printed row by row as it is measured (a run cut short still shows its rows):

- ``mechanism`` rows: every registered mechanism (``attnkit.mechanisms.available()``),
  forward and backward in float32 on the device, against its own ``reference`` in float64
  on the CPU — same inputs (rounded to float32), same parameters, causal mask, GQA — the
  comparison of tests/mechanisms/mechanism_contract.py. Output and every gradient (q, k,
  v and learned parameters) must agree within the float32 tolerance below.
- ``backend`` rows: ``attnkit.attention`` with causal, sliding-window, ALiBi and
  document masks on each backend (``auto``, ``sdpa``, ``chunked``, ``flex``), forward
  and backward, against the float64 reference backend on the CPU. A backend that refuses
  a call (a ValueError naming why) is shown as n/a, not as a failure.
- ``timing`` rows: ``attnkit.attention`` against torch SDPA and compiled FlexAttention
  at 4k and 16k tokens (bf16, B=1, 16 heads, D=64) for causal, a causal 1024-token window
  and causal ALiBi: medians of CUDA-event timings after warm-up, "forward / forward +
  backward" in ms. The note says which backend attnkit chose (``attnkit.explain``) and
  how far its output is from SDPA's.

Every row runs under try/except: an error is shown in its cell and in full (the last
lines of its traceback) under the table, and the run goes on. Timing rows start only
while the run is inside ``--budget`` seconds (default 300). The exit status is 1 when a
check row failed or raised, else 0.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
import traceback
import warnings

import torch

# float32 on the device against float64 on the CPU: reductions run in another order (and
# the recurrent forms of the linear family accumulate over the sequence), so a few
# hundred float32 ulps on outputs of magnitude ~1; gradients sum over more terms.
VALUE_TOL = dict(atol=1e-4, rtol=1e-4)
GRAD_TOL = dict(atol=5e-4, rtol=5e-4)

# Small sizes for the checks: GQA (4 query heads per 2 key heads), two 64-row blocks.
CHECK = dict(B=2, Hq=4, Hkv=2, N=128, D=16)
# Mechanism parameters that make a small call exercise the sparse path (the tests' SMALL
# settings), or that a mechanism needs before it can run at all.
MECHANISM_PARAMS = {
    "block_sparse": dict(block_size=8, last_q=6, vertical_size=6, slash_size=5, sink_tokens=2, local_tokens=3),
    "hyper_attention": dict(block_size=16, sample_size=12, min_seq_len=32, lsh_num_projs=4),
    "nsa": dict(compress_block=8, compress_stride=4, select_block=8, num_selected=3, window=6),
    "forgetting": dict(num_heads=CHECK["Hq"]),
    "multi_token": dict(num_heads=CHECK["Hq"]),
    "talking_heads": dict(num_heads=CHECK["Hq"]),
    "neighborhood": dict(kernel=7, causal=True),
    "topk": dict(k=8),
    # a span of 0.37 * 48 tokens ends between two keys: no distance sits on the ramp's
    # kinks (m = 0 or 1), where the fast path and the reference may take either one-sided gradient
    "adaptive_span": dict(max_span=48, ramp=8, init=0.37, num_heads=CHECK["Hq"]),
}
# Parameters that start as the identity: moved off it, or the check could not fail.
PERTURBED = {"multi_token", "talking_heads"}

TIMING_FULL = dict(sizes=(4096, 16384), heads=16, dim=64, window=1024, dtype="bfloat16", warmup=2, reps=10)
TIMING_TINY = dict(sizes=(256, 512), heads=2, dim=16, window=64, dtype="float32", warmup=1, reps=2)
COLUMNS = ("part", "case", "size", "attnkit", "sdpa", "flex", "note")
WIDTHS = (9, 28, 16, 20, 17, 17, 0)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="benchmarks/gpu.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--tiny", action="store_true", help="tiny timing sizes, and no torch.compile (for a CPU run of the code paths)")
    p.add_argument("--budget", type=float, default=300.0, help="start no timing row after this many seconds (default 300)")
    p.add_argument("--json", metavar="PATH", help="also write the rows and the machine as JSON")
    return p.parse_args(argv)


def import_attnkit():
    """attnkit, installed or from this checkout's src/ (a bare GPU machine has no venv)."""
    try:
        import attnkit
    except ImportError:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
        import attnkit
    return attnkit


# --------------------------------------------------------------------------- table


class Table:
    """Rows printed as they come; errors numbered and printed in full at the end."""

    def __init__(self):
        self.rows, self.errors = [], []
        print(self._line(COLUMNS), flush=True)
        print(self._line(tuple("-" * max(w, 4) for w in WIDTHS)), flush=True)

    @staticmethod
    def _line(cells) -> str:
        return "  ".join(str(c).ljust(w) if w else str(c) for c, w in zip(cells, WIDTHS)).rstrip()

    def error(self, e: BaseException) -> str:
        """A short cell for an exception; its traceback is kept for the footnotes."""
        self.errors.append("".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:]).rstrip())
        first = str(e).splitlines()[0] if str(e) else ""
        return f"ERROR [{len(self.errors)}] {type(e).__name__}: {first[:60]}"

    def add(self, part, case, size, attnkit="-", sdpa="-", flex="-", note="", status="ok"):
        row = dict(zip(COLUMNS, (part, case, size, attnkit, sdpa, flex, note)), status=status)
        self.rows.append(row)
        print(self._line(row[c] for c in COLUMNS), flush=True)

    def footnotes(self):
        for i, text in enumerate(self.errors, 1):
            print(f"\n[{i}] " + text.replace("\n", "\n    "))


# --------------------------------------------------------------------------- checks


def closeness(got: torch.Tensor | None, want: torch.Tensor | None, tol: dict) -> tuple[float, float]:
    """(max |got - want|, max |got - want| / (atol + rtol |want|)): the second <= 1 passes.
    A missing gradient counts as zeros."""
    if got is None and want is None:
        return 0.0, 0.0
    if got is None:
        got = torch.zeros_like(want)
    if want is None:
        want = torch.zeros_like(got, device="cpu", dtype=torch.float64)
    got = got.detach().to("cpu", torch.float64)
    want = want.detach().to("cpu", torch.float64)
    if got.shape != want.shape:
        raise ValueError(f"shape {tuple(got.shape)} against the reference's {tuple(want.shape)}")
    diff = (got - want).abs()
    if not bool(torch.isfinite(got).all()):
        return math.inf, math.inf
    ratio = diff / (tol["atol"] + tol["rtol"] * want.abs())
    return float(diff.max()) if diff.numel() else 0.0, float(ratio.max()) if ratio.numel() else 0.0


def inputs64(seed: int, B: int, Hq: int, Hkv: int, N: int, D: int):
    """q, k, v on the CPU in float64, already rounded to float32 (so both sides see the same numbers)."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, Hq, N, D), (B, Hkv, N, D), (B, Hkv, N, D))
    return [torch.randn(*s, generator=g, dtype=torch.float64).float().double() for s in shapes]


def compare_run(run_device, run_reference, tensors64, params_device, params_reference, device):
    """Forward and backward of ``run_device`` (float32 on ``device``) against ``run_reference``
    (float64 on the CPU); returns (output error, worst gradient error, pass)."""
    ref_in = [t.clone().requires_grad_() for t in tensors64]
    dev_in = [t.to(device=device, dtype=torch.float32).requires_grad_() for t in tensors64]
    want = run_reference(*ref_in)
    got = run_device(*dev_in)
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).float().double()
    grads_want = torch.autograd.grad(want, ref_in + params_reference, cot, allow_unused=True)
    grads_got = torch.autograd.grad(got, dev_in + params_device, cot.to(device=device, dtype=got.dtype), allow_unused=True)
    out_err, out_ratio = closeness(got, want, VALUE_TOL)
    grad_err, grad_ratio = 0.0, 0.0
    for a, b in zip(grads_got, grads_want):
        e, r = closeness(a, b, GRAD_TOL)
        grad_err, grad_ratio = max(grad_err, e), max(grad_ratio, r)
    return out_err, grad_err, out_ratio <= 1 and grad_ratio <= 1


def build_mechanism(ak, name: str, q64, k64, v64):
    from attnkit.mechanisms import get_mechanism

    if name == "top_theta":
        from attnkit.mechanisms.topk import TopTheta, calibrate_top_theta

        mech = TopTheta(calibrate_top_theta(q64, k64, keep=8, mask=ak.causal()))
    else:
        mech = get_mechanism(name, **MECHANISM_PARAMS.get(name, {}))
    mech = mech.to(torch.float64)
    with torch.no_grad():  # lazily built parameters (GLA's gate) take their values now, once for both copies
        mech(q64, k64, v64, mask=ak.causal())
    if name in PERTURBED:
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for p in mech.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return mech


def check_mechanisms(ak, table: Table, device: str) -> None:
    from attnkit.mechanisms import available

    c = CHECK
    for name in available():
        try:
            q64, k64, v64 = inputs64(0, c["B"], c["Hq"], c["Hkv"], c["N"], c["D"])
            mech = build_mechanism(ak, name, q64, k64, v64)
            ref_mech = copy.deepcopy(mech).to(dtype=torch.float64)
            dev_mech = copy.deepcopy(mech).to(device=device, dtype=torch.float32)

            def run_device(q, k, v):
                out = dev_mech(q, k, v, mask=ak.causal())
                return out[0] if isinstance(out, tuple) else out

            def run_reference(q, k, v):
                out = ref_mech.reference(q, k, v, mask=ak.causal())
                return out[0] if isinstance(out, tuple) else out

            params_dev = [p for p in dev_mech.parameters() if p.requires_grad]
            params_ref = [p for p in ref_mech.parameters() if p.requires_grad]
            out_err, grad_err, ok = compare_run(run_device, run_reference, [q64, k64, v64], params_dev, params_ref, device)
            table.add("mechanism", name, f"N={c['N']} fp32", "ok" if ok else "FAIL", note=f"out err {out_err:.1e}, grad err {grad_err:.1e}",
                      status="ok" if ok else "fail")
        except Exception as e:  # noqa: BLE001 — shown in the table, the run goes on
            table.add("mechanism", name, f"N={c['N']} fp32", table.error(e), status="error")


def masks(ak, kind: str, device, N: int, heads: int, window: int):
    """(mask, score) of a named case, built for ``device`` (the document ids live there)."""
    if kind == "causal":
        return ak.causal(), None
    if kind == "window":
        return ak.causal() & ak.window(window), None
    if kind == "alibi":
        return ak.causal(), ak.alibi(heads)
    if kind == "document":
        return ak.causal() & ak.document(torch.arange(N, device=device) // max(1, N // 3)), None
    raise ValueError(kind)


def backend_of(explanation: str) -> str:
    """The backend's name from ``attnkit.explain``'s first line ("backend: flex — ...")."""
    return explanation.splitlines()[0].split(" — ")[0].removeprefix("backend: ")


BACKEND_CASES = (("auto", "causal"), ("auto", "window"), ("auto", "alibi"), ("auto", "document"), ("sdpa", "causal"),
                 ("chunked", "causal"), ("chunked", "window"), ("chunked", "alibi"), ("chunked", "document"), ("flex", "window"))


def check_backends(ak, table: Table, device: str, compile_ok: bool) -> None:
    c = CHECK
    for backend, kind in BACKEND_CASES:
        case = f"{backend} {kind}"
        size = f"N={c['N']} fp32"
        if backend == "flex" and not compile_ok:
            table.add("backend", case, size, "skipped", note="--tiny: nothing compiled", status="skipped")
            continue
        try:
            tensors = inputs64(1, c["B"], c["Hq"], c["Hkv"], c["N"], c["D"])
            mask_dev, score_dev = masks(ak, kind, device, c["N"], c["Hq"], 24)
            mask_ref, score_ref = masks(ak, kind, "cpu", c["N"], c["Hq"], 24)

            def run_device(q, k, v):
                return ak.attention(q, k, v, mask=mask_dev, score=score_dev, backend=backend)

            def run_reference(q, k, v):
                return ak.attention(q, k, v, mask=mask_ref, score=score_ref, backend="reference")

            try:  # with inputs that need gradients, as the checked call has
                probe = [t.to(device=device, dtype=torch.float32).requires_grad_() for t in tensors]
                chosen = backend_of(ak.explain(*probe, mask=mask_dev, score=score_dev, backend=backend))
            except ValueError as e:  # the backend refuses this call: say why, not a failure
                table.add("backend", case, size, "n/a", note=str(e)[:100], status="n/a")
                continue
            out_err, grad_err, ok = compare_run(run_device, run_reference, tensors, [], [], device)
            table.add("backend", case, size, "ok" if ok else "FAIL", note=f"ran {chosen}; out err {out_err:.1e}, grad err {grad_err:.1e}",
                      status="ok" if ok else "fail")
        except Exception as e:  # noqa: BLE001
            table.add("backend", case, size, table.error(e), status="error")


# --------------------------------------------------------------------------- timings


class Timer:
    """Median milliseconds of ``fn()`` after warm-up: CUDA events on the GPU (the stream is
    synchronised before and after), perf_counter on the CPU."""

    def __init__(self, device: str, warmup: int, reps: int):
        self.cuda = device.startswith("cuda")
        self.warmup, self.reps = warmup, reps

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        self.sync()
        times = []
        for _ in range(self.reps):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)


def sdpa_call(kind: str, N: int, heads: int, window: int, device, dtype):
    """torch SDPA for a case: is_causal, a dense boolean band, or causal ALiBi as a dense bias."""
    import torch.nn.functional as F

    if kind == "causal":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    i = torch.arange(N, device=device).view(-1, 1)
    j = torch.arange(N, device=device).view(1, -1)
    if kind == "window":
        band = (j <= i) & (i - j <= window)  # attnkit.window(w): the query and the w keys before it
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=band)
    # ALiBi (Press et al. 2021, arXiv 2108.12409): head h adds -m_h (i - j), m_h = 2^(-8(h+1)/H)
    slopes = torch.tensor([2 ** (-8 * (h + 1) / heads) for h in range(heads)], device=device, dtype=torch.float32)
    bias = (-(slopes.view(-1, 1, 1) * (i - j).float())).masked_fill(j > i, -math.inf).to(dtype).unsqueeze(0)
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def flex_call(kind: str, N: int, heads: int, window: int, device, compiled):
    """FlexAttention for a case, with its block mask built once."""
    from torch.nn.attention.flex_attention import create_block_mask

    if kind == "window":
        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx - kv_idx <= window)
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx
    block_mask = create_block_mask(mask_mod, None, None, N, N, device=device)
    slopes = torch.tensor([2 ** (-8 * (h + 1) / heads) for h in range(heads)], device=device, dtype=torch.float32)

    def alibi_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)
    score_mod = alibi_mod if kind == "alibi" else None
    return lambda q, k, v: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)


def time_case(ak, timer: Timer, kind: str, N: int, cfg: dict, device, dtype, compiled, table: Table) -> None:
    H, D, W = cfg["heads"], cfg["dim"], cfg["window"]
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, H, N, D, device=device, dtype=dtype, generator=g).requires_grad_() for _ in range(3))
    grad = torch.randn(1, H, N, D, device=device, dtype=dtype, generator=g)
    mask, score = masks(ak, kind, device, N, H, W)
    cells, outputs, note = {}, {}, ""

    def attnkit_call(a, b, c):
        return ak.attention(a, b, c, mask=mask, score=score)

    try:
        note = "attnkit ran " + backend_of(ak.explain(q, k, v, mask=mask, score=score))
    except Exception as e:  # noqa: BLE001
        note = f"explain: {table.error(e)}"
    calls = {"attnkit": lambda: attnkit_call, "sdpa": lambda: sdpa_call(kind, N, H, W, device, dtype),
             "flex": lambda: flex_call(kind, N, H, W, device, compiled)}
    # Forward timings take inputs that need gradients, so that a compiled kernel serves the
    # forward and backward rows alike; on the CPU FlexAttention refuses them (no backward).
    fq, fk, fv = (q, k, v) if device != "cpu" else (q.detach(), k.detach(), v.detach())
    for name, make in calls.items():
        try:
            fn = make()
            t0 = time.perf_counter()
            outputs[name] = fn(fq, fk, fv).detach().float()
            timer.sync()
            first = time.perf_counter() - t0

            def fwd():
                return fn(fq, fk, fv)

            def fwd_bwd():
                q.grad = k.grad = v.grad = None
                fn(q, k, v).backward(grad)

            forward_ms = timer(fwd)
            try:
                both = f"{timer(fwd_bwd):.2f}"
            except Exception as e:  # noqa: BLE001 — e.g. no FlexAttention backward on CPU
                both = table.error(e)
            cells[name] = f"{forward_ms:.2f} / {both}"
            if first > 5:
                note += f"; {name} first call {first:.0f} s"
        except Exception as e:  # noqa: BLE001
            cells[name] = table.error(e)
        finally:
            q.grad = k.grad = v.grad = None
    if "attnkit" in outputs and "sdpa" in outputs:
        note += f"; max|attnkit - sdpa| {float((outputs['attnkit'] - outputs['sdpa']).abs().max()):.1e}"
    table.add("timing", kind, f"N={N} {str(dtype).removeprefix('torch.')}", cells.get("attnkit", "-"), cells.get("sdpa", "-"),
              cells.get("flex", "-"), note.removeprefix("; "), status="timed")


def run_timings(ak, table: Table, device: str, cfg: dict, compile_ok: bool, deadline: float) -> None:
    from torch.nn.attention.flex_attention import flex_attention

    dtype = getattr(torch, cfg["dtype"])
    # dynamic=False: one kernel per shape, as attnkit's own flex backend compiles it
    compiled = torch.compile(flex_attention, dynamic=False) if compile_ok else flex_attention
    timer = Timer(device, cfg["warmup"], cfg["reps"])
    for N in cfg["sizes"]:
        for kind in ("causal", "window", "alibi"):
            size = f"N={N} {cfg['dtype']}"
            if time.perf_counter() > deadline:
                table.add("timing", kind, size, "skipped", note="past --budget", status="skipped")
                continue
            try:
                time_case(ak, timer, kind, N, cfg, device, dtype, compiled, table)
            except Exception as e:  # noqa: BLE001 — e.g. out of memory building the inputs
                table.add("timing", kind, size, table.error(e), status="error")
            if device.startswith("cuda"):  # the case's tensors (a 16k ALiBi bias is GBs) are gone: give it back
                torch.cuda.empty_cache()


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device (torch.cuda.is_available() is False), nothing to run. "
              "'--device cpu --tiny' runs the same code paths on the CPU at tiny sizes.")
        return 0
    if args.device not in ("cpu",) and not args.device.startswith("cuda"):
        print(f"benchmarks/gpu.py: error: --device: expected cuda or cpu, got {args.device!r}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    # The CPU side here only computes references: not worth a first build of the C++
    # operators on the GPU machine's clock (ATTNKIT_NATIVE=1 in the environment overrides).
    os.environ.setdefault("ATTNKIT_NATIVE", "0")
    ak = import_attnkit()
    from attnkit.kernels.machine import machine_info

    compile_ok = not args.tiny
    if not compile_ok:  # eager FlexAttention is the point of --tiny, not news
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    # Checks compare float32 with float64: no TF32 rounding of float32 matmuls.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # Each mask and size compiles its own FlexAttention kernel: room for all of this run's.
    for limit in ("recompile_limit", "cache_size_limit"):  # the name depends on the torch version
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(64, getattr(torch._dynamo.config, limit)))
    info = machine_info()
    print(f"attnkit on {info['cuda_device'] or 'cpu'} — torch {info['torch']}, python {info['python']}, {info['threads']} CPU threads"
          + (" (--tiny: small sizes, nothing compiled)" if args.tiny else ""), flush=True)
    table = Table()
    sections = (("mechanism", lambda: check_mechanisms(ak, table, args.device)),
                ("backend", lambda: check_backends(ak, table, args.device, compile_ok)),
                ("timing", lambda: run_timings(ak, table, args.device, TIMING_TINY if args.tiny else TIMING_FULL, compile_ok,
                                               start + args.budget)))
    for part, run in sections:
        try:
            run()
        except Exception as e:  # noqa: BLE001 — a whole section that cannot start is one row
            table.add(part, "(section)", "-", table.error(e), status="error")
    table.footnotes()
    checks = [r for r in table.rows if r["part"] != "timing"]
    bad = [r for r in checks if r["status"] in ("fail", "error")]
    print(f"\n{len(checks) - len(bad)} of {len(checks)} checks passed (or n/a, skipped); {len(bad)} failed or raised; "
          f"{time.perf_counter() - start:.0f} s in all")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": info, "tiny": args.tiny, "rows": table.rows, "errors": table.errors}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
