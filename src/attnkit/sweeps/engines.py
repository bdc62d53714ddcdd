"""An engine by name, as the commands that run their grids as sweeps take it
(``--engine local|ray --workers N --address ADDR``)."""

from __future__ import annotations


def engine_named(engine: str, workers: int | None = None, address: str | None = None):
    """``LocalEngine(workers or 2)`` for ``"local"``, ``RayEngine(address, num_cpus=workers)``
    for ``"ray"`` (a local instance when ``address`` is None); each bad value named."""
    from .local import LocalEngine
    from .on_ray import RayEngine

    if engine not in ("local", "ray"):
        raise ValueError(f"--engine: expected local or ray, got {engine!r}")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"--workers: expected an int >= 1, got {workers!r}")
    if engine == "local":
        if address is not None:
            raise ValueError("--address: only with --engine ray")
        return LocalEngine(workers=workers or 2)
    return RayEngine(address, num_cpus=workers)


__all__ = ["engine_named"]
