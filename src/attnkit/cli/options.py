"""Reading and checking option values, so that every bad value is one line naming its option.

The sub-commands share one error path (``attnkit.cli.main``): a ``ValueError`` whose
message starts with the option, printed as ``attnkit <cmd>: error: --option: ...`` with
exit status 2. argparse's own errors (``type=`` functions below, unknown choices) go
through the same path (``Parser.error``). Checks that need the filesystem (output
directories, input files) run before any work starts, so a typo in ``--out`` does not
cost a finished benchmark or training grid.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import tempfile


class UsageError(ValueError):
    """A command-line error found by argparse; ``prog`` is the (sub-)command it belongs to."""

    def __init__(self, prog: str, message: str, usage: str = ""):
        super().__init__(message)
        self.prog, self.usage = prog, usage


class Parser(argparse.ArgumentParser):
    """argparse that raises ``UsageError`` instead of printing and exiting, with the
    option first: ``--heads: expected ...`` rather than ``argument --heads: ...``.
    Sub-parsers are built from the same class (argparse's default ``parser_class``)."""

    def error(self, message):
        raise UsageError(self.prog, re.sub(r"^argument ([^:]+): ", r"\1: ", message), self.format_usage())


# -- argparse ``type=`` functions -------------------------------------------------------------


def _number(text: str, convert, accept, expected: str, expected_value: str | None = None):
    """``convert(text)`` when it parses and ``accept``s the value; otherwise argparse's
    error saying what was ``expected`` (``expected_value`` for a value that parsed)."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not accept(value):
        raise argparse.ArgumentTypeError(f"expected {expected_value or expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An int >= 1 (counts, sizes, steps)."""
    return _number(text, int, lambda v: v >= 1, "a positive integer")


def positive_float(text: str) -> float:
    """A finite float > 0 (learning rates)."""
    return _number(text, float, lambda v: math.isfinite(v) and v > 0, "a positive number", "a positive finite number")


def nonnegative_int(text: str) -> int:
    """An int >= 0 (seeds)."""
    return _number(text, int, lambda v: v >= 0, "an integer >= 0")


def nonnegative_float(text: str) -> float:
    """A finite float >= 0 (guidance scales)."""
    return _number(text, float, lambda v: math.isfinite(v) and v >= 0, "a number >= 0", "a finite number >= 0")


def int_list(text: str) -> list[int]:
    """``"64,128"`` -> [64, 128]: comma-separated positive ints."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


# -- errors from the library, renamed to the option that carried the value --------------------


@contextlib.contextmanager
def options_named(names: dict[str, str]):
    """Re-raise a ``ValueError`` whose message starts with a library argument's name
    (``"layers: ..."``) with the option that set it (``"--layers: ..."``). Messages that
    name no known argument pass unchanged."""
    try:
        yield
    except UsageError:
        raise
    except (ValueError, FileNotFoundError) as e:
        message = str(e)
        name, sep, rest = message.partition(":")
        if sep and name in names:
            raise ValueError(f"{names[name]}:{rest}") from None
        raise


# -- files and directories --------------------------------------------------------------------


def _writable_dir(path: str) -> str | None:
    """Why nothing can be written in the existing directory ``path``, or None."""
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def output_dir(path: str, option: str = "--out") -> str:
    """Create ``path`` (and its parents) if needed and check that files can be written
    in it; an error naming ``option`` otherwise."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{option}: {path} exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{option}: cannot create directory {path}: {e.strerror or e}") from None
    reason = _writable_dir(path)
    if reason:
        raise ValueError(f"{option}: cannot write in {path}: {reason}")
    return path


def output_file(path: str, option: str) -> str:
    """Check, without creating it, that the file ``path`` can be written: its directory
    exists and is writable, and ``path`` is not a directory."""
    if os.path.isdir(path):
        raise ValueError(f"{option}: {path} is a directory; expected a file path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise ValueError(f"{option}: cannot write {path}: {parent} {what}")
    reason = _writable_dir(parent)
    if reason:
        raise ValueError(f"{option}: cannot write {path}: {reason}")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{option}: cannot write {path}: permission denied")
    return path


def read_utf8(path: str, option: str) -> str:
    """The text of the UTF-8 file ``path``; an error naming ``option`` when it is missing,
    not a file, unreadable or not UTF-8."""
    if not os.path.exists(path):
        raise ValueError(f"{option}: no such file: {path}")
    if not os.path.isfile(path):
        raise ValueError(f"{option}: {path} is not a file")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{option}: {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
            f"convert it, e.g. iconv -t UTF-8"
        ) from None
    except OSError as e:
        raise ValueError(f"{option}: cannot read {path}: {e.strerror or e}") from None
