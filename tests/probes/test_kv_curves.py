"""kv-curves (accuracy against KV budget) and head-ablation on the needle-32 organism:
rows against the probes they are built from, the sweep engine's rows equal the serial
ones, failures recorded, bad input named."""

import math

import pytest

from attnkit.kv import POLICIES
from attnkit.probes import run
from attnkit.probes.kv_curves import kv_curves

GRID = dict(lengths=[32], depths=[0.0, 0.5, 1.0], samples=4)


@pytest.fixture(scope="module")
def curves(needle_export):
    return kv_curves(needle_export, policies=["streaming", "snapkv"], budgets=[0.25, 1.0], **GRID)


def test_rows_per_prompt_and_per_setting(curves):
    prompts = len(GRID["depths"]) * GRID["samples"]
    for policy, budget in (("full", 1.0), ("streaming", 0.25), ("streaming", 1.0), ("snapkv", 0.25), ("snapkv", 1.0)):
        rows = curves.select("exact_match", policy=policy, budget=budget)
        assert len(rows) == prompts and {r["sample"] for r in rows} == set(range(GRID["samples"]))
        for metric in ("kept", "kv_bytes", "decode_tokens_per_s", "seconds"):
            assert len(curves.select(metric, policy=policy, budget=budget)) == 1
    # one-token answers: the token score is the exact match
    for a, b in zip(curves.select("exact_match"), curves.select("token_accuracy")):
        assert a["value"] == b["value"]


def test_the_full_cache_scores_as_the_plain_needle_probe(curves, needle_export):
    plain = run("needle", needle_export, **GRID)
    for depth in GRID["depths"]:
        rows = curves.select("exact_match", policy="full", depth=depth)
        assert sum(r["value"] for r in rows) / len(rows) == plain.value("accuracy", length=32, depth=depth)


def test_budget_one_keeps_the_answers_of_the_full_cache(curves):
    full = [r["value"] for r in curves.select("exact_match", policy="full")]
    assert [r["value"] for r in curves.select("exact_match", policy="snapkv", budget=1.0)] == full
    assert curves.value("kept", policy="snapkv", budget=1.0) == 1.0
    assert curves.value("kv_bytes", policy="snapkv", budget=0.25) < curves.value("kv_bytes", policy="full", budget=1.0)
    assert curves.value("kept", policy="snapkv", budget=0.25) == pytest.approx(0.25, abs=0.05)


def test_a_failing_policy_is_recorded_and_the_run_goes_on(needle_export, monkeypatch):
    def broken(self, step):
        raise RuntimeError("broken on purpose")

    monkeypatch.setattr(POLICIES["knorm"], "select", broken)
    result = kv_curves(needle_export, policies=["knorm", "snapkv"], budgets=[0.5], lengths=[32], depths=[0.5], samples=2)
    assert result.value("error", policy="knorm", budget=0.5) == "RuntimeError: broken on purpose"
    assert result.meta["failures"] == [{"policy": "knorm", "budget": 0.5, "error": "RuntimeError: broken on purpose"}]
    assert len(result.select("exact_match", policy="snapkv")) == 2


