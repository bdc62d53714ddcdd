"""Small grids of the ``toy`` cell kind shared by the sweep tests."""

from attnkit.sweeps import Cell


def toy_cells(n: int, **config) -> list[Cell]:
    return [Cell("toy", {"id": i, **config}, f"toy {i}") for i in range(n)]


def ran(log) -> list[int]:
    """The ids of the cells that started, in order, from a toy log file."""
    return [int(line) for line in log.read_text().split()] if log.exists() else []


def comparable(rows: list[dict], drop=("cell", "train_seconds", "tokens_per_s")) -> list[dict]:
    """Rows without what differs between two runs of the same cells (timings, store keys)."""
    return sorted(({k: v for k, v in r.items() if k not in drop} for r in rows), key=repr)
