"""The command line's one error path: a bad value of any option is status 2 and one line
``attnkit <cmd>: error: --option: ...`` on stderr, without a traceback, before any work.
(arena's and inspect's options are tested beside those commands.)"""

import argparse
import os

import pytest

from attnkit.cli import build_parser, main
from attnkit.cli.options import int_list, output_dir, output_file, positive_float, positive_int, read_utf8


def run_cli(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured


@pytest.mark.parametrize(
    "args,message",
    [
        (["--suite", "bogus"], "attnkit bench: error: --suite: invalid choice: 'bogus'"),
        (["--suite"], "attnkit bench: error: --suite: expected one argument"),
        (["--json"], "attnkit bench: error: --json: expected one argument"),
    ],
)
def test_bench_option_errors(args, message, capsys):
    code, captured = run_cli(["bench", *args], capsys)
    assert code == 2 and captured.err.startswith(message), captured.err


def test_bench_json_path_is_checked_before_timing_anything(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    cases = [
        (tmp_path, f"--json: {tmp_path} is a directory; expected a file path"),
        (afile / "rows.json", f"--json: cannot write {afile / 'rows.json'}: {afile} is not a directory"),
        (
            tmp_path / "missing" / "rows.json",
            f"--json: cannot write {tmp_path / 'missing' / 'rows.json'}: {tmp_path / 'missing'} does not exist",
        ),
    ]
    for path, message in cases:
        code, captured = run_cli(["bench", "--suite", "kernels", "--quick", "--json", str(path)], capsys)
        assert code == 2 and captured.err == f"attnkit bench: error: {message}\n"  # no progress line: nothing ran
        assert captured.out == ""
    assert not (tmp_path / "missing").exists()


def test_top_level_errors_and_help(capsys):
    code, captured = run_cli([], capsys)
    assert code == 2 and captured.err.startswith("attnkit: error: the following arguments are required: command")
    code, captured = run_cli(["frobnicate"], capsys)
    assert code == 2 and captured.err.startswith("attnkit: error: command: invalid choice: 'frobnicate'")
    code, captured = run_cli(["bench", "--fast", "1"], capsys)
    assert code == 2 and captured.err.startswith("attnkit bench: error: --fast: unrecognized arguments: --fast 1")
    code, captured = run_cli(["--help"], capsys)
    assert code == 0 and "arena" in captured.out and "inspect" in captured.out and "bench" in captured.out


def test_every_integer_option_refuses_zero_and_negatives():
    """Audit: each integer-valued option of every sub-command is parsed by a checking type
    (not plain int), so 0 or -1 can never reach a division or a range."""
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name in ("bench", "inspect", "arena"):
        for action in commands[name]._actions:
            if action.type is int:
                pytest.fail(f"attnkit {name} {'/'.join(action.option_strings)} is a plain int")
            if action.type in (positive_int, int_list):
                for bad in ("0", "-1"):
                    with pytest.raises(argparse.ArgumentTypeError, match="expected positive integer|expected a positive integer"):
                        action.type(bad)


def test_value_types():
    assert positive_int("3") == 3 and positive_float("1e-3") == 1e-3 and int_list("64, 128,") == [64, 128]
    for bad in ("0", "-2", "1.5", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match=f"got {bad!r}"):
            positive_int(bad)
    for bad in ("0", "-1", "nan", "inf", "fast"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a positive"):
            positive_float(bad)
    for bad in ("", ",", "64,x", "64,0"):
        with pytest.raises(argparse.ArgumentTypeError):
            int_list(bad)


def test_files_and_directories(tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes("caf\u00e9\n".encode())
    assert read_utf8(str(text), "--text") == "caf\u00e9\n"
    text.write_bytes(b"ok \xff")
    with pytest.raises(ValueError, match=r"^--text: .* is not UTF-8 text \(byte 0xff at offset 3\)"):
        read_utf8(str(text), "--text")
    with pytest.raises(ValueError, match=r"^--in: no such file"):
        read_utf8(str(tmp_path / "none"), "--in")
    with pytest.raises(ValueError, match=r"^--in: .* is not a file"):
        read_utf8(str(tmp_path), "--in")

    made = tmp_path / "a" / "b"
    assert output_dir(str(made)) == str(made) and made.is_dir() and os.listdir(made) == []  # the write probe leaves nothing
    with pytest.raises(ValueError, match=r"^--out: .* exists and is not a directory"):
        output_dir(str(text))
    with pytest.raises(ValueError, match=r"^--out: cannot create directory"):
        output_dir(str(text / "sub"))

    assert output_file(str(tmp_path / "new.json"), "--json") and not (tmp_path / "new.json").exists()
    with pytest.raises(ValueError, match=r"^--json: .* is a directory"):
        output_file(str(tmp_path), "--json")
