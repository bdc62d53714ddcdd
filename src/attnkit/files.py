"""Files written so that a run stopped mid-write never leaves a broken one (the resumable
caches of head profiling and HeadHunter)."""

from __future__ import annotations

import json
import os
import tempfile


def write_json_atomic(path: str | os.PathLike, data, *, indent: int | None = None) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file in the same folder and
    an ``os.replace``: a crash mid-write leaves the previous file whole."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=indent)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
