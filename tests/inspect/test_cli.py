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
    code = main(["inspect", "--model", model_dir, "--prompt", "the keeper wrote about the fog", "--out", str(out),
                 "--meters", "sink", "distance", "topkeys", "spans", "--span", "fog=5:7", "--layers", "1", "--json", "--no-figures"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["report"] == str(out / "report.html") and summary["figures"] == [] and summary["tokens"] == 8
    rows = (out / "profile.csv").read_text().splitlines()
    assert rows[0] == "layer,head,metric,value" and all(r.startswith("1,") for r in rows[1:])
    assert any(",span.fog," in r for r in rows)


def test_text_file_and_truncation_warning(model_dir, tmp_path, capsys):
    text = tmp_path / "long.txt"
    text.write_text(" ".join(["the sea"] * 50))
    assert main(["inspect", "--model", model_dir, "--text", str(text), "--out", str(tmp_path / "o"), "--quiet", "--no-figures"]) == 2
    assert "at most 64 positions" in capsys.readouterr().err
    assert main(["inspect", "--model", model_dir, "--text", str(text), "--out", str(tmp_path / "o"), "--quiet",
                 "--no-figures", "--max-tokens", "64"]) == 0
    err = capsys.readouterr().err
    assert "warning: inputs: 102 tokens truncated to the first 64" in err


@pytest.mark.parametrize("args,message", [
    (["--model", "/nonexistent/model"], "no such directory"),
    (["--model", "."], "no config.json"),
    (["--prompt", "   "], "--prompt: the text is empty"),
    (["--text", "/nonexistent.txt"], "--text: no such file"),
    (["--layers", "1-x"], "--layers"),
    (["--span", "doc"], "--span"),
    (["--queries", "5"], "--queries"),
    (["--queries=-8:", "--layers", "9"], "layers: [9] out of range"),
    (["--token-heads", "3"], "--token-heads"),
])
def test_bad_input_is_a_clear_error(args, message, tmp_path, capsys):
    assert main(["inspect", *args, "--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnkit inspect: error:") and message in err


def test_empty_text_file(tmp_path, capsys, model_dir):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert main(["inspect", "--model", model_dir, "--text", str(empty), "--out", str(tmp_path), "--quiet"]) == 2
    assert "--text: the text is empty" in capsys.readouterr().err
