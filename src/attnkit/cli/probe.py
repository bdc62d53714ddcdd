"""``attnkit probe NAME``: run one probe and write results.csv, results.json and report.html.

The probe's options are read off its function's signature, so each option is exactly
one keyword argument of the Python API: ``lengths=`` is ``--lengths``, ``batch_size=``
is ``--batch-size``, ``top=`` is ``--top``. The default value (or, for a default of
None, the type annotation) says how the text is read: ``--lengths 1k,2048`` is a list of
ints (``k`` = 1024), ``--depths 0,0.5,1`` a list of floats, ``--samples 4`` an int, a
boolean default gives ``--flag`` and ``--no-flag``. ``--param KEY=VALUE`` sets any
keyword by its Python name. Every bad value is an error naming its option (exit 2,
``attnkit probe: error: --option: ...``); the probe itself checks what it accepts.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from .options import options_named, output_dir

#: keyword arguments the CLI sets itself (never options of their own)
RESERVED = ("model", "tokenizer", "progress")
#: options of every probe; a probe keyword with one of these names cannot be an option
COMMON = ("model", "out", "json", "quiet", "param", "help", "steer")

USAGE = "attnkit probe NAME [--model PATH] [--out DIR] [--json] [--quiet] [--steer SPEC ...] [probe options ...]"


def add_parser(sub) -> None:
    from ..probes import PROBES

    p = sub.add_parser(
        "probe",
        help="run a long-context probe (needle, RULER, head scores ...) and write an HTML report",
        usage=USAGE,
        description="Run one probe on a local transformers model (default: the bundled all-MiniLM-L6-v2 for "
        "probes of encoders) and write results.csv, results.json and a self-contained report.html. "
        "`attnkit probe NAME --help` lists NAME's own options, one per keyword argument of its "
        "Python function.",
        epilog=f"probes: {', '.join(PROBES)}",
    )
    p.add_argument("name", nargs="?", metavar="NAME", help=f"the probe: {', '.join(PROBES)}")
    p.add_argument("options", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


# -- reading option values ------------------------------------------------------------------


class _OptionError(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so every message goes out as
    ``attnkit probe: error: --option: ...`` through the CLI's one error path."""

    def error(self, message):
        # argparse says "argument --lengths: expected one argument"; we name the option first
        raise _OptionError(re.sub(r"^argument ([^:]+): ", r"\1: ", message))


def _annotation_text(annotation) -> str:
    if annotation is inspect.Parameter.empty:
        return ""
    if isinstance(annotation, str):
        return annotation
    return getattr(annotation, "__name__", None) or str(annotation)


#: how the common parameters read when a probe's default (None) and annotation say nothing
NAMED_KINDS = {
    "lengths": "ints",
    "depths": "floats",
    "positions": "ints",
    "pairs": "ints",
    "layers": "ints",
    "heads": "ints",
    "updates": "ints",
    "tasks": "strs",
    "scores": "strs",
    "samples": "int",
    "seed": "int",
    "batch_size": "int",
    "top": "int",
    "threshold": "float",
    "max_new_tokens": "int",
}


def value_kind(default, annotation="", name: str = "") -> str:
    """How an option's text is read: int, float, bool, str, ints, floats, strs or any
    (an int, else a float, else the text; a comma-separated list of those), from the
    default, else the annotation, else the parameter's conventional name."""
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, int):
        return "int"
    if isinstance(default, float):
        return "float"
    if isinstance(default, str):
        return "str"
    if isinstance(default, (list, tuple)) and default:
        if all(isinstance(x, int) and not isinstance(x, bool) for x in default):
            return "ints"
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in default):
            return "floats"
        if all(isinstance(x, str) for x in default):
            return "strs"
    text = re.sub(r"\s+", "", _annotation_text(annotation)).replace("typing.", "")
    # a sequence of one element type: list[int], tuple[float, ...], Sequence[str] | None
    seq = re.search(r"(?:list|tuple|Sequence|Iterable|set|frozenset)\[(int|float|str)\b", text, re.I)
    if seq:
        return seq.group(1).lower() + "s"
    parts = [t for t in re.split(r"[|,\[\]]|Optional", text) if t and t != "None"]
    for kind in ("bool", "int", "float", "str"):
        if parts == [kind]:
            return kind
    if parts and all(t in ("int", "float") for t in parts):
        return "float"
    if parts and all(t in ("str", "PathLike", "os.PathLike", "Path", "pathlib.Path") for t in parts):
        return "str"  # a path is passed as typed: the probe opens it and names its option on error
    return NAMED_KINDS.get(name, "any")


