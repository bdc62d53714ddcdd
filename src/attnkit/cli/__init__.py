"""The ``attnkit`` command: one sub-command per tool, each with --help."""

from __future__ import annotations

import argparse
import sys

from . import bench

COMMANDS = {"bench": bench}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnkit", description="Attention mechanisms, instruments and benchmarks.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"attnkit {args.command}: error: {e}", file=sys.stderr)
        return 2
