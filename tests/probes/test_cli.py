"""``attnkit probe NAME``: options read off the probe function's signature, the files it
writes, progress and --json, and every bad value an error naming its option (exit 2).

The options are tested with a fake probe registered in ``attnkit.probes.PROBES`` that
echoes the keywords it receives; the real probes are checked for a usable --help."""

import json
import sys
from pathlib import Path

import pytest

here = Path(__file__).resolve().parent
sys.path.insert(0, str(here))
sys.path.insert(0, str(here.parent / "inspect"))
import fake_probes  # noqa: E402
from inspect_models import bert, llama, saved, tokenizer  # noqa: E402

from attnkit.cli import main  # noqa: E402
from attnkit.cli.probe import parse_value, value_kind  # noqa: E402
from attnkit.probes import PROBES, ProbeResult  # noqa: E402


@pytest.fixture
def fakes(monkeypatch):
    monkeypatch.setitem(sys.modules, "attnkit.probes.fake_probes", fake_probes)
    monkeypatch.setitem(PROBES, "fake", "fake_probes:fake")
    monkeypatch.setitem(PROBES, "fake-causal", "fake_probes:fake_causal")


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return saved(bert(positions=64), tokenizer(d), d / "bert")


@pytest.fixture(scope="module")
def causal_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return saved(llama(positions=64), tokenizer(d), d / "llama")


