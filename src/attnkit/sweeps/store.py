"""The results store: one SQLite database per sweep (``DIR/sweep.sqlite``).

Tables:

- ``meta``: the attnkit version and the grid hash the store was made for (a store of
  another version or grid is refused, saying which and why: its rows would not be
  comparable, or would mix two grids in one table);
- ``cells``: one row per cell hash — kind, config, label, status (``done`` or
  ``failed``), error and traceback, seconds, attempts, the attnkit version and grid
  hash that wrote it, where it ran, when;
- ``rows``: the cell's tidy rows (JSON objects, e.g. the arena table's rows or a
  ``ProbeResult``'s), keyed by (cell hash, index).

A finished cell's rows and its status are written in one transaction, so a reader sees
a cell with all its rows or not at all, and a sweep killed at any moment loses no
finished cell. WAL mode and ``BEGIN IMMEDIATE`` let two sweeps write the same store at
once (SQLite serialises the writers; each waits up to ``busy_timeout``): a cell two
writers finish is kept once — the first finish stands, unless the second is a
``--rerun``, whose rows replace it.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import time
from contextlib import contextmanager

from .cells import Cell

FILENAME = "sweep.sqlite"
SCHEMA = 1
BUSY_TIMEOUT_S = 60.0

_TABLES = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS cells (
    hash TEXT PRIMARY KEY, kind TEXT NOT NULL, config TEXT NOT NULL, label TEXT NOT NULL,
    status TEXT NOT NULL, error TEXT, traceback TEXT, seconds REAL, attempts INTEGER NOT NULL DEFAULT 1,
    attnkit_version TEXT NOT NULL, grid_hash TEXT NOT NULL, node TEXT, finished_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS rows (hash TEXT NOT NULL, idx INTEGER NOT NULL, data TEXT NOT NULL, PRIMARY KEY (hash, idx));
"""


def attnkit_version() -> str:
    from .. import __version__

    return __version__


def store_path(directory: str) -> str:
    return os.path.join(directory, FILENAME)


