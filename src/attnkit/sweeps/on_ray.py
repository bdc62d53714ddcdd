"""The Ray engine: each cell a Ray task (Ray, arXiv 1712.05889), results stored by the driver.

``address=None`` starts a Ray instance on this machine for the sweep and stops it after
(``ray.init(address="local")``: never a cluster someone else left running here);
``address="auto"`` joins the cluster ``ray start`` made on this machine; ``host:port``
(the head's GCS port, 6379 by default) or ``ray://host:port`` (Ray Client, 10001) joins
a remote one (a cluster that ``ray start`` made uses token authentication: the driver needs
``RAY_AUTH_MODE=token`` and the cluster's token, as Ray's own CLI does). Before ``ray.init`` the address is tried with a plain TCP connection, and
both that and ``ray.init`` get ``connect_timeout`` seconds, so an unreachable address
fails within it, naming the address, instead of Ray's own minutes of retries.

Every node must have attnkit (and what the cell kinds import) installed: a task carries
the cell kind's function by reference. A task whose worker process dies (killed, out of
memory, a lost node) is given again by the driver, up to ``retries`` times, as the local
engine does, so the store counts its attempts (Ray's own ``max_retries`` would retry it
unseen); an exception inside a cell is not retried (it would fail the same way) but
recorded with its traceback.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import traceback

from ..extras import require

DEFAULT_CONNECT_TIMEOUT_S = 15.0


def _run_cell(fn, config: dict, threads: int):
    """The task's body on a Ray worker: ("done", rows, seconds, node) or ("error", ...)."""
    import torch

    torch.set_num_threads(threads)
    node = socket.gethostname()
    start = time.perf_counter()
    try:
        rows = fn(config)
        if not isinstance(rows, list):
            raise ValueError(f"rows: the cell kind returned {type(rows).__name__}, expected a list of dicts")
        return ("done", rows, time.perf_counter() - start, node)
    except Exception as e:
        return ("error", f"{type(e).__name__}: {e}", traceback.format_exc(), time.perf_counter() - start, node)


def _lost_worker(error) -> bool:
    """Whether a task's error says its process or node was lost (worth a new attempt),
    not that the task itself failed on Ray's side (say, its function could not be loaded)."""
    import ray.exceptions as errors

    lost = tuple(
        getattr(errors, name)
        for name in ("WorkerCrashedError", "NodeDiedError", "OutOfMemoryError", "LocalRayletDiedError", "ObjectLostError")
        if hasattr(errors, name)
    )
    return isinstance(error, lost)


def split_address(address: str) -> tuple[str, int] | None:
    """(host, port) of ``host:port`` or ``ray://host:port``; None for ``auto``."""
    if address == "auto":
        return None
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address: expected 'auto', HOST:PORT or ray://HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def check_reachable(address: str, timeout: float) -> None:
    """A TCP connection to the address within ``timeout`` seconds, or ConnectionError naming it."""
    target = split_address(address)
    if target is None:
        return
    try:
        socket.create_connection(target, timeout=timeout).close()
    except OSError as e:
        reason = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise ConnectionError(f"address: cannot reach the Ray cluster at {address} within {timeout:g} s ({reason})") from None


def connect(address: str | None, timeout: float, num_cpus: int | None = None) -> bool:
    """Connect this process to Ray; True when it started the instance (and should stop it)."""
    ray = require("ray", "the ray sweep engine")
    if address is not None and address.startswith("ray://"):
        require("grpc", f"--address {address} (Ray Client)")
    if address is not None:
        check_reachable(address, timeout)
    if ray.is_initialized():  # a caller (a test, a notebook) connected already: use that
        return False
    if address is None:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
        return True
    failure: list[BaseException] = []

    def join():
        try:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        except BaseException as e:  # handed to the caller's thread below
            failure.append(e)

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        hint = ""
        if os.environ.get("RAY_AUTH_MODE") != "token":
            # `ray start` turns token authentication on, while a driver's default is off: it
            # then retries, unauthenticated, until the timeout.
            hint = (
                "; if the cluster uses token authentication (`ray start`'s default), set RAY_AUTH_MODE=token "
                "and give its token (~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN)"
            )
        raise ConnectionError(f"address: the Ray cluster at {address} did not accept a connection within {timeout:g} s{hint}")
    if failure:
        raise ConnectionError(f"address: cannot join the Ray cluster at {address}: {failure[0]}") from None
    return False


class RayEngine:
    """Cells as Ray tasks of ``num_cpus`` CPUs each (``threads`` torch threads); the
    driver keeps ``in_flight`` of them submitted (default: twice the cluster's CPU slots)."""

    name = "ray"

    def __init__(
        self,
        address: str | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
        num_cpus: int | None = None,
        cpus_per_cell: int = 1,
        retries: int = 2,
        in_flight: int | None = None,
    ):
        if address is not None:
            split_address(address)  # a malformed address is refused before Ray starts
        if not connect_timeout > 0:
            raise ValueError(f"connect_timeout: expected seconds > 0, got {connect_timeout!r}")
        if isinstance(cpus_per_cell, bool) or not isinstance(cpus_per_cell, int) or cpus_per_cell < 1:
            raise ValueError(f"cpus_per_cell: expected a positive int, got {cpus_per_cell!r}")
        self.address, self.connect_timeout, self.num_cpus = address, connect_timeout, num_cpus
        self.cpus_per_cell, self.retries, self.in_flight = cpus_per_cell, retries, in_flight
        self.parallelism = num_cpus or 1

    def run(self, cells, events) -> None:
        ray = require("ray", "the ray sweep engine")
        started = connect(self.address, self.connect_timeout, self.num_cpus)
        running: dict = {}  # object ref -> (cell, attempt)
        try:
            slots = max(1, int(ray.cluster_resources().get("CPU", 1)) // self.cpus_per_cell)
            self.parallelism = slots
            task = ray.remote(_run_cell).options(num_cpus=self.cpus_per_cell, max_retries=0, retry_exceptions=False)
            limit = self.in_flight or 2 * slots
            pending = [(cell, 1) for cell in reversed(cells)]  # pop() keeps the grid order
            while pending or running:
                while pending and len(running) < limit and not events.stopping():
                    cell, attempt = pending.pop()
                    if attempt > 1 or events.wanted(cell):
                        running[task.remote(events.function(cell), cell.config, self.cpus_per_cell)] = (cell, attempt)
                        events.started(cell)
                if not running:
                    return
                ready, _ = ray.wait(list(running), num_returns=1, timeout=1.0)
                for ref in ready:
                    cell, attempt = running.pop(ref)
                    try:
                        result = ray.get(ref)
                    except ray.exceptions.RayError as e:
                        first = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                        if _lost_worker(e) and attempt <= self.retries:
                            events.again(cell, f"{first}; running the cell again")
                            pending.append((cell, attempt + 1))
                        else:
                            events.failed(cell, first, str(e), None, attempt, "ray")
                        continue
                    if result[0] == "done":
                        events.done(cell, result[1], result[2], attempt, result[3])
                    else:
                        events.failed(cell, result[1], result[2], result[3], attempt, result[4])
        finally:
            if started:
                ray.shutdown()
            else:  # interrupted on someone else's cluster: its CPUs go back now
                for ref in running:
                    ray.cancel(ref, force=True)
