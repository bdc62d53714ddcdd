"""``attnkit arena``: train mechanisms on a synthetic task and compare them in a table.

    attnkit arena mqar --mechanisms softmax,sigmoid,linear_elu,deltanet --d-model 64,128 --seeds 3

writes results.csv, results.json and accuracy_vs_{width,length,time}.png to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from ..extras import require
from .options import int_list, options_named, output_dir, positive_float, positive_int
from .progress import Progress


def add_parser(sub) -> None:
    from ..arena.tasks import TASKS

    p = sub.add_parser("arena", help="compare attention mechanisms on synthetic tasks with a tiny trainer",
                       description="Train a model per mechanism x width x sequence length x seed on a synthetic task (CPU, "
                                   "deterministic from the seed) and write a results table (CSV, JSON) and plots.")
    p.add_argument("task", choices=list(TASKS), help="the synthetic task")
    p.add_argument("--mechanisms", default="softmax", metavar="LIST",
                   help="comma-separated registered mechanisms, each optionally name:key=value:... (default: softmax)")
    p.add_argument("--d-model", type=int_list, default=[64], metavar="LIST", help="model widths, e.g. 64,128 (default: 64)")
    p.add_argument("--layers", type=positive_int, metavar="N", help="attention layers (default: 2; the associative probe has 1)")
    p.add_argument("--heads", type=positive_int, metavar="N", help="attention heads (default: the task's, 4 or 1)")
    p.add_argument("--seeds", type=positive_int, default=1, metavar="N", help="seeds 0..N-1 per configuration (default: 1)")
    p.add_argument("--seq-len", type=int_list, metavar="LIST", help="training sequence lengths, e.g. 64,128 (default: the task's)")
    p.add_argument("--steps", type=positive_int, metavar="N", help="training steps at most (default: the task's)")
    p.add_argument("--batch-size", type=positive_int, metavar="N", help="examples per step (default: the task's)")
    p.add_argument("--lr", type=positive_float, help="peak learning rate (default: the task's)")
    p.add_argument("--eval-every", type=positive_int, metavar="N", help="steps between held-out evaluations (default: 100)")
    p.add_argument("--eval-examples", type=positive_int, metavar="N", help="held-out examples (default: 256)")
    p.add_argument("--target", type=target_accuracy, metavar="ACC", help="stop a run once held-out accuracy reaches ACC, or 'none' (default: the task's)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a task parameter, VALUE as JSON, e.g. num_kv_pairs=[4,8] (repeatable)")
    p.add_argument("--out", default="attnkit-arena", metavar="DIR", help="output directory (default: ./attnkit-arena)")
    p.add_argument("--checkpoint-every", type=positive_int, metavar="N", help="write a checkpoint every N steps under DIR/checkpoints")
    p.add_argument("--resume", action="store_true", help="continue runs from their checkpoints in DIR/checkpoints")
    p.add_argument("--threads", type=positive_int, default=1, metavar="N",
                   help="torch CPU threads (default: 1; the models are tiny, and a second thread only waits on a busy machine)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG figures")
    p.add_argument("--export", metavar="DIR", help="write the trained model to DIR as a transformers LlamaForCausalLM with "
                                                   "its tokenizer and task.json (one run only; softmax + RoPE models)")
    p.add_argument("--json", action="store_true", help="print the rows and file paths as JSON instead of a table")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=run)


def target_accuracy(text: str):
    """``--target``: an accuracy in (0, 1], or 'none' (train every step)."""
    if text.lower() == "none":
        return "none"
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected an accuracy in (0, 1] or 'none', got {text!r}")
    return value


def parse_params(items: list[str]) -> dict:
    from ..arena.models import parse_assignment

    params = {}
    for item in items:
        pair = parse_assignment(item)
        if pair is None:
            raise ValueError(f"--param: expected KEY=VALUE, got {item!r}")
        params[pair[0]] = pair[1]
    return params


def parse_target(value) -> dict:
    if value is None:
        return {}
    return {"target_accuracy": None if value == "none" else value}


def task_from_params(name: str, params: dict):
    """The task with its --param values; the task's own checks become --param errors."""
    from ..arena.tasks import make_task

    try:
        return make_task(name, **params)
    except ValueError as e:
        raise ValueError(f"--param: {str(e).removeprefix('task parameters: ')}") from None
    except TypeError as e:  # a value of a type the task's check did not expect: find which
        for key, value in params.items():
            try:
                make_task(name, **{key: value})
            except TypeError:
                raise ValueError(f"--param: {key}: a value of the wrong type, {value!r} ({e})") from None
            except ValueError:
                pass
        raise