def test_options_become_the_probes_keyword_arguments(fakes, encoder_dir, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(
        [
            "probe",
            "fake",
            "--model",
            encoder_dir,
            "--out",
            str(out),
            "--lengths",
            "8,16",
            "--depths",
            "0,0.5",
            "--samples",
            "2",
            "--seed",
            "7",
            "--pooling",
            "cls",
            "--top",
            "3",
            "--exact",
            "--haystack",
            "essays.txt",
            "--tasks",
            "niah,vt",
            "--param",
            "scale=0.5",
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    result = ProbeResult.from_json(str(out / "results.json"))
    # every value arrives with its type: ints, floats, lists, bool, text
    assert result.meta["params"] == {
        "lengths": [8, 16],
        "depths": [0.0, 0.5],
        "samples": 2,
        "seed": 7,
        "pooling": "cls",
        "top": 3,
        "exact": True,
        "haystack": "essays.txt",
        "tasks": ["niah", "vt"],
        "scale": 0.5,
    }
    assert result.meta["kind"] == "encoder" and result.value("layers") == 2
    lines = captured.out.strip().splitlines()
    assert lines[-1] == f"report: {out / 'report.html'}"  # the report's path comes last
    assert lines[0].startswith("fake on bert: 9 rows")
    # one progress line per step on stderr, numbered
    steps = [line for line in captured.err.splitlines() if line.startswith("fake ")]
    assert [s.split()[1] for s in steps] == ["1", "2", "3", "4"]
    assert steps[-1].endswith("length=16 depth=0.5")
    csv_lines = (out / "results.csv").read_text().splitlines()
    assert csv_lines[0] == "probe,length,depth,sample,metric,value" and len(csv_lines) == 1 + 9
    html = (out / "report.html").read_text()
    assert html.count("<svg") == 2 and "score by length" in html


def test_defaults_are_the_functions_own(fakes, encoder_dir, tmp_path, capsys):
    assert main(["probe", "fake", "--model", encoder_dir, "--out", str(tmp_path), "--quiet", "--lengths", "1k"]) == 2
    assert "longer than the 64 positions" in capsys.readouterr().err  # 1k = 1024 tokens, checked by the probe
    assert main(["probe", "fake", "--model", encoder_dir, "--out", str(tmp_path), "--quiet"]) == 0
    params = ProbeResult.from_json(str(tmp_path / "results.json")).meta["params"]
    assert params == {
        "lengths": [4, 8],
        "depths": [0.0, 1.0],
        "samples": 1,
        "seed": 0,
        "pooling": "mean",
        "top": None,
        "exact": False,
        "haystack": None,
        "tasks": None,
        "scale": None,
    }
    assert capsys.readouterr().err == ""  # --quiet: no progress


def test_json_goes_to_stdout_and_progress_to_stderr(fakes, encoder_dir, tmp_path, capsys):
    out = tmp_path / "j"
    assert main(["probe", "fake", "--model", encoder_dir, "--out", str(out), "--json", "--depths", "0.25"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)  # nothing but the JSON on stdout
    saved_json = json.loads((out / "results.json").read_text())
    assert {k: data[k] for k in saved_json} == saved_json
    assert data["files"] == {"csv": str(out / "results.csv"), "json": str(out / "results.json"), "html": str(out / "report.html")}
    assert "fake 2 " in captured.err and captured.err.strip().splitlines()[-1] == f"report: {out / 'report.html'}"


def test_causal_probe_without_model_says_so(fakes, tmp_path, capsys):
    assert main(["probe", "fake-causal", "--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnkit probe: error: --model: the fake-causal probe needs a causal language model")
    assert "all-MiniLM-L6-v2" in err and "give --model PATH" in err
    assert not (tmp_path / "report.html").exists()


def test_causal_probe_on_a_causal_model(fakes, causal_dir, tmp_path, capsys):
    assert main(["probe", "fake-causal", "--model", causal_dir, "--out", str(tmp_path), "--quiet"]) == 0
    assert ProbeResult.from_json(str(tmp_path / "results.json")).value("layers") == 2


@pytest.mark.parametrize(
    "args,message",
    [
        (["--nope", "3"], "--nope: the fake probe has no such option (its options: --lengths, --depths"),
        (["--nope=3"], "--nope: the fake probe has no such option"),
        (["--lengths", "8,x"], "--lengths: expected a comma-separated list of ints, e.g. 1k,2k,4096, got '8,x'"),
        (["--lengths", "8,,16"], "--lengths: expected a comma-separated list of ints"),
        (["--depths", "0,half"], "--depths: expected a comma-separated list of numbers"),
        (["--depths", "nan"], "--depths: expected a comma-separated list of numbers"),
        (["--samples", "two"], "--samples: expected an int (e.g. 8 or 4k = 4096), got 'two'"),
        (["--samples"], "--samples: expected one argument"),
        (["--lengths", "0"], "--lengths: expected ints >= 1, got [0]"),  # the probe's own check
        (["--pooling", "max"], "--pooling: expected mean, cls or last, got 'max'"),
        (["--param", "nope=1"], "--param: the fake probe has no keyword 'nope'"),
        (["--param", "lengths"], "--param: expected KEY=VALUE, got 'lengths'"),
        (["--param", "lengths=a"], "--param lengths: expected a comma-separated list of ints"),
        (["--param", "progress=1"], "--param: progress is set by the CLI"),
        (["--samples", "2", "extra"], "extra: unexpected argument"),
        (["--model", "/nonexistent/model"], "--model: no such directory"),
    ],
)
def test_bad_input_is_a_clear_error(fakes, encoder_dir, args, message, tmp_path, capsys):
    model = [] if "--model" in args else ["--model", encoder_dir]
    assert main(["probe", "fake", *model, *args, "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnkit probe: error: ") and message in err, err
    assert "Traceback" not in err and not (tmp_path / "o").exists()  # nothing left behind


@pytest.mark.parametrize(
    "argv,message",
    [
        (["head-ablation", "--ablate", "top2"], "--ablate: expected topK-SCORE or randomK"),
        (["head-ablation", "--score-samples", "0"], "--score-samples: expected an int >= 1, got 0"),
        (["head-ablation", "--pairs", "2"], "--pairs: applies to --task kv-retrieval"),
        (["kv-curves", "--policy-params", "snapkv.window"], "--policy-params: expected POLICY.NAME=VALUE"),
        (["kv-curves", "--task", "kv-retrieval", "--lengths", "6", "--pairs", "8"], "--lengths: 6 tokens hold 2 two-token cells"),
        (["kv-curves", "--workers", "2"], "--workers: only with --engine local or ray"),
        (["needle", "--needle", "x"], "--needle: an arena export is probed in its task's own tokens; --needle applies"),
        (["needle", "--kv", "nope"], "--kv: policy: unknown policy 'nope'"),
        (["kv-retrieval", "--length", "3"], "--length: expected an int >= 4, got 3"),
        (["interference", "--keys", "99"], "--keys: the task has 8 key symbols, got 99"),
        (["heads", "--top", "999"], "--top: expected at most the model's 8 heads"),
        (["heads", "--seed", "-1", "--batch-size", "0"], "--batch-size: expected prompts per forward pass (an int >= 1)"),
        (["heads", "--context", "7", "--scores", "retrieval"], "--context: expected tokens per retrieval prompt"),
        (["ruler"], "--model: the ruler probe asks English questions"),
        (["position-bias"], "--model: the position-bias probe measures embedding models"),
        (["visual"], "--model: the visual probe needs a vision-language model"),
    ],
)
def test_a_real_probes_checks_name_the_options(needle_export, argv, message, tmp_path, capsys):
    """The probes name their Python keywords (``attnkit.validate``); the command line, the options."""
    name, *options = argv
    assert main(["probe", name, "--model", needle_export, *options, "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"attnkit probe: error: {message}"), err
    assert not (tmp_path / "o").exists()


def test_a_model_that_does_not_load_names_the_option(tmp_path, capsys):
    assert main(["probe", "needle", "--model", "no-such-organism", "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert capsys.readouterr().err.startswith("attnkit probe: error: --model: no such directory or organism: 'no-such-organism'")


@pytest.mark.parametrize(
    "argv,message",
    [
        ([], "NAME: which probe? expected one of needle"),
        (["nope"], "NAME: unknown probe 'nope'; expected one of needle, kv-retrieval"),
        (["--lengths", "4"], "unrecognized arguments: --lengths"),  # argparse: options come after NAME
    ],
)
def test_unknown_or_missing_probe(argv, message, capsys):
    assert main(["probe", *argv]) == 2
    assert message in capsys.readouterr().err


def test_out_must_be_a_directory(fakes, encoder_dir, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["probe", "fake", "--model", encoder_dir, "--out", str(blocker), "--quiet"]) == 2
    assert "--out: " in capsys.readouterr().err


def test_help_lists_the_probes_options_with_their_docs(fakes, capsys):
    assert main(["probe", "fake", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: attnkit probe fake")
    for option in (
        "--lengths N,...",
        "--depths X,...",
        "--samples N",
        "--pooling POOLING",
        "--exact, --no-exact",
        "--param KEY=VALUE",
    ):
        assert option in out
    assert "mean, cls or last" in out and "prompt lengths in tokens" in out and "--progress" not in out


@pytest.mark.parametrize("name", list(PROBES))
def test_every_registered_probe_has_a_help_page(name, capsys):
    assert main(["probe", name, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: attnkit probe {name}") and "--seed" in out


@pytest.mark.parametrize(
    "default,annotation,name,kind",
    [
        ((256, 512), "", "lengths", "ints"),
        ((0.0, 0.5), "", "depths", "floats"),
        ((0, 0.5), "", "depths", "floats"),
        (("a", "b"), "", "tasks", "strs"),
        (3, "", "top", "int"),
        (0.5, "", "threshold", "float"),
        (True, "", "flag", "bool"),
        ("mean", "", "pooling", "str"),
        (None, "list[int] | None", "x", "ints"),
        (None, "Sequence[float] | None", "x", "floats"),
        (None, "tuple[str, ...]", "x", "strs"),
        (None, "int | None", "x", "int"),
        (None, "Optional[float]", "x", "float"),
        (None, "int | float", "x", "float"),
        (None, "str | os.PathLike | None", "x", "str"),
        (None, "", "lengths", "ints"),  # the common names read the same in every probe
        (None, "", "depths", "floats"),
        (None, "", "whatever", "any"),
    ],
)
def test_value_kind(default, annotation, name, kind):
    assert value_kind(default, annotation, name) == kind


def test_parse_value():
    assert parse_value("1k,2048,4K", "ints", "--lengths") == [1024, 2048, 4096]
    assert parse_value("7", "ints", "--lengths") == [7]
    assert parse_value("0, .5,1", "floats", "--depths") == [0.0, 0.5, 1.0]
    assert parse_value("niah, vt", "strs", "--tasks") == ["niah", "vt"]
    assert parse_value("yes", "bool", "--x") is True and parse_value("0", "bool", "--x") is False
    assert parse_value("3", "any", "--x") == 3 and parse_value("0.5", "any", "--x") == 0.5
    assert parse_value("a", "any", "--x") == "a" and parse_value("1,b", "any", "--x") == [1, "b"]
    with pytest.raises(ValueError, match="--x: expected true or false, got 'maybe'"):
        parse_value("maybe", "bool", "--x")
    with pytest.raises(ValueError, match="--x: expected a finite number, got 'inf'"):
        parse_value("inf", "float", "--x")
    with pytest.raises(ValueError, match="--x: expected a value or a comma-separated list"):
        parse_value("1,", "any", "--x")


def test_a_real_probe_through_the_cli_equals_the_python_call(needle_export, tmp_path, capsys):
    from attnkit import probes

    out = tmp_path / "needle"
    assert (
        main(
            [
                "probe",
                "needle",
                "--model",
                needle_export,
                "--lengths",
                "32",
                "--depths",
                "0,1",
                "--samples",
                "2",
                "--out",
                str(out),
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    direct = probes.run("needle", needle_export, lengths=[32], depths=[0.0, 1.0], samples=2)
    assert data["rows"] == json.loads(direct.to_json())["rows"]
    assert data["meta"]["params"] == direct.meta["params"]
    assert direct.mean("accuracy") > 0.5  # a trained model, read in its task's own tokens
    html = (out / "report.html").read_text()
    assert html.count('<svg class="heatmap"') == len(direct.meta["figures"])  # every figure the probe declared is drawn


def test_the_callers_transformers_logging_comes_back(fakes, encoder_dir, tmp_path):
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    assert main(["probe", "fake", "--model", encoder_dir, "--out", str(tmp_path), "--quiet"]) == 0
    assert hf_logging.get_verbosity() == before


def test_step_lines_are_one_numbered_line_each(capsys):
    from attnkit.cli.probe import StepLines

    steps = StepLines("needle")
    steps("batch 1/2\n(8 prompts)")
    steps()
    StepLines("quiet", enabled=False)("nothing")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("needle 1 ") and lines[0].endswith("s batch 1/2 (8 prompts)")
    assert lines[1].startswith("needle 2 ")
