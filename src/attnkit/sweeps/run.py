"""``run_sweep``: a grid's cells through an engine into the store, resumable.

Cells the store holds as done are skipped (a second run with the same ``out`` computes
only what is missing: cells never run, cut off, or failed); ``rerun=True`` computes
every cell again and replaces its rows. A failed cell records its error and traceback
and the sweep goes on; once more than ``max_failures`` cells have failed, no new cell
starts (those running finish) and the sweep ends. Just before a cell is handed out the
store is read again, so two sweeps sharing ``out`` seldom compute the same cell twice
(and when they do, it is stored once).

``on_status(status)`` receives a ``SweepStatus`` whenever something changes: done,
running, failed, skipped, an ETA from the median seconds of the cells done so far and
the engine's parallelism, and the last line of the cell that spoke last.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from .cells import Cell, check_cells, grid_hash
from .kinds import cell_function
from .store import Store


@dataclass
class SweepStatus:
    total: int
    skipped: int = 0
    done: int = 0
    failed: int = 0
    running: int = 0
    seconds: list[float] = field(default_factory=list)
    last: str = ""
    started_at: float = field(default_factory=time.perf_counter)
    parallelism: int = 1

    @property
    def remaining(self) -> int:
        return self.total - self.skipped - self.done - self.failed

    @property
    def eta_s(self) -> float | None:
        """Seconds until the last cell ends, if the rest take the median time so far."""
        if not self.seconds:
            return None
        return statistics.median(self.seconds) * self.remaining / max(1, min(self.parallelism, self.remaining or 1))

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started_at

    def line(self) -> str:
        eta = "" if self.eta_s is None else f" eta {_clock(self.eta_s)}"
        skipped = f" ({self.skipped} from the store)" if self.skipped else ""
        return (
            f"{self.done + self.skipped}/{self.total} done{skipped}, {self.running} running, {self.failed} failed, "
            f"{_clock(self.elapsed_s)}{eta}" + (f" | {self.last}" if self.last else "")
        )


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return (
        f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
        if seconds >= 3600
        else f"{seconds // 60}:{seconds % 60:02d}"
    )


@dataclass
class SweepResult:
    """What a sweep did: cells computed, skipped (done before) and failed, by hash."""

    out: str
    grid_hash: str
    computed: list[str]
    skipped: list[str]
    failed: list[str]
    stopped: bool
    seconds: float


class _Events:
    """What the engines report to; writes the store and keeps the status."""

    def __init__(self, store: Store, status: SweepStatus, engine, rerun: bool, max_failures: int | None, on_status):
        self.store, self.status, self.engine, self.rerun, self.max_failures = store, status, engine, rerun, max_failures
        self.on_status = on_status or (lambda status: None)
        self.computed: list[str] = []
        self.failed_hashes: list[str] = []
        self.functions: dict[str, object] = {}
        self.taken_by_other: list[str] = []

    def function(self, cell: Cell):
        if cell.kind not in self.functions:
            self.functions[cell.kind] = cell_function(cell.kind)
        return self.functions[cell.kind]

    def stopping(self) -> bool:
        return self.max_failures is not None and self.status.failed > self.max_failures

    def wanted(self, cell: Cell) -> bool:
        """Whether to hand ``cell`` out now: not when another sweep on the same store has
        finished it meanwhile (unless this is a rerun)."""
        if self.rerun or self.store.status([cell.hash]).get(cell.hash) != "done":
            return True
        self.taken_by_other.append(cell.hash)
        self.status.skipped += 1
        self.on_status(self.status)
        return False

    def started(self, cell: Cell) -> None:
        self.status.running += 1
        self.status.parallelism = getattr(self.engine, "parallelism", 1)  # Ray knows its CPUs once connected
        self.status.last = f"{cell.label}: started"
        self.on_status(self.status)

    def line(self, cell: Cell, text: str) -> None:
        self.status.last = f"{cell.label}: {text}"
        self.on_status(self.status)

    def again(self, cell: Cell, why: str) -> None:
        """The engine gives ``cell`` again (its worker died): no longer running meanwhile."""
        self.status.running -= 1
        self.line(cell, why)

    def done(self, cell: Cell, rows: list, seconds: float, attempts: int, node: str | None) -> None:
        try:
            stored = self.store.record_done(cell, rows, seconds, attempts, node, replace=self.rerun)
        except ValueError as e:  # rows the store cannot hold: the cell failed, the sweep goes on
            self.failed(cell, str(e), None, seconds, attempts, node)
            return
        self.status.running -= 1
        if stored:
            self.computed.append(cell.hash)
        else:  # another sweep on the same store finished it first; its rows stand
            self.taken_by_other.append(cell.hash)
        self.status.done += 1
        self.status.seconds.append(seconds)
        self.status.last = f"{cell.label}: done in {seconds:.1f} s"
        self.on_status(self.status)

    def failed(self, cell: Cell, error: str, tb: str | None, seconds: float | None, attempts: int, node: str | None) -> None:
        self.status.running -= 1
        self.store.record_failed(cell, error, tb, seconds, attempts, node)
        self.status.failed += 1
        self.failed_hashes.append(cell.hash)
        self.status.last = f"{cell.label}: FAILED {error.splitlines()[0] if error else ''}"
        self.on_status(self.status)


def run_sweep(cells, out: str, engine=None, rerun: bool = False, max_failures: int | None = None, on_status=None) -> SweepResult:
    """Run ``cells`` (a list of ``Cell``) with ``engine`` (default ``LocalEngine()``),
    storing into ``out`` (a directory; see store.py). See the module docstring."""
    from .local import LocalEngine

    cells = check_cells(cells)
    if max_failures is not None and (isinstance(max_failures, bool) or not isinstance(max_failures, int) or max_failures < 0):
        raise ValueError(f"max_failures: expected an int >= 0 or None, got {max_failures!r}")
    for kind in {c.kind for c in cells}:
        cell_function(kind)  # an unknown or broken kind fails here, not in every worker
    engine = engine or LocalEngine()
    grid = grid_hash(cells)
    start = time.perf_counter()
    with Store.open(out, grid) as store:
        done_before = {h for h, s in store.status().items() if s == "done"}
        todo = cells if rerun else [c for c in cells if c.hash not in done_before]
        skipped = [c.hash for c in cells if c.hash in done_before and not rerun]
        status = SweepStatus(total=len(cells), skipped=len(skipped), parallelism=getattr(engine, "parallelism", 1))
        events = _Events(store, status, engine, rerun, max_failures, on_status)
        if todo:
            engine.run(todo, events)
        return SweepResult(
            out,
            grid,
            events.computed,
            skipped + events.taken_by_other,
            events.failed_hashes,
            events.stopping(),
            time.perf_counter() - start,
        )