_INT = re.compile(r"^[+-]?\d+(k)?$", re.I)


def _int(text: str) -> int:
    text = text.strip().replace("_", "")
    m = _INT.match(text)
    if not m:
        raise ValueError
    return int(text[:-1]) * 1024 if m.group(1) else int(text)


def _float(text: str) -> float:
    value = float(text.strip())
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError
    return value


def _bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError


def _any(text: str):
    if "," in text:
        items = text.split(",")
        if any(not t.strip() for t in items):
            raise ValueError
        return [_any(t) for t in items]
    for read in (_int, _float):
        try:
            return read(text)
        except ValueError:
            pass
    return text


_READERS: dict[str, tuple[Callable[[str], Any], str]] = {
    "int": (_int, "an int (e.g. 8 or 4k = 4096)"),
    "float": (_float, "a finite number"),
    "bool": (_bool, "true or false"),
    "str": (str, "text"),
    "any": (_any, "a value or a comma-separated list"),
}


def parse_value(text: str, kind: str, option: str):
    """``text`` read as ``kind`` (see ``value_kind``); an error naming ``option``."""
    if kind in _LISTS:
        read = _READERS[kind[:-1]][0]
        noun, example = _LISTS[kind]
        items = text.split(",")
        try:
            if any(not t.strip() for t in items):
                raise ValueError
            return [t.strip() if kind == "strs" else read(t) for t in items]
        except ValueError:
            raise _OptionError(f"{option}: expected a comma-separated list of {noun}, e.g. {example}, got {text!r}") from None
    read, what = _READERS[kind]
    try:
        return read(text)
    except ValueError:
        raise _OptionError(f"{option}: expected {what}, got {text!r}") from None


_LISTS = {"ints": ("ints", "1k,2k,4096"), "floats": ("numbers", "0,0.5,1"), "strs": ("names", "a,b")}


# -- the probe's options ----------------------------------------------------------------------


def probe_options(function) -> dict:
    """Python keyword -> (option, kind, default) for every keyword a probe function takes,
    except the ones the CLI sets (model, tokenizer, progress)."""
    out = {}
    for name, param in inspect.signature(function).parameters.items():
        if name in RESERVED or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        default = None if param.default is param.empty else param.default
        out[name] = ("--" + name.replace("_", "-"), value_kind(default, param.annotation, name), default)
    return out


def _takes_any_keyword(function) -> bool:
    return any(p.kind == p.VAR_KEYWORD for p in inspect.signature(function).parameters.values())


def _doc_lines(function) -> dict:
    """What the docstring says about each keyword, for --help: Google style
    ("lengths: ..." under Args, continuation lines indented) or inline
    ("``lengths``: ...; ``depths``: ...", several names may share one text with "/")."""
    doc = inspect.getdoc(function) or ""
    found: dict[str, str] = {}
    # Google style: "name: text" (continuation lines indented deeper)
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(\s+)(\w+)\s*(?:\([^)]*\))?:\s+(.+)$", line)
        if not m:
            continue
        text, depth = [m.group(3)], len(m.group(1))
        for more in lines[i + 1 :]:
            if not more.strip() or len(more) - len(more.lstrip()) <= depth:
                break
            text.append(more.strip())
        found.setdefault(m.group(2), " ".join(text).replace("``", ""))
    # inline: ``name``: text, up to the next "; ``other``" or the paragraph's end
    for paragraph in doc.split("\n\n"):
        flat = " ".join(paragraph.split())
        for m in re.finditer(r"((?:``\w+``/?)+):\s*(.+?)(?=;\s*``\w+``(?:/``\w+``)*:|$)", flat):
            for name in re.findall(r"``(\w+)``", m.group(1)):
                found.setdefault(name, m.group(2).strip().rstrip(";").replace("``", ""))
    return {k: v if len(v) <= 240 else v[:237] + "..." for k, v in found.items()}


def _show(default) -> str:
    if isinstance(default, (list, tuple)):
        return ",".join(str(x) for x in default)
    return str(default)


