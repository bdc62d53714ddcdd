"""``attnkit arena sweep [TASK] ...``: an arena grid as cells through a sweep engine.

The grid options are ``attnkit arena``'s; those not given take the default figure's
(``attnkit.sweeps.arena.FIGURE``: the shape of Zoology's MQAR figure, arXiv 2312.04927
Fig. 2). Cells go through ``--engine local`` (worker processes) or ``--engine ray`` into
``--out``/sweep.sqlite; finished cells are skipped on the next run (``--rerun`` computes
them again); ``results.csv`` and ``accuracy_vs_width.png`` are written from the store at
the end, whatever run computed each cell.
"""

from __future__ import annotations

import json
import sys

from ..extras import require
from .arena import (
    CONNECT_TIMEOUT_S,
    LIBRARY_OPTIONS,
    Default,
    DefaultInt,
    DefaultList,
    check_grid,
    parse_params,
    parse_target,
    resolve_init,
    task_from_params,
)
from .options import options_named, output_dir

#: options that make no sense cell by cell: what to use instead
REFUSED = {
    "export": "export one run with 'attnkit arena TASK ... --export DIR'",
    "checkpoint_every": "a sweep resumes cell by cell from its store",
    "resume": "a sweep resumes from its store by itself (--rerun recomputes)",
}


def grid_of(args) -> dict:
    """The grid the command asks for: each option not given takes the figure's value
    when the task is the figure's (mqar), else ``attnkit arena``'s default."""
    from ..sweeps.arena import FIGURE

    figure = args.task == FIGURE["task"]
    params = parse_params(args.param)
    if isinstance(args.param, DefaultList) and figure:
        params = dict(FIGURE["task_params"])
    mechanisms = FIGURE["mechanisms"] if isinstance(args.mechanisms, Default) and figure else str(args.mechanisms)
    widths = list(FIGURE["widths"]) if isinstance(args.d_model, DefaultList) and figure else list(args.d_model)
    seeds = FIGURE["seeds"] if isinstance(args.seeds, DefaultInt) and figure else int(args.seeds)
    given = {
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "eval_every": args.eval_every,
        "eval_examples": args.eval_examples,
        **parse_target(args.target),
        "eval_lengths": args.eval_lengths,
        "criterion": args.criterion,
        "keep_best": args.keep_best or None,
        "schedule": None if args.schedule is None else args.schedule,
    }
    overrides = {**(FIGURE["overrides"] if figure else {}), **{k: v for k, v in given.items() if v is not None}}
    return {"params": params, "mechanisms": mechanisms, "widths": widths, "seeds": list(range(seeds)), "overrides": overrides}


def make_engine(args):
    from ..sweeps import LocalEngine, RayEngine

    if args.engine == "ray":
        require("ray", "attnkit arena sweep --engine ray")
        if args.address and args.workers:
            raise ValueError("--workers: with --address the cluster's CPUs decide (leave --workers out)")
        timeout = args.connect_timeout or CONNECT_TIMEOUT_S
        with options_named({"address": "--address"}):
            return RayEngine(args.address, timeout, num_cpus=args.workers, cpus_per_cell=1)
    if args.address or args.connect_timeout:
        raise ValueError(f"{'--address' if args.address else '--connect-timeout'}: only with --engine ray")
    return LocalEngine(workers=args.workers or 2, threads=args.threads)


def status_printer(quiet: bool):
    """One progress line on stderr, rewritten in place on a terminal."""
    if quiet:
        return None
    tty = sys.stderr.isatty()
    last = [""]

    def show(status):
        line = f"sweep {status.line()}"
        if line == last[0]:
            return
        last[0] = line
        sys.stderr.write(f"\r{line[:200]}\033[K" if tty else line + "\n")
        sys.stderr.flush()

    return show


def run_sweep_command(args) -> int:
    from ..arena.runner import check, format_table, plan, write_csv
    from ..sweeps import load, run_sweep
    from ..sweeps.arena import arena_cells
    from ..sweeps.results import cells as cell_records

    for name, instead in REFUSED.items():
        if getattr(args, name):
            raise ValueError(f"--{name.replace('_', '-')}: not with 'attnkit arena sweep' ({instead})")
    grid = grid_of(args)
    task = task_from_params(args.task, grid["params"])
    args.mechanisms = grid["mechanisms"]
    check_grid(task, args, grid["widths"], args.seq_len)
    if not args.no_plots:
        require("matplotlib", "attnkit arena's figures (--no-plots skips them)")
    init = resolve_init(args.init)
    engine = make_engine(args)
    with options_named({"mechanisms": "--mechanisms", **LIBRARY_OPTIONS}):
        cells = arena_cells(
            task,
            grid["mechanisms"],
            grid["widths"],
            args.layers,
            args.heads,
            grid["seeds"],
            args.seq_len,
            grid["overrides"],
            args.max_len,
            init,
        )
        check(
            plan(
                task, grid["mechanisms"], grid["widths"], args.layers, args.heads, grid["seeds"], args.seq_len, args.max_len, init
            )
        )  # a mechanism that cannot read the task fails before any cell runs
    output_dir(args.out)
    try:
        with options_named({"out": "--out", "address": "--address"}):
            result = run_sweep(
                cells, args.out, engine, rerun=args.rerun, max_failures=args.max_failures, on_status=status_printer(args.quiet)
            )
    except ConnectionError as e:  # the engine's message starts with "address:"
        if str(e).startswith("address:"):
            raise ValueError(f"--{e}") from None
        raise
    except KeyboardInterrupt:
        print(
            f"\nattnkit arena sweep: interrupted; finished cells are in {args.out} (run the command again to go on)",
            file=sys.stderr,
        )
        return 130
    if not args.quiet and sys.stderr.isatty():
        sys.stderr.write("\n")
    order = {c.hash: i for i, c in enumerate(cells)}
    rows = sorted((r for r in load(args.out) if r["cell"] in order), key=lambda r: order[r["cell"]])
    files = {"store": f"{args.out}/sweep.sqlite", "csv": f"{args.out}/results.csv"}
    write_csv(rows, files["csv"])
    figures = []
    if rows and not args.no_plots:
        from ..arena.plots import accuracy_vs_width

        figures.append(accuracy_vs_width(rows, f"{args.out}/accuracy_vs_width.png"))
    failed = [c for c in cell_records(args.out) if c["status"] == "failed" and c["hash"] in order]
    summary = {
        "cells": len(cells),
        "computed": len(result.computed),
        "from_store": len(result.skipped),
        "failed": len(failed),
        "stopped": result.stopped,
        "seconds": round(result.seconds, 1),
        "engine": engine.name,
        "grid_hash": result.grid_hash,
    }
    if args.json:
        print(
            json.dumps(
                {
                    "rows": rows,
                    "summary": summary,
                    "failed": [{k: c[k] for k in ("label", "error")} for c in failed],
                    "files": {**files, "figures": figures},
                },
                indent=1,
            )
        )
    else:
        print(
            f"attnkit arena sweep {task.name} ({task.paper}) — {engine.name} engine, {len(cells)} cells: "
            f"{summary['computed']} computed, {summary['from_store']} from the store, {summary['failed']} failed, "
            f"{summary['seconds']} s"
        )
        if rows:
            print(format_table(rows))
        for c in failed:
            print(f"FAILED {c['label']}: {c['error']}")
        print(f"\nstore: {files['store']}; table: {files['csv']}" + (f"; figure: {', '.join(figures)}" if figures else ""))
    return 1 if failed else 0
