"""Reading a sweep's store back: rows as dicts, a pandas DataFrame, CSV, and the cell summary.

``load(out)`` gives the finished cells' tidy rows (each with its ``cell`` hash), in the
order the cells finished; ``load_frame(out)`` the same as a pandas DataFrame (pandas is
optional: ``pip install 'attnkit[ray]'`` brings it); ``cells(out)`` one dict per cell with
its status, error, seconds and where it ran.
"""

from __future__ import annotations

import csv
import io
import json

from ..extras import require
from .store import Store


def load(out: str, with_cell: bool = True) -> list[dict]:
    with Store.read(out, "out") as store:
        return store.rows(with_cell)


def cells(out: str) -> list[dict]:
    with Store.read(out, "out") as store:
        return store.cells()


def load_frame(out: str):
    pandas = require("pandas", "attnkit.sweeps.load_frame")
    return pandas.DataFrame(load(out))


def columns(rows: list[dict]) -> list[str]:
    """Every key of the rows, in first-seen order."""
    return list(dict.fromkeys(k for row in rows for k in row))


def to_csv(rows: list[dict]) -> str:
    """CSV text; nested values (e.g. the arena's per-group accuracies) as JSON."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns(rows), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in row.items()})
    return buffer.getvalue()


def format_table(rows: list[dict], limit: int | None = None) -> str:
    """A plain text table of the scalar columns (nested values left out)."""
    shown = rows if limit is None else rows[:limit]
    names = [c for c in columns(shown) if all(not isinstance(r.get(c), (dict, list)) for r in shown)]
    text = [[_cell(r.get(c)) for c in names] for r in shown]
    widths = [max([len(n)] + [len(t[i]) for t in text]) for i, n in enumerate(names)]
    lines = ["  ".join(n.ljust(w) for n, w in zip(names, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(t, widths)) for t in text]
    return "\n".join(lines)


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)
