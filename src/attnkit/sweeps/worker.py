"""A local worker process: ``python -m attnkit.sweeps.worker FD THREADS``.

It talks to the parent over the socket ``FD`` (pickled messages, multiprocessing's
``Connection``): receives (function, config) and sends ``("line", text)`` while the cell
runs and then one ``("done", rows, seconds)`` or ``("error", message, traceback, seconds)``.
A plain ``python -m`` process rather than multiprocessing's spawn, because spawn
re-imports the caller's ``__main__``: a script or notebook cell without the
``if __name__ == "__main__"`` guard would start the sweep again in every worker.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

from .kinds import set_reporter


def _exit_with(parent: int) -> None:
    """End this worker when the parent is gone (killed outright, it cannot say so): a
    cell nobody will store should not hold a core."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def serve(conn: Connection, threads: int) -> None:
    import torch

    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    torch.set_num_threads(threads)
    set_reporter(lambda text: conn.send(("line", text)))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):  # the parent is gone: nothing to report to
            return
        if job is None:
            return
        fn, config = job
        start = time.perf_counter()
        try:
            rows = fn(config)
            if not isinstance(rows, list):
                raise ValueError(
                    f"rows: the cell kind {fn.__module__}.{fn.__qualname__} returned {type(rows).__name__}, "
                    f"expected a list of dicts"
                )
            message: tuple[str, list, float] | tuple[str, str, str, float] = ("done", rows, time.perf_counter() - start)
        except Exception as e:
            message = ("error", f"{type(e).__name__}: {e}", traceback.format_exc(), time.perf_counter() - start)
        try:
            conn.send(message)
        except (EOFError, OSError):
            return
        except Exception as e:  # rows that cannot be pickled: the cell failed, the worker lives
            conn.send(
                (
                    "error",
                    f"rows: cannot be sent to the parent ({type(e).__name__}: {e})",
                    traceback.format_exc(),
                    time.perf_counter() - start,
                )
            )


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])), int(sys.argv[2]))
