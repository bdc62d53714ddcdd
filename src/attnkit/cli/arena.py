"""``attnkit arena``: train mechanisms on a synthetic task and compare them in a table.

    attnkit arena mqar --mechanisms softmax,sigmoid,linear_elu,deltanet --d-model 64,128 --seeds 3

writes results.csv, results.json and accuracy_vs_{width,length,time}.png to --out.
A long-context model is grown from a short one with a warm start and a curriculum:

    attnkit arena needle --init needle-32/ --schedule 128:125x32,512+1024:200x16 \
        --eval-lengths 512,1024 --criterion cell --keep-best --export needle-1k/

The results (and the export) are rewritten after every evaluation, so a run cut off
leaves what it measured.

``attnkit arena sweep [TASK] ...`` runs the same grid as cells through a sweep engine
(attnkit.sweeps: worker processes or Ray) into a resumable store under --out; with no
grid options it is the shape of Zoology's MQAR figure (arXiv 2312.04927, Fig. 2):

    attnkit arena sweep --engine local --workers 2 --out mqar-sweep
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from ..extras import require
from .options import int_list, nonnegative_int, options_named, output_dir, positive_float, positive_int
from .progress import Progress


def add_parser(sub) -> None:
    from ..arena.tasks import TASKS

    p = sub.add_parser(
        "arena",
        help="compare attention mechanisms on synthetic tasks with a tiny trainer",
        description="Train a model per mechanism x width x sequence length x seed on a synthetic task (CPU, "
        "deterministic from the seed) and write a results table (CSV, JSON) and plots.",
    )
    p.add_argument(
        "task", choices=[*TASKS, "sweep"], help="the synthetic task, or 'sweep [TASK]': the grid through a sweep engine"
    )
    p.add_argument("sweep_task", nargs="?", action=SweepTask, metavar="task", help=argparse.SUPPRESS)
    p.add_argument(
        "--mechanisms",
        default=Default("softmax"),
        metavar="LIST",
        help="comma-separated registered mechanisms, each optionally name:key=value:... (default: softmax)",
    )
    p.add_argument(
        "--d-model", type=int_list, default=DefaultList([64]), metavar="LIST", help="model widths, e.g. 64,128 (default: 64)"
    )
    p.add_argument("--layers", type=positive_int, metavar="N", help="attention layers (default: 2; the associative probe has 1)")
    p.add_argument("--heads", type=positive_int, metavar="N", help="attention heads (default: the task's, 4 or 1)")
    p.add_argument(
        "--seeds", type=positive_int, default=DefaultInt(1), metavar="N", help="seeds 0..N-1 per configuration (default: 1)"
    )
    p.add_argument(
        "--seq-len", type=int_list, metavar="LIST", help="training sequence lengths, e.g. 64,128 (default: the task's)"
    )
    p.add_argument("--steps", type=positive_int, metavar="N", help="training steps at most (default: the task's)")
    p.add_argument("--batch-size", type=positive_int, metavar="N", help="examples per step (default: the task's)")
    p.add_argument("--lr", type=positive_float, help="peak learning rate (default: the task's)")
    p.add_argument("--eval-every", type=positive_int, metavar="N", help="steps between held-out evaluations (default: 100)")
    p.add_argument("--eval-examples", type=positive_int, metavar="N", help="held-out examples (default: 256)")
    p.add_argument(
        "--target",
        type=target_accuracy,
        metavar="ACC",
        help="stop a run once held-out accuracy reaches ACC, or 'none' (default: the task's)",
    )
    p.add_argument(
        "--param",
        action="append",
        default=DefaultList(),
        metavar="KEY=VALUE",
        help="a task parameter, VALUE as JSON, e.g. num_kv_pairs=[4,8] (repeatable)",
    )
    p.add_argument("--out", default="attnkit-arena", metavar="DIR", help="output directory (default: ./attnkit-arena)")
    p.add_argument(
        "--checkpoint-every", type=positive_int, metavar="N", help="write a checkpoint every N steps under DIR/checkpoints"
    )
    p.add_argument("--resume", action="store_true", help="continue runs from their checkpoints in DIR/checkpoints")
    p.add_argument(
        "--threads",
        type=positive_int,
        metavar="N",
        help="torch CPU threads (default: 1; the models are tiny, and a second thread only waits on a busy machine; "
        "sweep: per worker, default cores // workers)",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG figures")
    p.add_argument(
        "--export",
        metavar="DIR",
        help="write the trained model to DIR as a transformers LlamaForCausalLM with "
        "its tokenizer and task.json (one run only; softmax + RoPE models)",
    )
    p.add_argument(
        "--init",
        metavar="PATH",
        help="start from these weights: an arena export directory, an arena checkpoint "
        "(.safetensors) or an organism name (embeddings grown or cut to the task's "
        "vocabulary; any other mismatch is an error naming the tensor)",
    )
    p.add_argument(
        "--schedule",
        type=schedule_option,
        metavar="STAGES",
        help=f"a length curriculum instead of one training length: {FORM_HELP}; its steps replace --steps",
    )
    p.add_argument(
        "--max-len",
        type=positive_int,
        metavar="N",
        help="the longest sequence the model is built for (RoPE context, the export's max_position_embeddings; "
        "default: the longest length the run trains or is evaluated at)",
    )
    p.add_argument(
        "--eval-lengths",
        type=int_list,
        metavar="LIST",
        help="lengths every evaluation measures, and the final table's (default: the training length, or the "
        "last stage's lengths with --schedule; the table: the task's test lengths)",
    )
    p.add_argument(
        "--criterion",
        choices=("accuracy", "cell"),
        help="what early stopping (--target) and --keep-best go by: 'accuracy' the lowest accuracy over the "
        "evaluated lengths (default), 'cell' the lowest over every length x group cell (needle: each depth)",
    )
    p.add_argument(
        "--keep-best",
        action="store_true",
        help="end each run on the weights of its best-scoring evaluation (by --criterion), not its last step",
    )
    p.add_argument("--json", action="store_true", help="print the rows and file paths as JSON instead of a table")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    g = p.add_argument_group(
        "sweep",
        "attnkit arena sweep [TASK]: the grid as cells through an engine into a resumable "
        "store (DIR/sweep.sqlite); no grid option given: Zoology's MQAR figure (arXiv 2312.04927)",
    )
    g.add_argument(
        "--engine",
        choices=("local", "ray"),
        help="local: worker processes on this machine (default); ray: Ray tasks (pip install 'attnkit[ray]')",
    )
    g.add_argument(
        "--workers",
        type=positive_int,
        metavar="N",
        help="local: worker processes (default: 2); ray without --address: the local instance's CPUs (default: all)",
    )
    g.add_argument(
        "--address",
        metavar="ADDR",
        help="ray: join a cluster, 'auto', HOST:PORT or ray://HOST:PORT (default: start a Ray instance on this machine)",
    )
    g.add_argument(
        "--connect-timeout",
        type=positive_float,
        metavar="S",
        help=f"ray: seconds to reach --address before failing (default: {CONNECT_TIMEOUT_S:g})",
    )
    g.add_argument("--rerun", action="store_true", help="compute every cell again (default: skip the cells the store has)")
    g.add_argument(
        "--max-failures",
        type=nonnegative_int,
        metavar="N",
        help="stop starting cells once more than N have failed (default: never stop; failures are recorded)",
    )
    p.set_defaults(func=run)


CONNECT_TIMEOUT_S = 15.0
SWEEP_OPTIONS = ("engine", "workers", "address", "connect_timeout", "max_failures")


class Default(str):
    """An option's default (not given on the command line): sweep replaces it with the figure's."""


class DefaultList(list):
    pass


class DefaultInt(int):
    pass


class SweepTask(argparse.Action):
    """``attnkit arena sweep [TASK]``: sets ``args.sweep`` and puts TASK (default mqar) in
    ``args.task``, so the rest of the command reads a task as always."""

    def __call__(self, parser, namespace, value, option_string=None):
        from ..arena.tasks import TASKS

        namespace.sweep = namespace.task == "sweep"
        if not namespace.sweep:
            if value is not None:
                raise argparse.ArgumentError(
                    self,
                    f"expected one task, got {namespace.task!r} and {value!r} "
                    f"(a grid through a sweep engine is 'attnkit arena sweep {value}')",
                )
            return
        if value is not None and value not in TASKS:
            raise argparse.ArgumentError(self, f"invalid choice: {value!r} (choose from {', '.join(TASKS)})")
        namespace.task = value or "mqar"


FORM_HELP = "LENGTHS:STEPS[xBATCH],... e.g. 128:125x32,512:50x16,512+1024:200x16 (a+b: steps alternate lengths)"


def schedule_option(text: str):
    """``--schedule``: stages, or argparse's error showing the expected form."""
    from ..arena.schedule import parse_schedule

    try:
        return parse_schedule(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("schedule: ")) from None


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
    for item in items or ():
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
    if args.schedule is not None:
        if args.steps is not None:
            raise ValueError("--steps: with --schedule the steps are the stages' (leave --steps out)")
        if seq_lens and len(seq_lens) > 1:
            raise ValueError(
                "--seq-len: with --schedule the training lengths are the stages'; give one --seq-len "
                "(the task's nominal length) and --eval-lengths for the lengths to test"
            )


