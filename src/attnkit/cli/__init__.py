"""The ``attnkit`` command: one sub-command per tool, each with --help.

A sub-command is a module ``attnkit.cli.<name>`` with ``add_parser(subparsers)`` that
sets ``func`` to a callable taking the parsed args and returning an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("bench", "inspect", "arena")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnkit", description="Attention mechanisms, instruments and benchmarks.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"attnkit {args.command}: error: {e}", file=sys.stderr)
        return 2