@pytest.mark.slow
def test_the_local_engine_gives_the_serial_rows_and_resumes(needle_export, tmp_path):
    grid = dict(policies=["streaming"], budgets=[0.5], lengths=[32], depths=[0.0, 1.0], samples=2)
    serial = kv_curves(needle_export, **grid)
    swept = kv_curves(needle_export, engine="local", workers=2, store=str(tmp_path / "store"), **grid)
    timing = ("seconds", "decode_tokens_per_s")
    key = lambda r: (r["metric"], r["policy"], r["budget"], r.get("depth"), r.get("sample"))  # noqa: E731
    assert sorted(((key(r), r["value"]) for r in swept.rows if r["metric"] not in timing), key=str) == sorted(
        ((key(r), r["value"]) for r in serial.rows if r["metric"] not in timing), key=str
    )
    again = kv_curves(needle_export, engine="local", workers=2, store=str(tmp_path / "store"), **grid)
    assert [r for r in again.rows if r["metric"] == "seconds"] == [r for r in swept.rows if r["metric"] == "seconds"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(policies=["nope"]), "policies: unknown policy 'nope'"),
        (dict(policies=["selective"]), "policies: unknown policy 'selective'"),
        (dict(budgets=[0.0]), "budgets: expected fractions of the context in"),
        (dict(budgets=[1.5]), "budgets: expected fractions of the context in"),
        (dict(budgets=[0.01]), "budgets: 0.01 of a 30-token context keeps no entry"),
        (dict(protocol="both"), "protocol: expected one of agnostic, aware"),
        (dict(task="ruler"), "task: expected one of needle, kv-retrieval, ppl"),
        (dict(policy_params="snapkv.window"), "policy_params: expected POLICY.NAME=VALUE"),
        (dict(policies=["snapkv"], policy_params="h2o.recent=0.1"), "policy_params: 'h2o' is not among --policies"),
        (dict(engine="local"), "store: a sweep writes its cells"),
        (dict(store="x"), "store: only with --engine"),
    ],
)
def test_bad_input_names_the_keyword(needle_export, kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        kv_curves(needle_export, **{"lengths": [32], "samples": 1, **kwargs})


def test_a_model_trained_for_another_task_is_refused(induction_export):
    with pytest.raises(ValueError, match="^model: the kv-curves probe on an arena export needs a key-value task"):
        kv_curves(induction_export, task="kv-retrieval", samples=1)


def test_head_ablation_rows_heads_and_draws(needle_export):
    result = run(
        "head-ablation",
        needle_export,
        ablate=["top1-retrieval", "random2"],
        draws=3,
        samples=2,
        lengths=[32],
        depths=[0.0, 1.0],
        score_samples=8,
    )
    ranking = run("heads", needle_export, scores=["retrieval"], samples=8).meta["top"]["retrieval"]
    heads = result.meta["heads"]
    assert heads["none#0"] == [] and heads["top1-retrieval#0"] == [ranking[0]]
    draws = [heads[f"random2#{d}"] for d in range(3)]
    assert all(len(d) == 2 and len({tuple(h) for h in d}) == 2 for d in draws)
    assert draws == [result.meta["heads"][f"random2#{d}"] for d in range(3)]  # seeded: rerunning gives the same
    for ablation, draw in (("none", 0), ("top1-retrieval", 0), ("random2", 2)):
        rows = result.select("exact_match", ablation=ablation, draw=draw)
        assert len(rows) == 4
        assert result.value("accuracy", ablation=ablation, draw=draw) == pytest.approx(sum(r["value"] for r in rows) / 4)
    # every head zeroed leaves the model guessing: at most the 1 in 4 of picking one of the prompt's values
    every = run(
        "head-ablation",
        needle_export,
        ablate=["random8"],
        draws=1,
        samples=4,
        depths=[0.0, 0.5, 1.0],
        lengths=[32],
        score_samples=1,
    )
    assert every.value("accuracy", ablation="random8", draw=0) <= 0.5 < every.value("accuracy", ablation="none", draw=0)


@pytest.mark.parametrize(
    "ablate, message",
    [
        (["top2"], "ablate: expected topK-SCORE or randomK"),
        (["top2-nonsense"], "ablate: unknown score 'nonsense'"),
        (["random9"], "ablate: 'random9' ablates 9 heads; the model has 8"),
        ([], "ablate: expected at least one"),
        (["random1", "random1"], "ablate: specs repeat"),
    ],
)
def test_head_ablation_bad_specs(needle_export, ablate, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        run("head-ablation", needle_export, ablate=ablate, samples=1)


def test_kv_curves_from_the_command_line(needle_export, tmp_path):
    from attnkit.cli import main

    out = tmp_path / "curves"
    assert (
        main(
            [
                "kv",
                "curves",
                "--model",
                needle_export,
                "--policies",
                "snapkv",
                "--budgets",
                "0.5",
                "--lengths",
                "32",
                "--samples",
                "2",
                "--quiet",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert {"results.csv", "results.json", "report.html"} <= {p.name for p in out.iterdir()}
    html = (out / "report.html").read_text()
    assert "Accuracy (exact match) against KV budget per policy" in html and "(reference)" in html
    assert main(["kv", "curves", "--model", needle_export, "--budgets", "2"]) == 2


def test_probe_cells_are_the_probe_calls_of_a_grid(needle_export):
    from attnkit.probes.cells import probe_cells
    from attnkit.sweeps import cell_function

    cells = probe_cells("needle", needle_export, {"lengths": [[32], [64]], "samples": [2], "depths": [[0.5]]})
    assert len(cells) == 2 and len({c.hash for c in cells}) == 2
    rows = cell_function("probe")(cells[1].config)
    plain = run("needle", needle_export, lengths=[64], samples=2, depths=[0.5])
    assert [{k: v for k, v in r.items() if not k.startswith("param_")} for r in rows] == plain.rows
    assert {r["param_lengths"] for r in rows} == {"[64]"}
    with pytest.raises(ValueError, match="^grid: expected"):
        probe_cells("needle", needle_export, {"lengths": []})


def test_ppl_scores_the_teacher_forced_answer(needle_export):
    import torch

    from attnkit.probes.model import load_probe_model
    from attnkit.probes.needle import arena_items

    result = kv_curves(needle_export, task="ppl", policies=["snapkv"], budgets=[1.0], lengths=[32], depths=[0.5], samples=3)
    pm = load_probe_model(needle_export)
    items = arena_items(pm, [32], [0.5], 3, 0)
    with torch.no_grad():  # independent: the plain forward's log-probability of each answer token
        logits = pm.model(torch.tensor([it.ids for it in items])).logits[:, -1].double()
    want = [-float(torch.log_softmax(logits[i], -1)[it.answer_ids[0]]) for i, it in enumerate(items)]
    for policy in ("full", "snapkv"):
        got = [r["value"] for r in result.select("answer_nll", policy=policy)]
        assert got == pytest.approx(want, abs=1e-4)  # float32 model: decode and prefill round differently
    assert result.value("perplexity", policy="full", budget=1.0) == pytest.approx(math.exp(sum(want) / len(want)), rel=1e-4)
    assert not result.select("exact_match")