def check_grid(task, args, widths: list[int], seq_lens: list[int] | None) -> None:
    """The grid options checked against the task, each error naming its option (the
    library's own checks name its arguments: widths, n_heads, seq_len)."""
    from dataclasses import replace

    from ..arena.models import parse_mechanisms

    with options_named({"mechanisms": "--mechanisms"}):
        parse_mechanisms(args.mechanisms)
    if task.fixed_layers is not None and args.layers not in (None, task.fixed_layers):
        raise ValueError(f"--layers: the {task.name} task is a {task.fixed_layers}-layer probe, got {args.layers}")
    heads = task.default_heads if args.heads is None else args.heads
    bad = [d for d in widths if d % heads]
    if bad:
        raise ValueError(f"--d-model: each width must be a multiple of heads={heads} (--heads), got {', '.join(map(str, bad))}")
    for n in seq_lens or ():
        try:
            replace(task, seq_len=n)
        except ValueError as e:
            raise ValueError(f"--seq-len: {n} does not fit the {task.name} task: {e}") from None


def run(args) -> int:
    import torch

    from ..arena.plots import write_plots
    from ..arena.runner import format_table, plan, run_grid, train_config, write_csv, write_json

    torch.set_num_threads(args.threads)
    task = task_from_params(args.task, parse_params(args.param))
    widths, seq_lens, seeds = args.d_model, args.seq_len, list(range(args.seeds))
    check_grid(task, args, widths, seq_lens)
    # Missing extras are named before training, not after it.
    if not args.no_plots:
        require("matplotlib", "attnkit arena's figures (--no-plots skips them)")
    if args.export:
        require("transformers", "attnkit arena --export")
    if args.checkpoint_every or args.resume or args.export:
        require("safetensors", "attnkit arena's checkpoints")
    overrides = {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "eval_every": args.eval_every,
                 "eval_examples": args.eval_examples, "checkpoint_every": args.checkpoint_every, **parse_target(args.target)}
    with options_named({"mechanisms": "--mechanisms"}):
        runs = plan(task, args.mechanisms, widths, args.layers, args.heads, seeds, seq_lens)
    if args.export:
        from ..arena.export import check_run

        if len(runs) != 1:
            raise ValueError(f"--export: exports one run (one mechanism, width, sequence length and seed), this grid has {len(runs)}")
        check_run(runs[0])  # refuse before training
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

    output_dir(args.out)
    # The export is read back from the run's final checkpoint.
    checkpoints = os.path.join(args.out, "checkpoints") if (args.checkpoint_every or args.resume or args.export) else None
    with options_named({"mechanisms": "--mechanisms"}):  # a mechanism that cannot read the task fails before training
        rows, records = run_grid(task, args.mechanisms, widths, args.layers, args.heads, seeds, seq_lens, overrides,
                                 checkpoints, args.resume, on_eval, on_run)
    files = {"csv": os.path.join(args.out, "results.csv"), "json": os.path.join(args.out, "results.json")}
    write_csv(rows, files["csv"])
    meta = {"task": task.name, "task_params": task.params(), "mechanisms": args.mechanisms, "widths": widths,
            "seeds": seeds, "overrides": {k: v for k, v in overrides.items() if v is not None}}
    write_json(rows, records, meta, files["json"])
    figures = [] if args.no_plots else write_plots(rows, records, args.out)
    if args.export:
        from ..arena.export import export_run

        files["export"] = export_run(runs[0], records[0], rows, overrides, args.export)
    if args.json:
        print(json.dumps({"rows": rows, "files": {**files, "figures": figures}}, indent=1))
    else:
        print(f"attnkit arena {task.name} ({task.paper}) — torch {torch.__version__}, {torch.get_num_threads()} threads")
        print(format_table(rows))
        print(f"\nresults: {files['csv']}, {files['json']}" + (f"; figures: {', '.join(figures)}" if figures else ""))
        if args.export:
            print(f"transformers model: {files['export']}")
    return 0