#: library argument names -> the options that set them (errors name the option)
LIBRARY_OPTIONS = {"schedule": "--schedule", "eval_lengths": "--eval-lengths", "max_len": "--max-len", "init": "--init"}


def resolve_init(text: str | None) -> str | None:
    """``--init``: a path as given, or an organism's name as its shipped, verified export."""
    from ..organisms.store import resolve_model_path

    if text is None:
        return None
    path = resolve_model_path(text, "--init")
    if not os.path.exists(path):
        raise FileNotFoundError(f"--init: no such export directory or checkpoint: {text}")
    return path


def eval_line(record: dict, config) -> str:
    """``stage 2/4 (512+1024) step 300 @512 0.992 @1024 0.871 score 0.710 *`` (* a new best)."""
    stage = ""
    if config.schedule:
        current = config.schedule[record["stage"]]
        stage = f"stage {record['stage'] + 1}/{len(config.schedule)} ({'+'.join(map(str, current.lengths))}) "
    lengths = " ".join(f"@{n} {entry['accuracy']:.3f}" for n, entry in record.get("lengths", {}).items())
    return f"{stage}step {record['step']} {lengths} score {record['score']:.3f}" + (" *" if record.get("best") else "")


def run(args) -> int:
    if getattr(args, "sweep", False):
        from .arena_sweep import run_sweep_command

        return run_sweep_command(args)
    given = [name for name in (*SWEEP_OPTIONS, "rerun") if getattr(args, name)]
    if given:
        option = "--" + given[0].replace("_", "-")
        raise ValueError(f"{option}: only with 'attnkit arena sweep {args.task} ...' (a grid through a sweep engine)")
    return run_grid_command(args)


