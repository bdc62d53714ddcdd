"""``attnkit probe NAME --steer SPEC``: the plain and the steered run in one result with a
``steered`` column, each equal to the probe run from Python (plain, and inside
``steer.apply``); PASTA on the probe's own needle span checked against PASTA's formula on
the first layer; head sets from ``attnkit probe heads``; bad specs name --steer."""

import json

import pytest

from attnkit import probes, steer
from attnkit.cli import main

NEEDLE = ["--lengths", "32", "--depths", "0,1", "--samples", "1", "--quiet"]


def rows_of(path):
    return json.loads((path / "results.json").read_text())


def strip(rows, steered):
    return [{k: v for k, v in r.items() if k != "steered"} for r in rows if r["steered"] == steered]


def test_ablation_rows_equal_the_python_runs(needle_export, tmp_path):
    out = tmp_path / "run"
    assert main(["probe", "needle", "--model", needle_export, *NEEDLE, "--out", str(out), "--steer", "ablate:heads=0.0,0.1"]) == 0
    data = rows_of(out)
    assert {r["steered"] for r in data["rows"]} == {"none", "ablate:heads=0.0,0.1"}
    assert "steered" in data["columns"]
    pm = probes.load_probe_model(needle_export)
    plain = probes.run("needle", pm, lengths=[32], depths=[0.0, 1.0], samples=1)
    with steer.apply(pm.model, steer.ablate([(0, 0), (0, 1)])):
        steered = probes.run("needle", pm, lengths=[32], depths=[0.0, 1.0], samples=1)
    assert strip(data["rows"], "none") == plain.rows
    assert strip(data["rows"], "ablate:heads=0.0,0.1") == steered.rows
    assert data["meta"]["steer"]["interventions"] == ["ablate([(0, 0), (0, 1)], mode='zero')"]
    assert (out / "report.html").is_file()


def test_emphasis_follows_the_probe_needle_span(needle_export, tmp_path):
    """On layer 0 the inputs are unsteered, so PASTA's formula gives the steered mass on
    the span from the plain one exactly: m / (m + alpha (1 - m)) — true only if the
    emphasis reads the very span the probe measures. The arena probe reads one answer
    row per prompt, so each row of needle_mass (one sample) is one query row's mass."""
    out = tmp_path / "run"
    alpha = 0.05
    spec = f"emphasize:span=needle:alpha={alpha}:heads=all"
    assert main(["probe", "needle", "--model", needle_export, *NEEDLE, "--out", str(out), "--steer", spec]) == 0
    rows = rows_of(out)["rows"]
    plain = {
        (r["depth"], r["head"]): r["value"]
        for r in rows
        if r["metric"] == "needle_mass" and r["layer"] == 0 and r["steered"] == "none"
    }
    steered = {
        (r["depth"], r["head"]): r["value"]
        for r in rows
        if r["metric"] == "needle_mass" and r["layer"] == 0 and r["steered"] == spec
    }
    heads = probes.load_probe_model(needle_export).heads
    assert len(plain) == 2 * heads and plain.keys() == steered.keys()  # 2 depths x the first layer's heads
    for key, m in plain.items():
        assert steered[key] == pytest.approx(m / (m + alpha * (1 - m)), rel=1e-5), key
        assert steered[key] > m
    # alpha = 1 changes nothing
    out1 = tmp_path / "alpha1"
    assert (
        main(
            [
                "probe",
                "needle",
                "--model",
                needle_export,
                *NEEDLE,
                "--out",
                str(out1),
                "--steer",
                "emphasize:span=needle:alpha=1:heads=all",
            ]
        )
        == 0
    )
    rows = rows_of(out1)["rows"]
    assert strip(rows, "none") == strip(rows, "emphasize:span=needle:alpha=1:heads=all")


def test_head_sets_from_the_heads_probe(needle_export, tmp_path):
    from attnkit.probes.heads import save_head_set

    heads_dir = tmp_path / "heads"
    assert (
        main(
            [
                "probe",
                "heads",
                "--model",
                needle_export,
                "--scores",
                "retrieval",
                "--top",
                "2",
                "--quiet",
                "--out",
                str(heads_dir),
            ]
        )
        == 0
    )
    result = probes.ProbeResult.from_json(str(heads_dir / "results.json"))
    head_set = tmp_path / "set.json"
    save_head_set(result, head_set, "retrieval", 2)
    outs = {}
    for name, heads in [
        ("fly", "top2-retrieval"),
        ("file", f"top2-retrieval@{heads_dir / 'results.json'}"),
        ("set", str(head_set)),
    ]:
        outs[name] = tmp_path / name
        assert (
            main(
                [
                    "probe",
                    "needle",
                    "--model",
                    needle_export,
                    *NEEDLE,
                    "--out",
                    str(outs[name]),
                    "--steer",
                    f"ablate:heads={heads}",
                ]
            )
            == 0
        )
    chosen = [rows_of(p)["meta"]["steer"]["heads"] for p in outs.values()]
    assert chosen[0] == chosen[1] == chosen[2]
    want = {}
    for layer, head in result.meta["top"]["retrieval"]:
        want.setdefault(str(layer), []).append(head)
    assert chosen[0] == [{k: sorted(v) for k, v in want.items()}]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("bogus:heads=all", "--steer: unknown intervention 'bogus'"),
        ("ablate:heads=9.0", "--steer: heads: expected a layer index below 2, got 9"),
        ("emphasize:alpha=0.1", "--steer: emphasize needs span=..."),
        ("emphasize:span=needle:alpha=3", "--steer: alpha: expected a number in (0, 1]"),
        ("ablate:heads=top2-nope", "--steer: heads=top2-nope: unknown score 'nope'"),
        ("ablate:heads=top0-retrieval", "--steer: heads=top0-retrieval: K must be >= 1"),
        ("ablate:heads=some/missing.json", "--steer: heads='some/missing.json' is not all, layer.head pairs"),
        ("emphasize:span=haystack", "--steer: span=haystack: this probe measures no span of that name (it measures: needle#0)"),
        ("scale:heads=all:factor=x", "--steer: factor='x' is not a finite number"),
        ("ablate:mode=mean", "--steer: ablate takes heads; got 'mode'"),
        ("ablate:heads", "--steer: expected key=value after ablate:"),
    ],
)
def test_bad_specs_are_one_line_naming_steer(needle_export, tmp_path, capsys, spec, message):
    assert main(["probe", "needle", "--model", needle_export, *NEEDLE, "--out", str(tmp_path / "x"), "--steer", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnkit probe: error: --steer: ") and message in err, err
