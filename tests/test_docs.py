"""The guides run as written: every ```python block of README.md and docs/*.md is executed
on its own (fresh namespace, its own imports and inputs), and every ``attnkit ...`` command
line they show is parsed by the real argument parser (without running it), so the
documentation cannot drift from the code. A failure names the block as file:line."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the block's first content line
    lang: str
    text: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, in order (indented fences included)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        if end == len(lines):
            raise AssertionError(f"{path.relative_to(ROOT)}:{i + 1}: unclosed code fence")
        body = "\n".join(line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[i + 1 : end])
        blocks.append(Block(path, i + 2, lang.lower(), body + "\n"))
        i = end + 1
    return blocks


ALL_BLOCKS = [b for path in DOCS for b in fenced_blocks(path)]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.lang == "python"]
SHELL_LANGS = ("bash", "sh", "shell", "console", "text", "")


def test_the_guides_have_python_blocks():
    assert len(DOCS) >= 8 and len(PYTHON_BLOCKS) >= 20  # the collection itself works


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=lambda b: b.name)
def test_every_fence_names_its_language(block):
    """An untagged block is neither run nor clearly not code: say ```python, ```bash or ```text."""
    assert block.lang, f"{block.name}: the code fence has no language (```python, ```bash or ```text)"


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.name)
def test_python_block_runs_as_written(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    monkeypatch.setenv("MPLBACKEND", "Agg")
    torch.manual_seed(0)
    grad, dtype = torch.is_grad_enabled(), torch.get_default_dtype()
    code = compile(block.text, block.name, "exec")
    try:
        exec(code, {"__name__": "__main__"})
    finally:
        torch.set_grad_enabled(grad)
        torch.set_default_dtype(dtype)


def test_attributes_the_guides_use_exist_after_a_plain_import():
    """``ak.mechanisms.available()`` must work in a fresh interpreter, not only after some
    other import has loaded the subpackage (the blocks above share one process)."""
    names = sorted(
        {m for b in PYTHON_BLOCKS for m in re.findall(r"\bak\.([A-Za-z_]\w*)", b.text)}
        | {m for path in DOCS for m in re.findall(r"`ak\.([A-Za-z_]\w*)", path.read_text(encoding="utf-8"))}
    )
    assert "mechanisms" in names and "attention" in names
    script = f"import attnkit as ak\nmissing = [n for n in {names!r} if not hasattr(ak, n)]\nprint(','.join(missing))"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"attnkit has no attribute(s) {done.stdout.strip()} after `import attnkit as ak`"


# -- command lines ---------------------------------------------------------------------------


def command_lines() -> list[tuple[str, list[str]]]:
    """(where, argv after ``attnkit``) for every ``attnkit ...`` command in a shell/text block,
    and every inline ``attnkit ...`` code span without placeholders ([...], a|b)."""
    found = []
    program = re.compile(r"^(?:\S*/)?attnkit$")
    for b in ALL_BLOCKS:
        if b.lang not in SHELL_LANGS:
            continue
        lines = b.text.splitlines()
        transcript = any(line.startswith("$ ") for line in lines)  # then the other lines are output
        for offset, line in enumerate(lines):
            if transcript and not line.startswith("$ "):
                continue
            for command in re.split(r"&&|\|\||;", line.removeprefix("$ ")):
                if not re.match(r"\s*(?:\S*/)?attnkit\s+[a-z]", command):
                    continue
                where = f"{b.path.relative_to(ROOT)}:{b.line + offset}"
                try:
                    words = shlex.split(command, comments=True)
                except ValueError as e:  # reported by the test, not at collection
                    found.append((where, [f"(cannot split {command.strip()!r}: {e})"]))
                    continue
                if program.match(words[0]) and words[1].isalpha():
                    found.append((where, words[1:]))
    for path in DOCS:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for span in re.findall(r"`((?:\S*/)?attnkit [a-z][^`]*)`", line):
                words = span.split()
                if words[1].isalpha() and not re.search(r"[\[\]|\\]|\.\.\.", span):  # not "attnkit arena: error: ..."
                    found.append((f"{path.relative_to(ROOT)}:{number}", shlex.split(span)[1:]))
    return found


COMMANDS = command_lines()


def test_the_guides_show_commands_of_each_tool():
    tools = {argv[0] for _, argv in COMMANDS if argv}
    assert {"arena", "inspect", "bench"} <= tools


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[f"{w} {' '.join(a)[:40]}" for w, a in COMMANDS])
def test_command_line_parses(where, argv):
    """The flags a guide shows exist and take the values it gives them (parsed, not run);
    an arena grid's mechanisms and task parameters are checked too."""
    from attnkit.cli import build_parser
    from attnkit.cli.options import UsageError

    assert not argv[0].startswith("(cannot split"), f"{where}: {argv[0]}"
    parser = build_parser()
    if "-h" in argv or "--help" in argv:  # argparse would print the help and exit
        assert argv and argv[0] in parser._subparsers._group_actions[0].choices, where
        return
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        pytest.fail(f"{where}: attnkit {' '.join(argv)}: {e}")
    if args.command == "arena":
        from attnkit.arena.models import parse_mechanisms
        from attnkit.arena.tasks import make_task
        from attnkit.cli.arena import parse_params

        parse_mechanisms(args.mechanisms)
        make_task(args.task, **parse_params(args.param))


#: guides whose `--option` code spans are options of one sub-command
OPTION_GUIDES = {"arena.md": "arena", "inspect.md": "inspect"}


@pytest.mark.parametrize("guide,command", sorted(OPTION_GUIDES.items()))
def test_options_named_in_a_guide_exist(guide, command):
    from attnkit.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices[command]
    known = {s for action in sub._actions for s in action.option_strings}
    text = (ROOT / "docs" / guide).read_text(encoding="utf-8")
    named = set(re.findall(r"`(--[a-z][a-z0-9-]*)", text))
    assert named, guide
    assert named <= known, f"docs/{guide} names options attnkit {command} does not have: {sorted(named - known)}"
