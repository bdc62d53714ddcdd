"""``attnkit organisms list|card|build|path``: the shipped model organisms and their cards.

attnkit organisms list                 # every recipe, with its card's accuracies
attnkit organisms card needle-1k       # accuracy per length x depth, training, machine, failures
attnkit organisms path needle-1k       # the shipped export (use it, or the name, as --model)
attnkit organisms build needle-1k --out built/   # retrain from the recipe; compare with the shipped card
"""

from __future__ import annotations

import json
import os
from typing import Any

from .options import options_named, output_dir, positive_int
from .progress import Progress

ACTIONS = ("list", "card", "build", "path")
#: library argument names -> how the command line names them
NAME = {"name": "NAME"}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "organisms",
        help="small trained models shipped with measured cards (list, card, build, path)",
        description="Model organisms: small models grown with the arena (warm starts, length curricula), "
        "shipped with a card of their measured accuracy. An organism name works wherever a "
        "model path does.",
    )
    p.add_argument(
        "action",
        choices=ACTIONS,
        help="list: every organism; card: one's card; path: its shipped export; "
        "build: retrain it from its recipe and compare with the shipped card",
    )
    p.add_argument("name", nargs="?", metavar="NAME", help="the organism (card, build, path)")
    p.add_argument("--out", metavar="DIR", help="build: where the new export and card go (default: ./attnkit-organisms/NAME)")
    p.add_argument("--work", metavar="DIR", help="build: keep each stage's arena run (results, checkpoints, export) here")
    p.add_argument("--commands", action="store_true", help="card: also print the arena command lines of the recipe")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--markdown", action="store_true", help="list: the shipped cards as a Markdown table")
    p.add_argument("--quiet", action="store_true", help="build: no progress output")
    p.add_argument(
        "--engine",
        choices=("local", "ray"),
        help="build: several organisms (NAME a comma-separated list, or 'all'), one sweep cell each, on worker processes or Ray",
    )
    p.add_argument(
        "--workers",
        type=positive_int,
        metavar="N",
        help="build --engine: worker processes (local, default 2) or the CPUs of a local Ray instance",
    )
    p.add_argument("--address", metavar="ADDR", help="build --engine ray: a cluster to join (auto, host:port)")
    p.add_argument("--store", metavar="DIR", help="build --engine: the sweep's results store (a rerun resumes it)")
    p.set_defaults(func=run)


def run(args) -> int:
    from .. import organisms

    if args.action == "list":
        return _list(args)
    if args.action == "build" and args.engine:
        return _build_swept(args)
    for option in ("engine", "workers", "address", "store"):
        if getattr(args, option) is not None:
            raise ValueError(f"--{option}: only with 'build --engine local|ray'")
    if not args.name:
        raise ValueError(
            f"NAME: 'attnkit organisms {args.action}' needs an organism; known: {', '.join(organisms.names() + organisms.visual.names())}"
        )
    with options_named(NAME):
        organisms.known(args.name)
    if args.action == "path":
        with options_named(NAME):
            print(organisms.path(args.name))
        return 0
    if args.action == "card":
        with options_named(NAME):
            card = organisms.card(args.name)
        if args.json:
            print(json.dumps(card, indent=1))
        elif organisms.visual.is_visual(card):
            print(organisms.visual.format_card(card))
            if args.commands:
                print("\nrecipe:\n" + "\n".join(card["commands"]))
        else:
            from ..organisms.cards import format_card

            print(format_card(card))
            if args.commands:
                print("\nrecipe:\n" + "\n".join(card["commands"]))
        return 0
    return _build(args)


def _list(args) -> int:
    from .. import organisms
    from ..organisms.cards import summary_row

    rows = []
    for name in organisms.names() + organisms.visual.names():
        r = organisms.known(name)
        row = {"name": name, "summary": r.summary, "shipped": name in organisms.shipped()}
        if row["shipped"]:
            card = organisms.card(name)
            row.update(organisms.visual.summary_row(card) if organisms.visual.is_visual(card) else summary_row(card))
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if args.markdown:
        from ..organisms.cards import markdown_table

        cards = [organisms.card(r["name"]) for r in rows if r["shipped"]]
        print(
            "\n".join(
                [markdown_table([c for c in cards if not organisms.visual.is_visual(c)])]
                + [organisms.visual.markdown_row(c) for c in cards if organisms.visual.is_visual(c)]
            )
        )
        return 0
    # columns as wide as their longest entry, so a long name or mechanism never shifts the row
    name_w = max(len("organism"), *(len(r["name"]) for r in rows))
    mech_w = max(len("mechanism"), *(len(r.get("mechanism", "")) for r in rows if r["shipped"]))
    acc_w = max(
        len("accuracy by length"),
        *(len(" ".join(f"{n}:{a:.2f}" for n, a in r["accuracy"].items())) for r in rows if r["shipped"]),
    )
    print(
        f"{'organism':<{name_w}} {'task':<10} {'mechanism':<{mech_w}} {'trained':>7}  {'accuracy by length':<{acc_w}} "
        f"{'worst cell':<24} {'build':>6}"
    )
    for row in rows:
        if not row["shipped"]:
            print(f"{row['name']:<{name_w}} (not shipped: attnkit organisms build {row['name']})  {row['summary']}")
            continue
        accuracy = " ".join(f"{n}:{a:.2f}" for n, a in row["accuracy"].items())
        w = row["worst"]
        where = w and (w["kind"] if row.get("kind") == "visual" else w["length"])
        worst = f"{w['accuracy']:.2f} @{where} {w['group']}" if w else ""
        print(
            f"{row['name']:<{name_w}} {row['task']:<10} {row['mechanism']:<{mech_w}} {row['trained_up_to']:>7}  "
            f"{accuracy:<{acc_w}} {worst:<24} "
            f"{row['seconds'] / 60:>5.1f}m"
        )
    return 0