def build_probe_parser(name: str, function) -> tuple[_Parser, dict]:
    """The parser of ``attnkit probe NAME``'s options and the keyword each option sets."""
    options = probe_options(function)
    docs = _doc_lines(function)
    summary = (inspect.getdoc(function) or "").strip().split("\n\n")[0].replace("\n", " ")
    p = _Parser(
        prog=f"attnkit probe {name}",
        allow_abbrev=False,
        description=summary or None,
        epilog="Lists: comma-separated (ints take k = 1024: --lengths 1k,4k). Any keyword by its Python name: "
        "--param KEY=VALUE (repeatable).",
    )
    p.add_argument(
        "--model",
        metavar="PATH",
        help="local transformers model directory (an arena export, any causal LM or encoder); "
        "default: the bundled all-MiniLM-L6-v2, for probes of encoders",
    )
    p.add_argument("--out", metavar="DIR", help=f"output directory (default: ./attnkit-probe-{name})")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout (progress stays on stderr)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="set the probe's keyword KEY (repeatable)")
    p.add_argument(
        "--steer",
        action="append",
        default=[],
        metavar="SPEC",
        help="also run the probe steered, shown beside the plain run (repeatable; all apply together): "
        "emphasize:span=needle:alpha=0.01:heads=top8, ablate:heads=top5-retrieval, scale:heads=0.1:factor=0.5, "
        "temperature:heads=all:t=2, disperse:heads=0.0:strength=1; heads: all, layer.head pairs, topK-SCORE, "
        "topK-SCORE@results.json or a head-set file (see attnkit.cli.steer_spec)",
    )
    dests = {}
    for keyword, (option, kind, default) in options.items():
        if keyword in COMMON:
            continue  # reachable through --param only
        text = docs.get(keyword, "")
        shown = "" if default is None else f" (default: {_show(default)})"
        dest = f"probe_{keyword}"
        if kind == "bool":
            p.add_argument(
                option, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=(text + shown).strip() or None
            )
        else:
            metavar = {"ints": "N,...", "floats": "X,...", "strs": "A,...", "int": "N", "float": "X"}.get(kind, keyword.upper())
            if kind in ("str", "any") and (keyword in ("text", "haystack") or keyword.endswith(("file", "path"))):
                metavar = "FILE"  # the probe opens it (and names the option when it cannot)
            p.add_argument(option, dest=dest, metavar=metavar, default=None, help=(text + shown).strip() or None)
        dests[dest] = (keyword, option, kind)
    return p, dests


def probe_arguments(name: str, function, argv: list[str]) -> tuple[argparse.Namespace, dict]:
    """(the common options, the probe's keyword arguments) from ``argv``; unknown options
    and bad values are errors naming the option."""
    parser, dests = build_probe_parser(name, function)
    options = probe_options(function)
    known = ", ".join(o for _, o, _ in dests.values())
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:
            flag = arg.split("=", 1)[0]
            if not any(flag in a.option_strings for a in parser._actions):
                raise _OptionError(
                    f"{flag}: the {name} probe has no such option (its options: {known or 'none'}; "
                    f"see attnkit probe {name} --help)"
                )
    args, extra = parser.parse_known_args(argv)
    if extra:
        raise _OptionError(f"{extra[0]}: unexpected argument (options take one value: --lengths 1k,2k)")
    kwargs = {}
    for dest, (keyword, option, kind) in dests.items():
        text = getattr(args, dest)
        if text is None:
            continue
        kwargs[keyword] = text if kind == "bool" else parse_value(text, kind, option)
    for item in args.param:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise _OptionError(f"--param: expected KEY=VALUE, got {item!r}")
        if key in RESERVED:
            raise _OptionError(f"--param: {key} is set by the CLI" + (" (use --model)" if key != "progress" else ""))
        if key in options:
            option, kind, _ = options[key]
            kwargs[key] = parse_value(text, kind, f"--param {key}")
        elif _takes_any_keyword(function):
            kwargs[key] = parse_value(text, "any", f"--param {key}")
        else:
            raise _OptionError(f"--param: the {name} probe has no keyword {key!r} (its keywords: {', '.join(options) or 'none'})")
    return args, kwargs


# -- running ----------------------------------------------------------------------------------


class StepLines:
    """One line per probe step on stderr: ``needle 3 12.4s length=1024 depth=0.5``."""

    def __init__(self, label: str, enabled: bool = True):
        self.label, self.enabled, self.count = label, enabled, 0
        self.start = time.perf_counter()

    def __call__(self, what: str = "") -> None:
        self.count += 1
        if self.enabled:
            line = " ".join(str(what).split())  # one line, whatever the probe sent
            sys.stderr.write(f"{self.label} {self.count} {time.perf_counter() - self.start:.1f}s {line}\n")
            sys.stderr.flush()