class Store:
    """The store under ``directory``. ``Store.open(directory, grid_hash)`` creates it or
    checks that it belongs to this version and grid; ``Store.read(directory)`` opens an
    existing one for reading whatever made it."""

    def __init__(self, path: str, connection: sqlite3.Connection):
        self.path, self.db = path, connection

    # -- opening -------------------------------------------------------------------------------

    @classmethod
    def _connect(cls, path: str) -> sqlite3.Connection:
        # isolation_level=None: transactions are the explicit BEGIN IMMEDIATE ... COMMIT below.
        db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a committed cell survives a killed process
        return db

    @classmethod
    def open(cls, directory: str, grid: str, version: str | None = None, option: str = "out") -> Store:
        """The store for a sweep of grid ``grid`` (see ``grid_hash``) by this attnkit
        ``version``; refused, naming ``option``, when it was made for another."""
        version = version or attnkit_version()
        os.makedirs(directory, exist_ok=True)
        path = store_path(directory)
        try:
            db = cls._connect(path)
            db.executescript(_TABLES)  # idempotent; two sweeps starting at once both get the same tables
            with _transaction(db):
                meta = dict(db.execute("SELECT key, value FROM meta"))
                if not meta:
                    meta = {"schema": str(SCHEMA), "attnkit_version": version, "grid_hash": grid, "created": str(time.time())}
                    db.executemany("INSERT INTO meta VALUES (?, ?)", list(meta.items()))
        except sqlite3.DatabaseError as e:
            raise ValueError(f"{option}: {path} is not a sweep store ({e})") from None
        if meta.get("schema") != str(SCHEMA):
            db.close()
            raise ValueError(
                f"{option}: {path} has store schema {meta.get('schema')}, this attnkit writes {SCHEMA}; use another directory"
            )
        if meta["attnkit_version"] != version:
            db.close()
            raise ValueError(
                f"{option}: {path} was written by attnkit {meta['attnkit_version']}, this is {version}: "
                f"results of two versions are not comparable; use another directory (or --rerun into a new one)"
            )
        if meta["grid_hash"] != grid:
            db.close()
            raise ValueError(
                f"{option}: {path} holds another grid (grid hash {meta['grid_hash']}, this grid {grid}): "
                f"a store keeps one grid's table; use another directory for this grid"
            )
        return cls(path, db)

    @classmethod
    def read(cls, directory: str, option: str = "DIR") -> Store:
        path = store_path(directory) if os.path.isdir(directory) else directory
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{option}: no sweep store at {path} (expected a directory written by a sweep's --out)")
        try:
            db = cls._connect(path)
            db.execute("SELECT 1 FROM cells LIMIT 1")
        except sqlite3.DatabaseError as e:
            raise ValueError(f"{option}: {path} is not a sweep store ({e})") from None
        return cls(path, db)

    def close(self) -> None:
        self.db.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- reading -------------------------------------------------------------------------------

    def meta(self) -> dict:
        return dict(self.db.execute("SELECT key, value FROM meta"))

    def status(self, hashes=None) -> dict[str, str]:
        """{cell hash: status} of the recorded cells (of ``hashes`` when given)."""
        found = dict(self.db.execute("SELECT hash, status FROM cells"))
        return found if hashes is None else {h: found[h] for h in hashes if h in found}

    def cells(self) -> list[dict]:
        cursor = self.db.execute("SELECT * FROM cells ORDER BY finished_at")
        names = [d[0] for d in cursor.description]
        return [{**dict(zip(names, r)), "config": json.loads(r[names.index("config")])} for r in cursor]

    def rows(self, with_cell: bool = True) -> list[dict]:
        """Every finished cell's rows, in the order cells finished; with ``with_cell``
        each row also names its ``cell`` (hash)."""
        cursor = self.db.execute(
            "SELECT r.hash, r.data FROM rows r JOIN cells c ON c.hash = r.hash "
            "WHERE c.status = 'done' ORDER BY c.finished_at, r.hash, r.idx"
        )
        return [({"cell": h, **json.loads(d)} if with_cell else json.loads(d)) for h, d in cursor]

    # -- writing -------------------------------------------------------------------------------

    def record_done(
        self, cell: Cell, rows: list[dict], seconds: float, attempts: int = 1, node: str | None = None, replace: bool = False
    ) -> bool:
        """Write a finished cell and its rows in one transaction; False (nothing written)
        when the cell is done already and not ``replace``."""
        data = [json.dumps(_plain_row(row, i)) for i, row in enumerate(rows)]
        meta = self.meta()
        with _transaction(self.db):
            if not replace and self._is_done(cell.hash):
                return False
            self.db.execute("DELETE FROM rows WHERE hash = ?", (cell.hash,))
            self.db.executemany("INSERT INTO rows VALUES (?, ?, ?)", [(cell.hash, i, d) for i, d in enumerate(data)])
            self._put_cell(cell, "done", None, None, seconds, attempts, node, meta)
        return True

    def record_failed(
        self, cell: Cell, error: str, traceback: str | None, seconds: float | None, attempts: int = 1, node: str | None = None
    ) -> bool:
        """Record a failed cell (its error and traceback); a cell done already stays done."""
        meta = self.meta()
        with _transaction(self.db):
            if self._is_done(cell.hash):
                return False
            self.db.execute("DELETE FROM rows WHERE hash = ?", (cell.hash,))
            self._put_cell(cell, "failed", error, traceback, seconds, attempts, node, meta)
        return True

    def _is_done(self, hash_: str) -> bool:
        found = self.db.execute("SELECT status FROM cells WHERE hash = ?", (hash_,)).fetchone()
        return found is not None and found[0] == "done"

    def _put_cell(self, cell, status, error, traceback, seconds, attempts, node, meta) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO cells VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                cell.hash,
                cell.kind,
                json.dumps(cell.config, sort_keys=True),
                cell.label,
                status,
                error,
                traceback,
                seconds,
                attempts,
                meta["attnkit_version"],
                meta["grid_hash"],
                node or socket.gethostname(),
                time.time(),
            ),
        )


@contextmanager
def _transaction(db: sqlite3.Connection):
    # IMMEDIATE takes the write lock at BEGIN: two writers queue instead of one failing
    # half-way with "database is locked" on upgrading a read lock.
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _plain_row(row, index: int) -> dict:
    if not isinstance(row, dict):
        raise ValueError(f"rows: a cell kind returns a list of dicts (tidy rows); row {index} is {type(row).__name__}")
    return {str(k): _plain(v) for k, v in row.items()}


def _plain(value):
    """JSON-ready: tensors and numpy scalars as numbers, tuples as lists, the rest as text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    return str(value)