def run_grid_command(args) -> int:
    import torch

    from ..arena.export import export_atomic, run_training
    from ..arena.models import build_model
    from ..arena.plots import write_plots
    from ..arena.runner import check_lengths, format_table, plan, run_grid, train_config, write_csv, write_json
    from ..arena.schedule import schedule_text
    from ..arena.warm_start import warm_start

    torch.set_num_threads(args.threads or 1)
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
    overrides = {
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "eval_every": args.eval_every,
        "eval_examples": args.eval_examples,
        "checkpoint_every": args.checkpoint_every,
        **parse_target(args.target),
        "schedule": args.schedule,
        "eval_lengths": args.eval_lengths,
        "criterion": args.criterion,
        "keep_best": args.keep_best or None,
    }
    init = resolve_init(args.init)
    with options_named({"mechanisms": "--mechanisms"}):
        runs = plan(task, args.mechanisms, widths, args.layers, args.heads, seeds, seq_lens, args.max_len, init)
    with options_named(LIBRARY_OPTIONS):  # lengths that do not fit the task or --max-len, before any training
        for r in runs:
            check_lengths(r.task, train_config(r.task, r.seed, overrides), r.max_len)
    if init:
        with options_named(LIBRARY_OPTIONS), torch.random.fork_rng():  # an incompatible model, before any training
            r = runs[0]
            warm_start(build_model(r.task, r.mechanism, r.d_model, r.layers, r.heads, r.max_len), init)
    if args.export:
        from ..arena.export import check_run

        if len(runs) != 1:
            raise ValueError(
                f"--export: exports one run (one mechanism, width, sequence length and seed), this grid has {len(runs)}"
            )
        check_run(runs[0])  # refuse before training
    # One progress tick per evaluation; a run that stops early jumps to its last tick.
    ticks = [math.ceil(c.steps / c.eval_every) for c in (train_config(r.task, r.seed, overrides) for r in runs)]
    progress = Progress(sum(ticks), f"arena {task.name}", enabled=not args.quiet)
    ends = iter([sum(ticks[: i + 1]) for i in range(len(ticks))])

    def on_eval(run, record):
        progress.step(f"{run.label} {eval_line(record, train_config(run.task, run.seed, overrides))}")

    output_dir(args.out)
    files = {"csv": os.path.join(args.out, "results.csv"), "json": os.path.join(args.out, "results.json")}
    meta = {
        "task": task.name,
        "task_params": task.params(),
        "mechanisms": args.mechanisms,
        "widths": widths,
        "seeds": seeds,
        "overrides": {k: schedule_text(v) if k == "schedule" else v for k, v in overrides.items() if v is not None},
        "init": init,
        "max_len": args.max_len,
    }
    finished_rows: list[dict] = []
    finished_records: list[dict] = []
    live = {}

    def write_results(rows, records, finished):
        write_csv(rows, files["csv"])
        write_json(rows, records, {**meta, "finished": finished}, files["json"])

    def on_snapshot(run, model, rows, record):
        # What the run measured so far, on disk now: a run cut off keeps it.
        live[id(run)] = record
        write_results(finished_rows + rows, finished_records + [record], False)
        if args.export:
            export_atomic(model, run.task, args.export, run_training(run, record, rows))

    def on_run(run, rows):
        finished_rows.extend(rows)
        if id(run) in live:
            finished_records.append(live.pop(id(run)))
        end = next(ends)
        if progress.done < end:
            progress.done = end - 1
            progress.step(f"{run.label} done, acc {rows[0]['accuracy']:.3f}")

    # The export is read back from the run's final checkpoint.
    checkpoints = os.path.join(args.out, "checkpoints") if (args.checkpoint_every or args.resume or args.export) else None
    try:
        with options_named({"mechanisms": "--mechanisms"}):  # a mechanism that cannot read the task fails before training
            rows, records = run_grid(
                task,
                args.mechanisms,
                widths,
                args.layers,
                args.heads,
                seeds,
                seq_lens,
                overrides,
                checkpoints,
                args.resume,
                on_eval,
                on_run,
                args.max_len,
                init,
                on_snapshot,
            )
    except KeyboardInterrupt:
        print(
            f"\nattnkit arena: interrupted; what was measured is in {files['json']}"
            + (f" and {args.export}" if args.export and live else ""),
            file=sys.stderr,
        )
        return 130
    write_results(rows, records, True)
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