def run(args) -> int:
    from ..probes import PROBES, get_probe

    if args.name is None:
        raise ValueError(f"NAME: which probe? expected one of {', '.join(PROBES)} (attnkit probe NAME --help for its options)")
    if args.name not in PROBES:
        raise ValueError(f"NAME: unknown probe {args.name!r}; expected one of {', '.join(PROBES)}")
    function = get_probe(args.name)
    if any(a in ("-h", "--help") for a in args.options):
        build_probe_parser(args.name, function)[0].print_help()
        return 0
    opts, kwargs = probe_arguments(args.name, function, args.options)
    from ..report.probe import write_probe_report

    steps = StepLines(args.name, enabled=not opts.quiet)
    out = opts.out or f"attnkit-probe-{args.name}"
    created = not os.path.exists(out)
    output_dir(out)  # before the work: a bad --out costs nothing
    try:
        with _quiet_transformers():
            result = _run_probe(function, opts.model, steps, kwargs, opts.steer)
    except BaseException:
        if created and os.path.isdir(out) and not os.listdir(out):
            os.rmdir(out)  # a failed run leaves nothing behind
        raise
    paths = {"csv": os.path.join(out, "results.csv"), "json": os.path.join(out, "results.json")}
    result.to_csv(paths["csv"])
    result.to_json(paths["json"])
    paths["html"] = write_probe_report(result, out)
    if opts.json:
        print(json.dumps(result.to_dict() | {"files": paths}, allow_nan=True, default=str))
        print(f"report: {paths['html']}", file=sys.stderr)
        return 0
    seconds = result.meta.get("seconds")
    took = f" in {seconds:.1f} s" if isinstance(seconds, (int, float)) else ""
    print(
        f"{args.name} on {result.meta.get('model') or opts.model or 'all-MiniLM-L6-v2'}: {len(result.rows)} rows, "
        f"metrics {', '.join(result.metrics) or 'none'}{took}"
    )
    for line in _summary(result):
        print(line)
    print(f"results: {paths['csv']}, {paths['json']}")
    print(f"report: {paths['html']}")
    return 0


def _run_probe(function, model_path: str | None, steps, kwargs: dict, steer: Sequence[str] = ()):
    from ..probes import load_probe_model

    parameters = inspect.signature(function).parameters
    takes_progress = "progress" in parameters or _takes_any_keyword(function)
    # a check names the probe's keyword (``attnkit.validate``): here it names the option that set it,
    # ``model`` (the probe's first argument, the model loaded from --model) included
    keywords = {name: "--" + name.replace("_", "-") for name in parameters if name not in RESERVED}
    keywords["model"] = "--model"
    with options_named({"model": "--model"}):
        pm = load_probe_model(model_path)
    try:
        call_kwargs = {**({"progress": steps} if takes_progress else {}), **kwargs}
        with options_named(keywords):
            if steer:  # with and without the interventions, in one result (a ``steered`` column)
                from .steer_spec import run_with_and_without

                return run_with_and_without(function, pm, steer, call_kwargs)
            return function(pm, None, **call_kwargs)
    except ValueError as e:
        if model_path is None and str(e).startswith("--model:"):
            raise ValueError(
                f"{e} (without --model the probe runs the bundled all-MiniLM-L6-v2, an encoder: "
                f"give --model PATH, a causal LM directory such as an arena export)"
            ) from None
        raise


def _summary(result, limit: int = 6) -> list[str]:
    """Each metric's mean over all rows (numbers only), a quick look before the report."""
    lines = []
    runs = list(dict.fromkeys(r["steered"] for r in result.rows if "steered" in r))  # --steer: plain and steered
    for metric in result.metrics[:limit]:
        if len(runs) > 1:
            lines.append(
                f"  {metric}: "
                + " | ".join(f"mean {result.mean(metric, steered=run):.4g} ({'plain' if run == 'none' else run})" for run in runs)
            )
            continue
        mean = result.mean(metric)
        if mean == mean:
            lines.append(f"  {metric}: mean {mean:.4g} over {len(result.select(metric))} rows")
    if len(result.metrics) > limit:
        lines.append(f"  ... and {len(result.metrics) - limit} more metrics (see the report)")
    return lines


@contextlib.contextmanager
def _quiet_transformers():
    """No download bars and no library notices (deprecations) while a probe runs; the
    caller's logging settings come back afterwards."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
