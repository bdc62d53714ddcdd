"""``attnkit arena``: train mechanisms on a synthetic task and compare them in a table.

    attnkit arena mqar --mechanisms softmax,sigmoid,linear_elu,deltanet --d-model 64,128 --seeds 3

writes results.csv, results.json and accuracy_vs_{width,length,time}.png to --out.
"""

from __future__ import annotations

import json
import math
import os

from .progress import Progress


def add_parser(sub) -> None:
    from ..arena.tasks import TASKS

    p = sub.add_parser("arena", help="compare attention mechanisms on synthetic tasks with a tiny trainer",
                       description="Train a model per mechanism x width x sequence length x seed on a synthetic task (CPU, "
                                   "deterministic from the seed) and write a results table (CSV, JSON) and plots.")
    p.add_argument("task", choices=list(TASKS), help="the synthetic task")
    p.add_argument("--mechanisms", default="softmax", metavar="LIST",
                   help="comma-separated registered mechanisms, each optionally name:key=value:... (default: softmax)")
    p.add_argument("--d-model", default="64", metavar="LIST", help="model widths, e.g. 64,128 (default: 64)")
    p.add_argument("--layers", type=int, metavar="N", help="attention layers (default: 2; the associative probe has 1)")
    p.add_argument("--heads", type=int, metavar="N", help="attention heads (default: the task's, 4 or 1)")
    p.add_argument("--seeds", type=int, default=1, metavar="N", help="seeds 0..N-1 per configuration (default: 1)")
    p.add_argument("--seq-len", metavar="LIST", help="training sequence lengths, e.g. 64,128 (default: the task's)")
    p.add_argument("--steps", type=int, metavar="N", help="training steps at most (default: the task's)")
    p.add_argument("--batch-size", type=int, metavar="N", help="examples per step (default: the task's)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: the task's)")
    p.add_argument("--eval-every", type=int, metavar="N", help="steps between held-out evaluations (default: 100)")
    p.add_argument("--eval-examples", type=int, metavar="N", help="held-out examples (default: 256)")
    p.add_argument("--target", metavar="ACC", help="stop a run once held-out accuracy reaches ACC, or 'none' (default: the task's)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a task parameter, VALUE as JSON, e.g. num_kv_pairs=[4,8] (repeatable)")
    p.add_argument("--out", default="attnkit-arena", metavar="DIR", help="output directory (default: ./attnkit-arena)")
    p.add_argument("--checkpoint-every", type=int, metavar="N", help="write a checkpoint every N steps under DIR/checkpoints")
    p.add_argument("--resume", action="store_true", help="continue runs from their checkpoints in DIR/checkpoints")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="torch CPU threads (default: 1; the models are tiny, and a second thread only waits on a busy machine)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG figures")
    p.add_argument("--json", action="store_true", help="print the rows and file paths as JSON instead of a table")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=run)


def parse_ints(spec: str | None, name: str) -> list[int] | None:
    if spec is None:
        return None
    try:
        values = [int(part) for part in spec.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated integers, got {spec!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{name}: expected positive integers, got {spec!r}")
    return values


def parse_params(items: list[str]) -> dict:
    from ..arena.models import parse_assignment

    params = {}
    for item in items:
        pair = parse_assignment(item)
        if pair is None:
            raise ValueError(f"--param: expected KEY=VALUE, got {item!r}")
        params[pair[0]] = pair[1]
    return params


def parse_target(spec: str | None):
    if spec is None:
        return {}
    if spec.lower() == "none":
        return {"target_accuracy": None}
    try:
        return {"target_accuracy": float(spec)}
    except ValueError:
        raise ValueError(f"--target: expected an accuracy in (0, 1] or 'none', got {spec!r}") from None


def run(args) -> int:
    import torch

    from ..arena.plots import write_plots
    from ..arena.runner import format_table, plan, run_grid, train_config, write_csv, write_json
    from ..arena.tasks import make_task

    if args.threads < 1:
        raise ValueError(f"--threads: expected a positive int, got {args.threads}")
    torch.set_num_threads(args.threads)
    if args.seeds < 1:
        raise ValueError(f"--seeds: expected a positive int, got {args.seeds}")
    task = make_task(args.task, **parse_params(args.param))
    widths = parse_ints(args.d_model, "--d-model")
    seq_lens = parse_ints(args.seq_len, "--seq-len")
    seeds = list(range(args.seeds))
    overrides = {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "eval_every": args.eval_every,
                 "eval_examples": args.eval_examples, "checkpoint_every": args.checkpoint_every, **parse_target(args.target)}
    runs = plan(task, args.mechanisms, widths, args.layers, args.heads, seeds, seq_lens)
    # One progress tick per evaluation; a run that stops early jumps to its last tick.
    ticks = [math.ceil(c.steps / c.eval_every) for c in (train_config(r.task, r.seed, overrides) for r in runs)]
    progress = Progress(sum(ticks), f"arena {task.name}", enabled=not args.quiet)
    ends = iter([sum(ticks[: i + 1]) for i in range(len(ticks))])

    def on_eval(run, record):
        progress.step(f"{run.label} step {record['step']} acc {record['accuracy']:.3f}")

    def on_run(run, rows):
        end = next(ends)
        if progress.done < end:
            progress.done = end - 1
            progress.step(f"{run.label} done, acc {rows[0]['accuracy']:.3f}")

    os.makedirs(args.out, exist_ok=True)
    checkpoints = os.path.join(args.out, "checkpoints") if (args.checkpoint_every or args.resume) else None
    rows, records = run_grid(task, args.mechanisms, widths, args.layers, args.heads, seeds, seq_lens, overrides,
                             checkpoints, args.resume, on_eval, on_run)
    files = {"csv": os.path.join(args.out, "results.csv"), "json": os.path.join(args.out, "results.json")}
    write_csv(rows, files["csv"])
    meta = {"task": task.name, "task_params": task.params(), "mechanisms": args.mechanisms, "widths": widths,
            "seeds": seeds, "overrides": {k: v for k, v in overrides.items() if v is not None}}
    write_json(rows, records, meta, files["json"])
    figures = [] if args.no_plots else write_plots(rows, records, args.out)
    if args.json:
        print(json.dumps({"rows": rows, "files": {**files, "figures": figures}}, indent=1))
    else:
        print(f"attnkit arena {task.name} ({task.paper}) — torch {torch.__version__}, {torch.get_num_threads()} threads")
        print(format_table(rows))
        print(f"\nresults: {files['csv']}, {files['json']}" + (f"; figures: {', '.join(figures)}" if figures else ""))
    return 0
