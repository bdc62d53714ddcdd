"""The Ray engine on a local Ray instance of 2 CPUs: the same rows as the local engine, a
worker killed mid-cell, and an address that cannot be reached."""

import sys
import time

import pytest
from helpers_sweeps import comparable, ran, toy_cells

from attnkit.sweeps import Cell, LocalEngine, RayEngine, cells, load, run_sweep

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_ray_gives_the_local_engines_rows_through_a_killed_worker_and_a_failure(local_ray, tmp_path):
    log, marker = tmp_path / "log", tmp_path / "died"
    grid = toy_cells(4, log=str(log)) + [
        Cell("toy", {"id": 8, "log": str(log), "die_once": str(marker)}),
        Cell("toy", {"id": 9, "fail": "no"}),
    ]
    result = run_sweep(grid, str(tmp_path / "ray"), RayEngine())
    assert marker.exists() and sorted(ran(log)) == [0, 1, 2, 3, 8, 8]  # the killed cell ran again
    assert len(result.computed) == 5 and result.failed == [grid[-1].hash]
    records = {c["config"]["id"]: c for c in cells(str(tmp_path / "ray"))}
    assert records[8]["attempts"] == 2 and records[0]["attempts"] == 1  # the attempts counted, as locally
    failed = [c for c in records.values() if c["status"] == "failed"]
    assert failed[0]["error"] == "RuntimeError: no" and "raise RuntimeError" in failed[0]["traceback"]
    run_sweep(grid[:5], str(tmp_path / "local"), LocalEngine(workers=2))
    rows = load(str(tmp_path / "ray"))
    assert comparable(rows) == comparable(load(str(tmp_path / "local")))  # every cell's rows once, equal
    assert len(rows) == 10


def test_arena_sweep_gives_the_same_table_on_ray_and_locally(local_ray, tmp_path):
    from attnkit.cli import main

    common = [
        "arena",
        "sweep",
        "mqar",
        "--mechanisms",
        "softmax,linear_elu",
        "--d-model",
        "8",
        "--layers",
        "1",
        "--heads",
        "2",
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--eval-examples",
        "8",
        "--param",
        "seq_len=16",
        "--param",
        "num_kv_pairs=2",
        "--seeds",
        "1",
        "--no-plots",
        "--quiet",
    ]
    assert main([*common, "--engine", "ray", "--out", str(tmp_path / "ray")]) == 0
    assert main([*common, "--engine", "local", "--workers", "2", "--out", str(tmp_path / "local")]) == 0
    ray_rows, local_rows = load(str(tmp_path / "ray")), load(str(tmp_path / "local"))
    assert len(ray_rows) == 2 and comparable(ray_rows) == comparable(local_rows)
    assert (tmp_path / "ray" / "results.csv").read_text().splitlines()[0].startswith("task,mechanism,d_model")


def test_an_address_that_cannot_be_reached_fails_within_the_timeout_naming_it(capsys, tmp_path):
    from attnkit.cli import main

    start = time.monotonic()
    code = main(
        [
            "arena",
            "sweep",
            "--engine",
            "ray",
            "--address",
            "127.0.0.1:1",
            "--connect-timeout",
            "3",
            "--out",
            str(tmp_path / "out"),
            "--quiet",
            "--no-plots",
        ]
    )
    assert code == 2 and time.monotonic() - start < 30
    assert "attnkit arena: error: --address: cannot reach the Ray cluster at 127.0.0.1:1 within 3 s" in capsys.readouterr().err
    with pytest.raises(ValueError, match="address: expected 'auto', HOST:PORT or ray://HOST:PORT, got 'nowhere'"):
        RayEngine("nowhere")


def test_a_ray_client_address_without_ray_client_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "grpc", None)  # as where ray[client] is not installed
    with pytest.raises(
        ImportError, match=r"--address ray://127.0.0.1:1 \(Ray Client\) needs ray\[client\]: pip install 'attnkit\[ray-client\]'"
    ):
        run_sweep(toy_cells(1), str(tmp_path / "out"), RayEngine("ray://127.0.0.1:1", connect_timeout=1))
