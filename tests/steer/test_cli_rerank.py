"""``attnkit rerank``: the table and the JSON equal the Python call, the three documents
file formats, and every bad value as one error line naming its option (exit 2)."""

import json

import pytest

from attnkit.cli import main
from attnkit.cli.rerank import read_documents
from attnkit.steer import rerank

DOCS = ["f1 f2 k3 v4", "f0 f0 f1 f2", "f5 k5 v6 f3", "f7 f6 f5 f4"]
QUERY = "Q k3"


@pytest.fixture
def docs_file(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(DOCS) + "\n\n")  # a trailing blank line is not a document
    return str(path)


@pytest.mark.parametrize("method", ["icr", "sorting", "basin"])
def test_json_equals_the_python_call(needle_export, docs_file, capsys, method):
    assert (
        main(
            [
                "rerank",
                "--model",
                needle_export,
                "--query",
                QUERY,
                "--docs",
                docs_file,
                "--method",
                method,
                "--separator",
                " ",
                "--calibration",
                "Q f0",
                "--json",
            ]
        )
        == 0
    )
    got = json.loads(capsys.readouterr().out)
    order, scores = rerank(needle_export, None, QUERY, DOCS, method=method, separator=" ", calibration="Q f0")
    assert got["order"] == order and got["scores"] == pytest.approx(scores, rel=1e-12)
    assert got["documents"] == DOCS and got["method"] == method


def test_table_lists_documents_in_the_returned_order(needle_export, docs_file, capsys):
    assert (
        main(
            [
                "rerank",
                "--model",
                needle_export,
                "--query",
                QUERY,
                "--docs",
                docs_file,
                "--separator",
                " ",
                "--calibration",
                "Q f0",
                "--uncalibrated",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out.splitlines()
    order, scores = rerank(needle_export, None, QUERY, DOCS, separator=" ", calibrate=False)
    assert out[0].startswith("icr on ") and "4 documents (ranking, most relevant first)" in out[0]
    assert out[1].split() == ["position", "document", "score", "text"]
    for line, (position, doc) in zip(out[2:], enumerate(order, 1)):
        cells = line.split()
        assert cells[:2] == [str(position), str(doc)] and float(cells[2]) == pytest.approx(scores[doc], rel=1e-5)
        assert " ".join(cells[3:]) == DOCS[doc]


def test_documents_files_json_jsonl_and_text(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(DOCS))
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(d) if i % 2 else json.dumps({"text": d}) for i, d in enumerate(DOCS)))
    (tmp_path / "c.txt").write_text("\n".join(DOCS))
    for name in ("a.json", "b.jsonl", "c.txt"):
        assert read_documents(str(tmp_path / name)) == DOCS


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("missing.txt", None, "--docs: no such file"),
        ("empty.txt", "\n \n", "--docs: .* holds no documents"),
        ("bad.json", "[1, 2]", "--docs: .* must hold a JSON array of strings"),
        ("broken.json", '["a"', "--docs: .* is not valid JSON"),
        ("bad.jsonl", '"a"\n{"title": 1}\n', "--docs: line 2 of .* must be a JSON string or an object"),
        ("blank.json", '["a", " "]', "--docs: document 1 of .* is empty"),
    ],
)
def test_bad_documents_files(tmp_path, capsys, name, content, message):
    import re

    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    assert main(["rerank", "--model", str(tmp_path), "--query", QUERY, "--docs", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnkit rerank: error: --docs: ") and re.search(message, err), err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--method", "bm25"], "--method: invalid choice: 'bm25'"),
        (["--rounds", "0"], "--rounds: expected a positive integer"),
        (["--query", " "], "--query: expected a non-empty string"),
        (["--query-template", "no placeholder"], "--query-template: expected a string containing {query}"),
        (["--calibration", "Q f0", "--layers", "5"], "--layers: expected None or a non-empty list of indices below 2"),
        (["--calibration", "Q f0", "--layers", "x"], "--layers: expected comma-separated layer indices"),
        ([], "--calibration: the tokenizer cannot encode 'N/A'"),  # the arena vocabulary has no unknown token
    ],
)
def test_bad_options_are_one_line_naming_the_option(needle_export, docs_file, capsys, extra, message):
    argv = ["rerank", "--model", needle_export, "--query", QUERY, "--docs", docs_file, "--separator", " "] + extra
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_missing_model_directory(docs_file, tmp_path, capsys):
    assert main(["rerank", "--model", str(tmp_path / "nope"), "--query", QUERY, "--docs", docs_file]) == 2
    assert "--model: no such directory" in capsys.readouterr().err
    assert main(["rerank", "--query", QUERY, "--docs", docs_file]) == 2
    assert "--model" in capsys.readouterr().err


def test_layers_option(needle_export, docs_file, capsys):
    assert (
        main(
            [
                "rerank",
                "--model",
                needle_export,
                "--query",
                QUERY,
                "--docs",
                docs_file,
                "--separator",
                " ",
                "--calibration",
                "Q f0",
                "--layers",
                "1",
                "--json",
            ]
        )
        == 0
    )
    got = json.loads(capsys.readouterr().out)
    order, scores = rerank(needle_export, None, QUERY, DOCS, separator=" ", calibration="Q f0", layers=[1])
    assert got["order"] == order and got["scores"] == pytest.approx(scores, rel=1e-12)
