"""Context-parallel benchmarks: peak memory per rank and time, P ranks against one process.

Each rank is its own process (gloo over a file store on this machine); every call is a
causal fp32 forward + backward at the same total length N. Rows report, per P, the
slowest rank's time and the largest rank's peak RSS growth during the call, against
``attnkit.attention`` on the whole sequence in one process (measured in the same run).
Target: memory ≈ 1/P of the single call's working memory plus the ring buffers (one
K/V shard in flight). On a machine with fewer cores than ranks the ranks share cores, so
time shows overhead, not speed-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from .harness import Row, run_steps

B, H, D = 1, 8, 64
STEPS = 3

_RANK = r"""
import json, os, sys, time, statistics
import torch, torch.distributed as dist
import attnkit as ak
import attnkit.distributed as cp
from attnkit.mechanisms import get_mechanism

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024

rank, world, init, n, case = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
whole = [torch.randn(%(B)d, %(H)d, n, %(D)d, generator=g) for _ in range(3)]
mask = ak.window(1024) if case == "window" else ak.causal()
mech = get_mechanism("retnet") if case == "retnet" else None
if world == 0:  # the single-process baseline
    q, k, v = (t.requires_grad_() for t in whole)
    def call():
        if mech is not None:
            return mech(q, k, v, mask=mask)
        return ak.attention(q, k, v, mask=mask)
else:
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world)
    q, k, v = (cp.shard(t, 2).requires_grad_() for t in whole)
    def call():
        return cp.attention(q, k, v, mask=mask, mechanism=mech)
del whole
def step():
    for t in (q, k, v):
        t.grad = None
    out = call()
    out.backward(torch.ones_like(out))
step()  # warm-up: one-time allocations (thread pools, gloo buffers, C loops) stay out of the peak
base = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
times = []
for i in range(3):
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)
    if i == 0:
        growth = status("VmHWM:") - base
print(json.dumps({"growth_mb": growth, "ms": 1e3 * statistics.median(times)}), flush=True)
if world:
    dist.destroy_process_group()
    # gloo's threads can abort the interpreter's finalization even after destroy
    # ("terminate called without an active exception"): the result is out, so leave now
    os._exit(0)
""" % {"B": B, "H": H, "D": D}  # noqa: UP031 (a script template)


def measure(world: int, n: int, case: str) -> dict[str, Any]:
    """{"ms": slowest rank's median step, "growth_mb": largest rank's peak growth};
    world 0 is the single-process baseline."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _RANK, str(r), str(world), init, str(n), case],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for r in range(max(world, 1))
        ]
        results = []
        for p in procs:
            out, err = p.communicate(timeout=1800)
            if p.returncode != 0:
                return {"error": (err.strip().splitlines() or [f"exit {p.returncode}"])[-1]}
            results.append(json.loads(out.strip().splitlines()[-1]))
    return {"ms": max(r["ms"] for r in results), "growth_mb": max(r["growth_mb"] for r in results)}


def rows_for(case: str, n: int, worlds=(1, 2)) -> list[Row]:
    base = measure(0, n, case)
    rows = []
    label = {"causal": "softmax causal", "window": "softmax window(1024)", "retnet": "retnet (state passing)"}[case]
    for world in worlds:
        got = measure(world, n, case)
        if "error" in got or "error" in base:
            rows.append(
                Row(
                    "distributed",
                    f"{label} fwd+bwd, P={world}",
                    f"N={n}",
                    None,
                    "one process",
                    None,
                    "",
                    False,
                    got.get("error") or base["error"],  # one of the two failed
                )
            )
            continue
        share = got["growth_mb"] / base["growth_mb"] if base["growth_mb"] > 0 else float("nan")
        rows.append(
            Row(
                "distributed",
                f"{label} fwd+bwd, P={world}",
                f"N={n}",
                got["ms"],
                "attnkit, one process",
                base["ms"],
                "peak/rank ≈ 1/P + buffers",
                None,
                f"peak growth per rank {got['growth_mb']:.0f} MB vs {base['growth_mb']:.0f} MB = {share:.2f}",
                extra={"growth_mb": got["growth_mb"], "baseline_growth_mb": base["growth_mb"], "world": world},
            )
        )
    return rows


def run(quick: bool = False, progress=None) -> list[Row]:
    n = 2048 if quick else 8192
    steps = [
        (f"softmax causal N={n}, P=1,2", lambda: rows_for("causal", n)),
        (f"softmax window N={n}, P=2", lambda: rows_for("window", n, worlds=(2,))),
        (f"retnet N={n}, P=2", lambda: rows_for("retnet", n, worlds=(2,))),
    ]
    return run_steps(steps, progress)
