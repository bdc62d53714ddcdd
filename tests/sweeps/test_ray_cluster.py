"""Joining a Ray cluster that ``ray start --head`` made (its own processes, token
authentication as Ray turns it on), rather than an instance the sweep starts itself:
the same table as the local engine, and a driver without the token refused, naming the
address and what it lacks."""

import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers_sweeps import comparable

from attnkit.sweeps import load

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

GRID = ["mqar", "--mechanisms", "softmax,linear_elu", "--d-model", "16", "--seq-len", "16", "--steps", "20"]
GRID += ["--param", "num_kv_pairs=2", "--eval-every", "20", "--eval-examples", "32", "--quiet", "--no-plots"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sweep(env: dict, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", "import sys; from attnkit.cli import main; sys.exit(main())", "arena", "sweep", *GRID, *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A one-node cluster of 2 CPUs with a token of its own, stopped by ending `ray start --block`."""
    port, home = _free_port(), tmp_path_factory.mktemp("ray")
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_TMPDIR": str(home)}
    head = subprocess.Popen(
        [
            os.path.join(os.path.dirname(sys.executable), "ray"),
            "start",
            "--head",
            "--block",
            "--port",
            str(port),
            "--num-cpus",
            "2",
            "--include-dashboard=false",
        ]
        + ["--disable-usage-stats", "--temp-dir", str(home)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert head.poll() is None and time.monotonic() < deadline, "ray start --head did not come up"
                time.sleep(0.5)
        yield f"127.0.0.1:{port}", env
    finally:
        os.killpg(head.pid, signal.SIGKILL)  # the whole group: gcs, raylet, workers
        head.wait(60)


def test_a_sweep_on_a_started_cluster_gives_the_local_table(cluster, tmp_path):
    address, env = cluster
    joined = _sweep(env, "--engine", "ray", "--address", address, "--out", str(tmp_path / "cluster"))
    assert joined.returncode == 0, joined.stderr[-3000:]
    local = _sweep(env, "--engine", "local", "--workers", "2", "--out", str(tmp_path / "local"))
    assert local.returncode == 0, local.stderr[-3000:]
    rows, local_rows = load(str(tmp_path / "cluster")), load(str(tmp_path / "local"))
    assert {r["mechanism"] for r in rows} == {"softmax", "linear_elu"}
    assert len(rows) == len(local_rows) and comparable(rows) == comparable(local_rows)


def test_a_driver_without_the_token_is_refused_naming_the_address(cluster, tmp_path):
    address, env = cluster
    without = {k: v for k, v in env.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    without["HOME"] = str(tmp_path)  # no ~/.ray/auth_token either
    done = _sweep(without, "--engine", "ray", "--address", address, "--connect-timeout", "5", "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert f"--address: the Ray cluster at {address} did not accept a connection within 5 s" in done.stderr
    assert "set RAY_AUTH_MODE=token" in done.stderr
