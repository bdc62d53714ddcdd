"""``attnkit inspect``: the default run, a local model, and bad input."""

import json
import os

import pytest
from inspect_models import bert, saved, tokenizer

from attnkit.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return saved(bert(positions=64), tokenizer(d), d / "bert")


def test_default_run_writes_a_report_of_minilm_on_the_sample(tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["inspect", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert lines[-1] == f"report: {out / 'report.html'}"
    assert "all-MiniLM-L6-v2" in lines[0] and "6 layers, 72 heads" in lines[0]
    assert "inspect 6/6" in captured.err  # a progress step per layer
    html = (out / "report.html").read_text()
    assert "lighthouse" in html and "<svg" in html
    assert {"profile.csv", "profile.json", "figures"} <= set(os.listdir(out))
    assert "heatmap_sink.score.png" in os.listdir(out / "figures")


def test_local_model_with_prompt_and_json(model_dir, tmp_path, capsys):
    out = tmp_path / "o"
    code = main(
        [
            "inspect",
            "--model",
            model_dir,
            "--prompt",
            "the keeper wrote about the fog",
            "--out",
            str(out),
            "--meters",
            "sink",
            "distance",
            "topkeys",
            "spans",
            "--span",
            "fog=5:7",
            "--layers",
            "1",
            "--json",
            "--no-figures",
        ]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["report"] == str(out / "report.html") and summary["figures"] == [] and summary["tokens"] == 8
    rows = (out / "profile.csv").read_text().splitlines()
    assert rows[0] == "layer,head,metric,value" and all(r.startswith("1,") for r in rows[1:])
    assert any(",span.fog," in r for r in rows)


def test_text_file_and_truncation_warning(model_dir, tmp_path, capsys):
    text = tmp_path / "long.txt"
    text.write_text(" ".join(["the sea"] * 50))
    assert (
        main(["inspect", "--model", model_dir, "--text", str(text), "--out", str(tmp_path / "o"), "--quiet", "--no-figures"]) == 2
    )
    assert "at most 64 positions" in capsys.readouterr().err
    assert (
        main(
            [
                "inspect",
                "--model",
                model_dir,
                "--text",
                str(text),
                "--out",
                str(tmp_path / "o"),
                "--quiet",
                "--no-figures",
                "--max-tokens",
                "64",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "warning: inputs: 102 tokens truncated to the first 64" in err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "/nonexistent/model"], "--model: no such directory"),
        (["--model", "."], "--model: . is not a transformers model directory"),
        (["--prompt", "   "], "--prompt: the text is empty"),
        (["--text", "/nonexistent.txt"], "--text: no such file: /nonexistent.txt"),
        (["--text", "/"], "--text: / is not a file"),
        (["--layers", "1-x"], "--layers: expected indices"),
        (["--heads", "-1"], "--heads: expected indices"),
        (["--layers", "0-100000000"], "--layers: expected indices"),  # refused, not a list of 10^8 ints
        (["--span", "doc"], "--span: expected NAME=START:END"),
        (["--queries", "5"], "--queries: expected LO:HI"),
        (["--queries", "5:2"], "--queries: LO:HI selects no query"),
        (["--token-heads", "3"], "--token-heads: expected LAYER.HEAD"),
        (["--top-k", "0"], "--top-k: expected a positive integer, got '0'"),
        (["--max-tokens", "0"], "--max-tokens: expected a positive integer, got '0'"),
        (["--max-tokens", "many"], "--max-tokens: expected a positive integer"),
        (["--meters", "bogus"], "--meters: invalid choice: 'bogus'"),
        (["--meters", "spans"], "--meters spans: needs at least one --span"),
        (["--mechanism", "bogus"], "--mechanism: unknown mechanism 'bogus'"),
        (["--prompt", "a", "--text", "b.txt"], "--text: not allowed with argument --prompt"),
    ],
)
def test_bad_input_is_a_clear_error(args, message, tmp_path, capsys):
    assert main(["inspect", *args, "--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"attnkit inspect: error: {message}"), err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--queries=-8:", "--layers", "9"], "--layers: [9] out of range; the model has 2 layers"),
        (["--heads", "0,7"], "--heads: [7] out of range; the model has 4 heads"),
        (["--meters", "spans", "--span", "a=3:1"], "--span: 'a' must be (start, end) with 0 <= start < end"),
        (["--meters", "spans", "--span", "a=0:99"], "--span: 'a' = (0, 99) ends past the"),
        (["--token-heads", "1.9"], "--token-heads: [(1, 9)] have no top keys in this profile"),
    ],
)
def test_values_out_of_the_models_range_name_the_option(model_dir, args, message, tmp_path, capsys):
    code = main(
        [
            "inspect",
            "--model",
            model_dir,
            "--prompt",
            "the keeper wrote about the fog",
            *args,
            "--out",
            str(tmp_path / "o"),
            "--quiet",
            "--no-figures",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"attnkit inspect: error: {message}"), err


def test_a_text_file_that_is_not_utf8_is_named(model_dir, tmp_path, capsys):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("the keeper wrote about the caf\u00e9".encode("latin-1"))  # é is byte 0xe9, offset 30
    assert main(["inspect", "--model", model_dir, "--text", str(latin1), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"attnkit inspect: error: --text: {latin1} is not UTF-8 text (byte 0xe9 at offset 30)"), err
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_an_unusable_out_directory_is_named(model_dir, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    for out, message in (
        (afile, f"--out: {afile} exists and is not a directory"),
        (afile / "sub", f"--out: cannot create directory {afile / 'sub'}"),
    ):
        assert main(["inspect", "--model", model_dir, "--prompt", "the sea", "--out", str(out), "--quiet"]) == 2
        assert capsys.readouterr().err.startswith(f"attnkit inspect: error: {message}")


def test_an_input_longer_than_the_model_names_its_option(model_dir, tmp_path, capsys):
    prompt = " ".join(["the sea"] * 50)
    assert main(["inspect", "--model", model_dir, "--prompt", prompt, "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnkit inspect: error: --prompt: 102 tokens, but the model reads at most 64 positions"), err


def test_empty_text_file(tmp_path, capsys, model_dir):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert main(["inspect", "--model", model_dir, "--text", str(empty), "--out", str(tmp_path), "--quiet"]) == 2
    assert "--text: the text is empty" in capsys.readouterr().err
