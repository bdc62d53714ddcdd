"""benchmarks/gpu.py: without CUDA it exits at once; on the CPU (--device cpu --tiny) its
every code path runs, and a wrong or raising mechanism shows up as a failed row."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu.py")


def _python(code: str, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would run")
def test_without_cuda_it_exits_at_once_saying_so():
    # run as a script would be, then check that attnkit was never imported: nothing ran
    done = _python(
        textwrap.dedent(f"""
        import runpy, sys
        sys.argv = [{SCRIPT!r}]
        try:
            runpy.run_path({SCRIPT!r}, run_name="__main__")
        except SystemExit as e:
            print("exit", e.code, "attnkit imported:", "attnkit" in sys.modules)
    """),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "no CUDA device" in done.stdout and "--device cpu --tiny" in done.stdout
    assert done.stdout.strip().endswith("exit 0 attnkit imported: False")


# Two mechanisms that must not pass: 1% off their own reference, and one that raises.
BROKEN = """
from attnkit.kernels import make_request, reference_attention
from attnkit.kernels.run import softmax_attention
from attnkit.mechanisms.base import Mechanism, register

@register("off_by_one_percent")
class OffByOnePercent(Mechanism):
    def forward(self, q, k, v, **call):
        return 1.01 * softmax_attention(q, k, v, **call)

    def reference(self, q, k, v, *, mask=None, **_):
        return reference_attention(make_request(q, k, v, mask=mask))[0]

@register("raises_on_call")
class RaisesOnCall(OffByOnePercent):
    def forward(self, q, k, v, **call):
        if q.dtype == torch.float32:  # the checked call (its parameters are set up in float64)
            raise RuntimeError("deliberately broken")
        return super().forward(q, k, v, **call)
"""


def test_tiny_cpu_run_covers_every_mechanism_backend_and_timing(tmp_path):
    out = tmp_path / "gpu.json"
    code = (
        "import sys, torch\n"
        + BROKEN
        + textwrap.dedent(f"""
        import attnkit
        sys.path.insert(0, {os.path.join(ROOT, "benchmarks")!r})
        import gpu
        sys.exit(gpu.main(["--device", "cpu", "--tiny", "--json", {str(out)!r}]))
    """)
    )
    done = _python(code, timeout=600)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]  # the two broken rows
    result = json.loads(out.read_text())
    rows = {(r["part"], r["case"]): r for r in result["rows"]}
    assert rows[("mechanism", "off_by_one_percent")]["status"] == "fail"
    broken = rows[("mechanism", "raises_on_call")]
    assert broken["status"] == "error" and "deliberately broken" in broken["attnkit"]
    assert any("deliberately broken" in e for e in result["errors"])

    from attnkit.mechanisms import available

    for name in available():  # every real mechanism: forward and backward match its reference
        assert rows[("mechanism", name)]["status"] == "ok", rows[("mechanism", name)]
    backends = [r for r in result["rows"] if r["part"] == "backend"]
    assert len(backends) == 10 and all(r["status"] in ("ok", "n/a", "skipped") for r in backends)
    timings = [r for r in result["rows"] if r["part"] == "timing"]
    assert [(r["case"], r["size"]) for r in timings] == [
        (kind, f"N={n} float32") for n in (256, 512) for kind in ("causal", "window", "alibi")
    ]
    for r in timings:
        assert r["status"] == "timed"
        for column in ("attnkit", "sdpa"):
            forward, both = r[column].split(" / ")
            assert float(forward) > 0 and float(both) > 0
        # attnkit's output against SDPA's (a dense band / bias built in the script): float32
        assert float(r["note"].rsplit(" ", 1)[-1]) < 1e-5
    assert done.stdout.splitlines()[1].split() == ["part", "case", "size", "attnkit", "sdpa", "flex", "note"]
