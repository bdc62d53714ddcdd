"""attnkit.distributed across real process groups (gloo, CPU), against dense references.

Each test starts one group of ranks as subprocesses (cp_worker.py) that run many checks
in one go: starting processes dominates the cost, so groups are few and small.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "cp_worker.py")
pytestmark = pytest.mark.distributed


def run_group(world: int, mode: str, tmp_path, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    init = tmp_path / f"init-{mode}-{world}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, str(r), str(world), str(init), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_calls_equal_the_whole(world, tmp_path):
    """Outputs, lse and gradients (q, k, v, sinks, ALiBi slopes, linear gates) of causal,
    window, document, ALiBi, softcap, callable, GQA, sigmoid and two linear mechanisms,
    for both layouts and lengths that 2P does not divide."""
    results = run_group(world, "checks", tmp_path)
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank} failed:\n{r.stderr[-3000:]}"
        assert r.stdout.strip().endswith("OK")


def test_a_failed_rank_fails_the_others_with_a_clear_error(tmp_path):
    results = run_group(2, "crash", tmp_path, timeout=60)
    assert results[1].returncode != 0
    assert results[0].returncode == 0, results[0].stderr[-3000:]
    assert "CLEAR ERROR: attnkit.distributed: rank 0 of 2 failed during" in results[0].stdout


def test_short_sequences_positions_and_failures_on_every_rank(tmp_path):
    """Issue 31, on a group of 3 (P = 2 on a subgroup, and P = 3): every mechanism and
    layout at N = 1 .. 2P + 1 (chunks and ranks with no token) forward and backward against
    float64 references; a failure inside the linear chain and a refusal before the call
    reach every rank at once; hf.use without position_ids gives the single-process logits;
    padding on one rank raises the same ValueError on every rank."""
    results = run_group(3, "edges", tmp_path)
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank} failed:\n{r.stderr[-3000:]}"
        assert r.stdout.strip().endswith("OK")
    print("".join(line + "\n" for line in results[1].stdout.splitlines() if line.startswith("MAXDIFF")))
