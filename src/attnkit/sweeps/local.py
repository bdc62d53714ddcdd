"""The local engine: cells in worker processes on this machine, no service to start.

Each worker is a process of its own (``python -m attnkit.sweeps.worker``, worker.py) with
a socket to the parent; the parent hands a cell to an idle worker and waits on every
socket at once. A worker that dies mid-cell (killed, out of memory, a crash in native
code) closes its socket: the parent starts a new worker and gives the cell again, up to
``retries`` times, then records it as failed. Only the parent writes the store, so a
dead worker never leaves half a cell behind. Why not ``concurrent.futures``: a dead
worker breaks its whole ``ProcessPoolExecutor`` and every cell in flight with it,
without saying which cell it was running.

How a worker starts: on Linux, with one thread per worker, it is forked from this process,
which has torch, attnkit and the cells' module loaded already, so it starts at once; a
fresh interpreter spends 1–2 s importing them, which on a sweep of small cells was most of
what two workers could save. Otherwise (other platforms, or several threads per worker:
a forked child must not start an OpenMP team its parent may have started) it is a fresh
``python -m`` process.

Threads: each worker sets torch to ``threads`` intra-op threads (default
``cores // workers``, at least 1), so workers × threads stays within the cores.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cells import Cell


def default_threads(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // workers)


def _forking(threads: int) -> bool:
    return sys.platform == "linux" and threads == 1


class _Forked:
    """A worker forked from this process, with ``subprocess.Popen``'s ``wait`` and ``kill``."""

    def __init__(self, mine: socket.socket, theirs: socket.socket, threads: int, others: list[Connection]):
        self.pid = os.fork()
        if self.pid == 0:  # the worker: it never returns into the parent's code
            code = 1
            try:
                # The parent's ends, closed here so that a parent that dies is an EOF to its workers.
                mine.close()
                for other in others:
                    other.close()
                from .worker import serve

                serve(Connection(theirs.detach()), threads)
                code = 0
            finally:
                os._exit(code)
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, 0 if end is None else os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                continue
            assert end is not None and timeout is not None  # a blocking waitpid (no timeout) returns only with the pid
            if time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class _Slot:
    """One worker process and what it is running."""

    conn: Connection

    def __init__(self, threads: int, others: list[_Slot]):
        mine, theirs = socket.socketpair()
        if _forking(threads):
            self.process: _Forked | subprocess.Popen = _Forked(mine, theirs, threads, [o.conn for o in others])
        else:
            # The worker imports what this process can: cell kinds defined on this sys.path.
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            self.process = subprocess.Popen(
                [sys.executable, "-m", "attnkit.sweeps.worker", str(theirs.fileno()), str(threads)],
                pass_fds=[theirs.fileno()],
                env=env,
                stdin=subprocess.DEVNULL,
            )
        theirs.close()
        self.conn = Connection(mine.detach())
        self.job: tuple[Cell, int] | None = None  # (cell, attempt) while busy
        self.started = 0.0

    def give(self, cell: Cell, fn, attempt: int) -> None:
        self.job = (cell, attempt)
        self.started = time.perf_counter()
        self.conn.send((fn, cell.config))

    def exit_code(self) -> int | None:
        try:
            return self.process.wait(5)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, force: bool = False) -> None:
        if not force:
            try:
                self.conn.send(None)
            except (EOFError, OSError):
                pass
        if force or self.exit_code() is None:
            self.process.kill()
            self.process.wait()
        self.conn.close()


class LocalEngine:
    """``run(cells, events)`` for the sweep runner (see run.py): ``events`` gives each
    cell's function and whether to stop, and receives ``started``, ``line``, ``done``
    and ``failed``."""

    name = "local"

    def __init__(self, workers: int = 2, threads: int | None = None, retries: int = 2):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers: expected a positive int, got {workers!r}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads: expected a positive int or None, got {threads!r}")
        self.workers, self.retries = workers, retries
        self.threads = default_threads(workers) if threads is None else threads
        self.slots: list[_Slot] = []

    @property
    def parallelism(self) -> int:
        return self.workers

    def run(self, cells, events) -> None:
        pending = [(cell, events.function(cell), 1) for cell in reversed(cells)]  # pop() keeps the grid order
        try:
            self.slots = []
            for _ in range(min(self.workers, len(pending))):
                self.slots.append(_Slot(self.threads, self.slots))
            while True:
                for slot in self.slots:
                    while slot.job is None and pending and not events.stopping():
                        cell, fn, attempt = pending.pop()
                        if attempt > 1 or events.wanted(cell):
                            slot.give(cell, fn, attempt)
                            events.started(cell)
                busy = [s for s in self.slots if s.job is not None]
                if not busy:
                    return
                ready = wait([s.conn for s in busy], timeout=1.0)
                for i, slot in enumerate(self.slots):
                    if slot.job is None or slot.conn not in ready:
                        continue
                    cell, attempt = slot.job
                    try:
                        message = slot.conn.recv()
                    except (EOFError, OSError):  # the worker died mid-cell: a new one, and the cell again
                        code = slot.exit_code()
                        seconds = time.perf_counter() - slot.started
                        slot.job = None
                        slot.stop(force=True)
                        self.slots[i] = _Slot(self.threads, [s for s in self.slots if s is not slot])
                        if attempt <= self.retries:
                            events.again(cell, f"worker died (exit code {code}); running the cell again")
                            pending.append((cell, events.function(cell), attempt + 1))
                        else:
                            events.failed(
                                cell,
                                f"worker died (exit code {code}) on each of {attempt} attempts",
                                None,
                                seconds,
                                attempt,
                                "local",
                            )
                        continue
                    if message[0] == "line":
                        events.line(cell, message[1])
                    elif message[0] == "done":
                        slot.job = None
                        events.done(cell, message[1], message[2], attempt, None)
                    else:
                        slot.job = None
                        events.failed(cell, message[1], message[2], message[3], attempt, None)
        finally:
            for slot in self.slots:
                slot.stop(force=slot.job is not None)
            self.slots = []
