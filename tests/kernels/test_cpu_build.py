"""The CPU operators as a build and a process would meet them: no ctypes left, a forked
child finishes, explain() and ``attnkit doctor`` name the engine with the operators and
without, the mechanisms run with them switched off, a missing build warns once, and
concurrent first builds compile once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import attnkit
from attnkit.kernels import cpu
from attnkit.kernels.cpu import build

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"


def _python(code: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full, timeout=timeout, cwd=ROOT
    )


def test_no_ctypes_left_in_src():
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in SRC.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "ctypes" in line
    ]
    assert found == []


def test_no_scraped_blas_symbol_in_the_operators():
    """Matrix products go through what libtorch exports to extensions, never a symbol
    looked up at run time."""
    text = "".join(p.read_text() for p in (SRC / "attnkit/kernels/cpu").glob("*.[ch]*"))
    for scraped in ("dlsym", "sgemm_", "MKL_Set_Num_Threads"):
        assert scraped not in text


def test_child_of_a_fork_finishes_after_an_operator_call():
    """A call on two threads, os.fork(), the same call in the child: the child returns the
    same output (the ctypes loader's thread pool made it wait forever)."""
    if not cpu.available():
        pytest.skip(f"operators unavailable: {cpu.status().reason}")
    done = _python(
        """
        import os, torch, attnkit
        torch.set_num_threads(2)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 4, 300, 32, generator=g) for _ in range(3))
        call = lambda: attnkit.attention(q, k, v, mask=attnkit.causal(), mechanism="sigmoid")
        with torch.no_grad():
            before = call()
            pid = os.fork()
            if pid == 0:
                os._exit(0 if torch.equal(call(), before) else 3)
        print("child", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    """,
        env={"OMP_NUM_THREADS": "2"},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "child 0"


def test_operators_split_their_work_across_torchs_threads():
    """Parts of an operator's work run on distinct threads of torch's pool, as many as
    torch.set_num_threads allows (a build without OpenMP ran them all on one)."""
    if not cpu.available():
        pytest.skip(f"operators unavailable: {cpu.status().reason}")
    done = _python(
        """
        import torch
        from attnkit.kernels import cpu
        assert cpu.available()
        torch.set_num_threads(2)
        two = torch.ops.attnkit._threads_used(2)
        torch.set_num_threads(1)
        print(two, torch.ops.attnkit._threads_used(2))
    """,
        env={"OMP_NUM_THREADS": "2"},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "1"]


def _explain_softcap_band() -> str:
    q = torch.randn(1, 2, 300, 16)
    return attnkit.explain(q, q, q, mask=attnkit.causal() & attnkit.window(50), score=attnkit.softcap(5.0))


def test_explain_names_the_engine_with_and_without_the_operators():
    if not cpu.available():
        pytest.skip(f"operators unavailable: {cpu.status().reason}")
    text = _explain_softcap_band()
    assert "engine: C++ operator attnkit::softmax_attention" in text
    assert "C++ operators: available" in text
    q = torch.randn(1, 2, 300, 16)
    assert "engine: torch's fused flash kernel per tile segment" in attnkit.explain(
        q, q, q, mask=attnkit.causal(), score=attnkit.alibi(2)
    )
    off = _python(
        """
        import torch, attnkit
        q = torch.randn(1, 2, 300, 16)
        print(attnkit.explain(q, q, q, mask=attnkit.causal() & attnkit.window(50), score=attnkit.softcap(5.0)))
    """,
        env={"ATTNKIT_NATIVE": "0"},
    )
    assert off.returncode == 0, off.stderr
    assert "engine: PyTorch tiles" in off.stdout
    assert "C++ operators: unavailable (turned off by ATTNKIT_NATIVE=0)" in off.stdout


def test_a_missing_build_warns_once_and_falls_back(monkeypatch):
    monkeypatch.setattr(build, "_status", build.Status(False, "build or load failed: test"))
    monkeypatch.setattr(build, "_warned", False)
    monkeypatch.setattr(build, "available", lambda: False)
    monkeypatch.setattr(cpu, "available", lambda: False)
    q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))
    with pytest.warns(RuntimeWarning, match="C\\+\\+ CPU operators are unavailable \\(build or load failed: test\\)"):
        with torch.no_grad():
            out = attnkit.attention(q, k, v, mask=attnkit.causal(), mechanism="sigmoid")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            again = attnkit.attention(q, k, v, mask=attnkit.causal(), mechanism="sigmoid")
    torch.testing.assert_close(out, again)


def test_doctor_reports_build_compiler_cpu_threads_and_versions(capsys):
    from attnkit.cli import main

    assert main(["doctor", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows["operators"] == ("available" if cpu.available() else "unavailable")
    assert rows["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert rows["torch"] == torch.__version__
    assert rows["threads"].startswith(f"{torch.get_num_threads()} intra-op")
    assert rows["transformers"]  # a version, or "not installed"
    assert set(rows) >= {"operators_detail", "compiler", "cpu"}


def test_mechanisms_pass_their_tests_with_the_operators_off():
    """A subset of the mechanism suite with ATTNKIT_NATIVE=0: the PyTorch tiles compute
    the same values."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "tests/mechanisms/test_sigmoid.py",
            "tests/mechanisms/test_stick_breaking.py",
            "tests/mechanisms/test_talking_heads.py",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        env={**os.environ, "ATTNKIT_NATIVE": "0", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout


@pytest.mark.slow
def test_concurrent_first_builds_compile_once(tmp_path):
    """Three processes that need the operators at once, on an empty extension cache: one
    compiles (torch's file lock), the others wait and load that build."""
    code = "from attnkit.kernels.cpu import build; s = build.status(); print(s.available, s.reason)"
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    env.pop("ATTNKIT_NATIVE", None)
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=900) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert all(out.startswith("True") for out, _ in outs), outs
    log = next(tmp_path.rglob(".ninja_log")).read_text().splitlines()
    built = [line.split("\t")[3] for line in log if not line.startswith("#")]  # start, end, mtime, output, hash
    # each object and the library once: a second build would log them again
    assert sorted(built) == sorted(set(built))
    assert len([b for b in built if b.endswith(".o")]) == len(build.SOURCES)
