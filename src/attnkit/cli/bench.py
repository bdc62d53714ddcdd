"""``attnkit bench``: attnkit against torch SDPA on this machine, as a table (and JSON)."""

from __future__ import annotations

from ..bench import SUITES, format_table, machine_info, run_suite, suite_module, write_json
from .options import output_file
from .progress import Progress


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark attnkit against torch SDPA on this machine",
        description="Time attnkit against baselines measured in the same run (medians over repeats); peak memory in fresh subprocesses.",
    )
    p.add_argument("--quick", action="store_true", help="small sizes, about a minute on 2 cores")
    p.add_argument("--suite", action="append", choices=SUITES, help="suite to run (repeatable; default: all)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.json:
        output_file(args.json, "--json")  # before minutes of timing, not after
    suites = list(dict.fromkeys(args.suite or SUITES))  # a suite named twice runs once
    rows = []
    for name in suites:
        progress = Progress(suite_module(name).STEPS, f"bench {name}", enabled=not args.quiet)
        rows += run_suite(name, args.quick, progress=progress.step)
    meta = {"quick": args.quick, **machine_info()}
    if args.json:
        write_json(rows, args.json, meta)
    print(
        f"attnkit bench ({'quick' if args.quick else 'full'}) — torch {meta['torch']}, {meta['threads']} threads, CPU {meta['cpu_capability']}"
    )
    print(format_table(rows))
    missed = [r for r in rows if r.ok is False]
    print(
        f"\n{len(rows) - len(missed)}/{len(rows)} rows meet their targets"
        + (f"; missed: {', '.join(r.case + ' ' + r.size for r in missed)}" if missed else "")
    )
    return 0
