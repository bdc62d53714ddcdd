"""``attnkit results DIR``: a sweep's store as a table, JSON or CSV.

    attnkit results mqar-sweep
    attnkit results mqar-sweep --csv > table.csv

prints the finished cells' tidy rows (each with its cell hash) and, on stderr with the
table, how many cells are done and which failed with their errors.
"""

from __future__ import annotations

import json
import sys


def add_parser(sub) -> None:
    p = sub.add_parser(
        "results",
        help="print a sweep's results store (attnkit arena sweep --out DIR)",
        description="Print the tidy rows of a sweep's store (DIR/sweep.sqlite) as a table, JSON or CSV.",
    )
    p.add_argument("dir", metavar="DIR", help="the sweep's --out directory (or its sweep.sqlite)")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="rows, cells and the store's meta as JSON")
    form.add_argument("--csv", action="store_true", help="rows as CSV (nested values as JSON)")
    p.add_argument("--failed", action="store_true", help="also print each failed cell's traceback")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..sweeps.results import format_table, to_csv
    from ..sweeps.store import Store

    with Store.read(args.dir, "DIR") as store:
        rows, cells, meta = store.rows(), store.cells(), store.meta()
    failed = [c for c in cells if c["status"] == "failed"]
    if args.json:
        print(
            json.dumps(
                {
                    "meta": meta,
                    "rows": rows,
                    "cells": [{k: v for k, v in c.items() if k != "traceback" or args.failed} for c in cells],
                },
                indent=1,
            )
        )
        return 0
    if args.csv:
        sys.stdout.write(to_csv(rows))
        return 0
    done = len(cells) - len(failed)
    print(
        f"{args.dir}: {done} cells done, {len(failed)} failed, {len(rows)} rows "
        f"(attnkit {meta.get('attnkit_version')}, grid {meta.get('grid_hash')})"
    )
    if rows:
        print(format_table(rows))
    for c in failed:
        print(f"FAILED {c['label']} ({c['hash']}): {c['error']}")
        if args.failed and c["traceback"]:
            print(c["traceback"])
    return 0