def _build(args) -> int:
    from .. import organisms
    from ..organisms.builder import compare

    if args.name in organisms.visual.VISUAL:
        return _build_visual(args)
    organisms.recipe(args.name)  # an unknown name lists the known ones
    out = args.out or os.path.join("attnkit-organisms", args.name)
    output_dir(os.path.dirname(os.path.abspath(out)))
    if args.work:
        output_dir(args.work)
    shipped = organisms.card(args.name) if args.name in organisms.shipped() else None
    progress = Progress(0, f"organisms build {args.name}", enabled=not args.quiet)

    def on_eval(stage, record, config):
        where = ""
        if config.schedule:
            current = config.schedule[record["stage"]]
            where = f" stage {record['stage'] + 1}/{len(config.schedule)} ({'+'.join(map(str, current.lengths))})"
        lengths = " ".join(f"@{n} {e['accuracy']:.3f}" for n, e in record.get("lengths", {}).items())
        progress.total = progress.done + 1
        progress.step(f"{stage.name}{where} step {record['step']} {lengths} score {record['score']:.3f}")

    def on_measure(recipe):
        progress.total = progress.done + 1
        progress.step(f"measuring the card at {', '.join(map(str, recipe.card_lengths))} tokens")

    card = organisms.build(args.name, out, work_dir=args.work, on_eval=on_eval, on_measure=on_measure)
    distance = compare(card, shipped) if shipped else None
    if args.json:
        print(json.dumps({"card": card, "path": out, "against_shipped": distance}, indent=1))
        return 0
    from ..organisms.cards import format_card

    print(format_card(card))
    print(f"\nwritten to {out}")
    if distance is not None:
        print(
            f"against the shipped card: largest difference {distance['largest']:.3f} "
            f"(per length: " + ", ".join(f"{n} {d['all']:+.3f}" for n, d in distance["differences"].items()) + ")"
        )
    return 0


def _build_swept(args) -> int:
    """``build NAME,NAME... --engine``: one ``organism`` sweep cell per recipe into
    ``--store``; each export under ``--out``/NAME (default ./attnkit-organisms)."""
    from .. import organisms
    from ..organisms.cells import organism_cells
    from ..sweeps import load, run_sweep
    from ..sweeps.engines import engine_named
    from .arena_sweep import status_printer

    if not args.name:
        raise ValueError(f"NAME: which organisms? a comma-separated list or 'all' (known: {', '.join(organisms.names())})")
    names = organisms.names() if args.name == "all" else [n for n in args.name.split(",") if n]
    with options_named(NAME):
        for name in names:
            organisms.recipe(name)  # an unknown name lists the known ones (visual organisms build alone)
    if args.store is None:
        raise ValueError("--store: a sweep writes its cells into a results directory; give one")
    if args.work:
        raise ValueError("--work: each cell keeps its stages in a temporary folder; build one organism to keep them")
    out = args.out or "attnkit-organisms"
    output_dir(out)
    with options_named({"address": "--address"}):
        engine = engine_named(args.engine, args.workers, args.address)
    cells = organism_cells(names, out)
    result = run_sweep(cells, args.store, engine, on_status=status_printer(args.quiet))
    rows = [r for r in load(args.store, with_cell=False) if r.get("organism") in names]
    if args.json:
        print(json.dumps({"rows": rows, "failed": result.failed}, indent=1))
        return 1 if result.failed else 0
    for name in names:
        mine = [r for r in rows if r["organism"] == name and r["metric"] == "accuracy" and r["group"] == "all"]
        if mine:
            print(f"{name}: " + " ".join(f"{r['length']}:{r['value']:.3f}" for r in mine) + f" -> {mine[0]['path']}")
        else:
            print(f"{name}: failed (attnkit results {args.store} --failed)")
    return 1 if result.failed else 0


def _build_visual(args) -> int:
    from .. import organisms

    out = args.out or os.path.join("attnkit-organisms", args.name)
    output_dir(os.path.dirname(os.path.abspath(out)))
    if args.work:
        output_dir(args.work)
    shipped = organisms.card(args.name) if args.name in organisms.shipped() else None
    progress = Progress(0, f"organisms build {args.name}", enabled=not args.quiet)

    def on_eval(record):
        progress.total = progress.done + 1
        progress.step(
            f"step {record['step']} loss {record['loss']:.3f} " + " ".join(f"{k} {a:.3f}" for k, a in record["accuracy"].items())
        )

    def on_measure(spec):
        progress.total = progress.done + 1
        progress.step("measuring the card on held-out images")

    with options_named({"out_dir": "--out"}):
        card = organisms.build(args.name, out, work_dir=args.work, on_eval=on_eval, on_measure=on_measure)
    distance: dict[str, Any] | None = None
    if shipped:
        diffs = {
            k: round(e["accuracy"] - shipped["accuracy"][k]["accuracy"], 4)
            for k, e in card["accuracy"].items()
            if k in shipped["accuracy"]
        }
        distance = {"differences": diffs, "largest": max((abs(v) for v in diffs.values()), default=0.0)}
    if args.json:
        print(json.dumps({"card": card, "path": out, "against_shipped": distance}, indent=1))
        return 0
    print(organisms.visual.format_card(card))
    print(f"\nwritten to {out}")
    if distance is not None:
        print(
            f"against the shipped card: largest difference {distance['largest']:.3f} (per question kind: "
            + ", ".join(f"{k} {d:+.3f}" for k, d in distance["differences"].items())
            + ")"
        )
    return 0
