"""``attnkit inspect``: measure attention inside a model and write the HTML report.

With no arguments it reads the bundled sample text with the bundled all-MiniLM-L6-v2;
``--model PATH`` takes any local transformers model directory, ``--text FILE`` or
``--prompt STR`` any input.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections import Counter

from ..observe import LABELS, METERS
from . import inspect_pipeline
from .options import options_named, output_dir, positive_int, read_utf8
from .progress import Progress


def add_parser(sub) -> None:
    p = sub.add_parser(
        "inspect",
        help="measure attention inside a model and write an HTML report",
        description="Run a transformers model once with attnkit's meters on every attention call (O(N) memory) "
        "and write report.html, profile.csv, profile.json and PNG figures.",
    )
    p.add_argument(
        "--model",
        metavar="PATH",
        help="local transformers model directory (default: the bundled all-MiniLM-L6-v2), "
        "or a diffusers pipeline directory (per-token attention maps)",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", metavar="FILE", help="UTF-8 text file to read (default: the bundled sample text)")
    src.add_argument("--prompt", metavar="STR", help="text given on the command line")
    p.add_argument(
        "--meters",
        nargs="+",
        choices=list(METERS),
        metavar="NAME",
        help=f"meters to run, among {', '.join(METERS)} (default: all but spans; spans when --span is given)",
    )
    p.add_argument("--layers", metavar="LIST", help="layers to measure, e.g. 0,2,4-5 (default: all)")
    p.add_argument("--heads", metavar="LIST", help="heads to measure, e.g. 0-3 (default: all)")
    p.add_argument(
        "--queries", metavar="LO:HI", help="query positions to measure, e.g. --queries=-8: for the last 8 tokens (default: all)"
    )
    p.add_argument(
        "--image",
        metavar="FILE",
        help="an image (PNG/JPEG) for a vision-language --model: the report overlays each head's "
        "attention on its patch grid and plots the visual share per generated token",
    )
    p.add_argument("--max-new-tokens", type=positive_int, metavar="N", help="with --image: tokens to generate (default: 16)")
    p.add_argument(
        "--span",
        action="append",
        metavar="NAME=START:END",
        help="a named span of token positions for the spans meter (repeatable)",
    )
    p.add_argument(
        "--token-heads",
        metavar="L.H,...",
        help="heads shown in the token view, e.g. 0.3,2.7 (default: the clearest of each class)",
    )
    p.add_argument("--mechanism", default="softmax", help="attention mechanism to run the model with (default: softmax)")
    p.add_argument(
        "--top-k", type=positive_int, default=8, metavar="K", help="keys kept per query for the token view (default: 8)"
    )
    p.add_argument("--max-tokens", type=positive_int, metavar="N", help="truncate longer inputs to N tokens (with a warning)")
    p.add_argument("--out", default="attnkit-report", metavar="DIR", help="output directory (default: ./attnkit-report)")
    p.add_argument("--no-figures", action="store_true", help="skip the PNG figures")
    p.add_argument("--json", action="store_true", help="print a JSON summary (paths, tokens, head classes) instead of text")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    inspect_pipeline.add_arguments(p)
    p.set_defaults(func=run)


def parse_indices(spec: str | None, name: str) -> list[int] | None:
    """'0,2,4-6' -> [0, 2, 4, 5, 6]."""
    if spec is None:
        return None
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part:
                a, b = part.split("-", 1)
                lo, hi = int(a), int(b)
                if hi < lo or hi - lo > 100_000:  # no model has that many layers or heads
                    raise ValueError
                out += range(lo, hi + 1)
            else:
                out.append(int(part))
        except ValueError:
            raise ValueError(f"{name}: expected indices like 0,2,4-6, got {spec!r}") from None
    if any(i < 0 for i in out):
        raise ValueError(f"{name}: indices must be >= 0, got {spec!r}")
    return out


def parse_queries(spec: str | None) -> tuple[int | None, int | None] | None:
    if spec is None:
        return None
    lo_text, sep, hi_text = spec.partition(":")
    try:
        if not sep:
            raise ValueError
        lo, hi = (int(lo_text) if lo_text.strip() else None, int(hi_text) if hi_text.strip() else None)
    except ValueError:
        raise ValueError(
            f"--queries: expected LO:HI token positions (either may be empty, negative counts from the end), got {spec!r}"
        ) from None
    if lo is not None and hi is not None and (lo < 0) == (hi < 0) and lo >= hi:
        raise ValueError(f"--queries: LO:HI selects no query (HI is exclusive and must exceed LO), got {spec!r}")
    return lo, hi


def parse_spans(specs: list[str] | None) -> dict | None:
    if not specs:
        return None
    spans = {}
    for spec in specs:
        name, sep, rng = spec.partition("=")
        lo, sep2, hi = rng.partition(":")
        try:
            if not (sep and sep2 and name):
                raise ValueError
            spans[name] = (int(lo), int(hi))
        except ValueError:
            raise ValueError(f"--span: expected NAME=START:END token positions, got {spec!r}") from None
    return spans


def parse_heads(spec: str | None) -> list[tuple[int, int]] | None:
    if spec is None:
        return None
    out = []
    for part in spec.split(","):
        layer, dot, head = part.strip().partition(".")
        try:
            if not dot:
                raise ValueError
            out.append((int(layer), int(head)))
        except ValueError:
            raise ValueError(f"--token-heads: expected LAYER.HEAD pairs like 0.3,2.7, got {spec!r}") from None
    return out


def read_text(args) -> str:
    from ..inspection import sample_text

    if args.prompt is not None:
        return args.prompt
    if args.text is None:
        return sample_text()
    return read_utf8(args.text, "--text")


def _image_prompt(args) -> str:
    if args.prompt is None and args.text is None:
        raise ValueError("--prompt: --image needs a question or instruction about the image (--prompt TEXT or --text FILE)")
    text = read_text(args)
    if not text.strip():
        raise ValueError(f"{'--prompt' if args.prompt is not None else '--text'}: the text is empty")
    return text


def run(args) -> int:
    if inspect_pipeline.is_pipeline_dir(args.model):  # a diffusers pipeline: per-token maps report
        for name in ("image", "max_new_tokens"):
            if getattr(args, name, None) is not None:
                raise ValueError(
                    f"--{name.replace('_', '-')}: only for a vision-language model directory, not a diffusers pipeline"
                )
        return inspect_pipeline.run(args)
    inspect_pipeline.reject_pipeline_options(args)
    if args.image is not None:
        from . import inspect_image

        return inspect_image.run(args, _image_prompt(args))
    if args.max_new_tokens is not None:
        raise ValueError("--max-new-tokens: only with --image")
    layers, heads = parse_indices(args.layers, "--layers"), parse_indices(args.heads, "--heads")
    queries, spans, token_heads = parse_queries(args.queries), parse_spans(args.span), parse_heads(args.token_heads)
    if args.meters and "spans" in args.meters and not spans:
        raise ValueError("--meters spans: needs at least one --span NAME=START:END")
    source = "--prompt" if args.prompt is not None else "--text"
    text = read_text(args)
    if not text.strip():
        raise ValueError(f"{source}: the text is empty")
    from ..mechanisms import available

    if args.mechanism not in available():
        raise ValueError(f"--mechanism: unknown mechanism {args.mechanism!r}; registered: {', '.join(available())}")
    output_dir(args.out)
    # The library's errors name its arguments; on the command line they are options.
    names = {
        "mechanism": "--mechanism",
        "layers": "--layers",
        "heads": "--heads",
        "queries": "--queries",
        "spans": "--span",
        "meters": "--layers/--heads/--queries",
        "max_tokens": "--max-tokens",
        "top_k": "--top-k",
        "token_heads": "--token-heads",
    }
    if args.model is not None:
        names["model"] = "--model"
    if args.prompt is not None or args.text is not None:
        names["inputs"] = source
    with options_named(names):
        return measure(args, text, layers, heads, queries, spans, token_heads)


def measure(args, text: str, layers, heads, queries, spans, token_heads) -> int:
    from transformers.utils import logging as hf_logging

    from .. import hf
    from ..inspection import inspect, load_local_model
    from ..inspection.run import model_shape
    from ..report import write_report

    hf_logging.disable_progress_bar()  # our own progress line is the one on stderr
    if args.model is None:
        model, tokenizer = hf.load_default_model()
        name = "all-MiniLM-L6-v2 (bundled)"
    else:
        model, tokenizer = load_local_model(args.model)
        name = args.model
    progress = Progress(model_shape(model)[0], "inspect", enabled=not args.quiet and not args.json)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile = inspect(
            model,
            text,
            tokenizer=tokenizer,
            meters=args.meters,
            layers=layers,
            heads=heads,
            queries=queries,
            spans=spans,
            mechanism=args.mechanism,
            max_tokens=args.max_tokens,
            top_k=args.top_k,
            progress=progress.step,
        )
    for w in caught:
        if "truncated" in str(w.message):
            print(f"attnkit inspect: warning: {w.message}", file=sys.stderr)
    profile.meta["model"] = name
    paths = write_report(
        profile, args.out, token_heads=token_heads, figures=not args.no_figures, title=f"attnkit inspect — {name}"
    )
    paths["csv"] = os.path.join(args.out, "profile.csv")
    paths["json"] = os.path.join(args.out, "profile.json")
    profile.to_csv(paths["csv"])
    profile.to_json(paths["json"])
    classes = Counter(c.label for c in profile.classify().values())
    if args.json:
        print(
            json.dumps(
                {
                    "report": paths["html"],
                    "csv": paths["csv"],
                    "json": paths["json"],
                    "figures": paths["figures"],
                    "model": name,
                    "tokens": profile.meta["tokens"],
                    "seconds": profile.meta["seconds"],
                    "classes": {label: classes.get(label, 0) for label in LABELS},
                }
            )
        )
        return 0
    print(
        f"{name}: {profile.meta['tokens']} tokens, {len(profile.layers)} layers, {len(profile.heads)} heads measured "
        f"in {profile.meta['seconds']:.2f} s"
    )
    print("head classes: " + ", ".join(f"{label} {classes[label]}" for label in LABELS if classes.get(label)))
    print(
        f"profile: {paths['csv']}, {paths['json']}"
        + (f"; {len(paths['figures'])} figures in {os.path.dirname(paths['figures'][0])}" if paths["figures"] else "")
    )
    print(f"report: {paths['html']}")
    return 0
