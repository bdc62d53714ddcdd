"""The ``attnkit`` command: one sub-command per tool, each with --help.

A sub-command is a module ``attnkit.cli.<name>`` with ``add_parser(subparsers)`` that
sets ``func`` to a callable taking the parsed args and returning an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ..extras import missing_extra
from .options import Parser, UsageError

COMMANDS = ("bench", "inspect", "arena", "organisms", "probe", "rerank", "kv", "results", "doctor")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="attnkit", description="Attention mechanisms, instruments and benchmarks.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        try:
            importlib.import_module(f"{__name__}.{name}").add_parser(sub)
        except ImportError as e:  # an extra is missing: the other sub-commands still work
            why = missing_extra(e)
            if why is None:
                raise
            _unavailable(sub, name, why)
    return parser


def _unavailable(sub, name: str, why: str) -> None:
    """A sub-command whose parser needs a missing extra: it says which, and exits 1."""
    parser = sub.add_parser(name, help=f"(unavailable: {why})", description=why, add_help=True)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.set_defaults(func=lambda args: _fail(name, ImportError(why)))


def _fail(command: str, error: ImportError) -> int:
    print(f"attnkit {command}: error: {missing_extra(error)}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    """Run one sub-command; returns the exit status. A bad value is one line on stderr,
    ``attnkit <cmd>: error: --option: ...``, and status 2 (no traceback)."""
    try:
        args, extra = build_parser().parse_known_args(argv)
        if extra:  # name the sub-command and the option, not just "unrecognized arguments"
            raise UsageError(
                f"attnkit {args.command}",
                f"{extra[0]}: unrecognized arguments: {' '.join(extra)} (attnkit {args.command} --help lists the options)",
            )
    except UsageError as e:
        print(f"{e.prog}: error: {e}\n{e.usage}", end="", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"attnkit {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # an optional package: name the extra that brings it, no traceback
        if missing_extra(e) is None:
            raise
        return _fail(args.command, e)
