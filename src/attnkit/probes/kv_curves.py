"""Quality against KV budget: a retrieval task answered through every policy at every
budget, beside the full cache (kvpress's leaderboard view, accuracy against the kept
fraction per policy; the protocols are ``attnkit.kv.protocol``'s).

The task's prompts are the needle or kv-retrieval probe's (the task's own tokens on an
arena export or organism, natural language otherwise), drawn once and answered once with
the full cache and once per policy × budget, each through the same protocol. Multi-token
answers are scored as exact match (every token, the probes' string match) and token by
token.

Rows, one per prompt (tidy; ``policy`` is ``full`` for the full cache, at budget 1.0):
``exact_match`` and ``token_accuracy`` per (policy, budget, length, depth, sample) for
the needle task or (policy, budget, pairs, position, sample) for kv-retrieval
(``answer_nll`` instead for ``ppl``, with ``perplexity`` per setting, the exp of its mean); per
(policy, budget): ``kept`` (entries held over a full cache's, mean over layers, heads and
prompts), ``kv_bytes`` (keys and values held per prompt at the end), ``decode_tokens_per_s``
(decoding steps per second, question and answer tokens, batch rows counted) and, when a
policy fails, one ``error`` row with the message (the run goes on).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from .result import ProbeResult
from .retrieval import check_fractions, check_run, examples, run_items
from .tasks import task_items

#: the policies a curve runs by default: every one that needs no trained mechanism
DEFAULT_POLICIES = ("streaming", "h2o", "snapkv", "tova", "pyramid", "adakv", "knorm", "quest")
DEFAULT_BUDGETS = (0.05, 0.1, 0.25, 0.5)
#: the tasks a curve runs: the needle and kv-retrieval probes' prompts scored by their greedy answers,
#: and ``ppl``: the needle prompts scored by the answer's likelihood, teacher-forced
CURVE_TASKS = ("needle", "kv-retrieval", "ppl")


def prompts_of(task: str) -> str:
    return "needle" if task == "ppl" else task


def kv_curves(
    model=None,
    tokenizer=None,
    *,
    task: str = "needle",
    policies: Sequence[str] = DEFAULT_POLICIES,
    budgets: Sequence[float] = DEFAULT_BUDGETS,
    protocol: str = "agnostic",
    lengths: list[int] | None = None,
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    pairs: list[int] | None = None,
    samples: int = 20,
    seed: int = 0,
    batch_size: int = 32,
    policy_params: dict | None = None,
    engine: str | None = None,
    workers: int | None = None,
    address: str | None = None,
    store: str | None = None,
    progress=None,
) -> ProbeResult:
    """Accuracy against KV budget per policy (see the module docstring).

    Args:
        task: ``needle`` (accuracy by length and depth), ``kv-retrieval`` (by the gold pair's position) or
            ``ppl`` (the needle prompts, each answer teacher-forced and scored by its negative
            log-likelihood: how much probability a policy leaves on the right answer)
        policies: KV-cache policies (attnkit.kv.POLICIES; not ``selective``, which needs a trained mechanism)
        budgets: fractions of the context kept, each in (0, 1]
        protocol: ``agnostic`` (the context compressed before the question arrives) or ``aware``
            (the question prefilled and compressed with it, then asked again)
        lengths: prompt lengths (needle; default the model's own, an organism's trained length for kv-retrieval)
        depths: where the needle or the gold pair sits, fractions 0..1
        pairs: key-value pairs per prompt (kv-retrieval)
        samples: prompts per cell
        seed: the same seed gives the same prompts
        batch_size: prompts per forward pass
        policy_params: per policy, its parameters: ``{"snapkv": {"window": 8}}`` or ``snapkv.window=8,pyramid.beta=2``
        engine: ``local`` or ``ray``: each policy × budget (and the full cache) becomes a sweep cell
            (``attnkit.sweeps``) run by that engine into ``store``, which a second run resumes; default:
            every setting in this process
        workers: the local engine's worker processes (default 2), or the CPUs a local Ray instance gets
        address: a Ray cluster to join (``auto``, ``host:port``; default: a local instance)
        store: the sweep's results directory (needed with ``engine``)"""
    from ..kv.protocol import FULL, PROTOCOLS, KVSetting

    start = time.perf_counter()
    pm, samples, seed, batch_size, say, _ = check_run(model, tokenizer, "kv-curves", samples, seed, batch_size, progress, None)
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol: expected one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    policies = _names(policies)
    budgets = _budgets(budgets)
    depths = check_fractions(depths, "depths")
    policy_params = _policy_params(policy_params, policies)
    settings = [KVSetting(FULL, 1.0, (), protocol)]
    for name in policies:
        for budget in budgets:
            try:
                settings.append(KVSetting(name, budget, tuple(sorted(policy_params.get(name, {}).items())), protocol))
            except ValueError as e:
                keyword = "policies" if str(e).startswith("policy:") else "policy_params"
                raise ValueError(f"{keyword}: {name}: {e}") from None
    if task not in CURVE_TASKS:
        raise ValueError(f"task: expected one of {', '.join(CURVE_TASKS)}, got {task!r}")
    items, keys, new_tokens = task_items(pm, prompts_of(task), lengths, depths, pairs, samples, seed)
    shortest = min(len(it.ids) - it.question for it in items)
    if min(budgets) * shortest < 1:
        raise ValueError(f"budgets: {min(budgets)} of a {shortest}-token context keeps no entry")

    result = ProbeResult("kv-curves")
    if engine is None:
        if workers is not None or address is not None or store is not None:
            raise ValueError(
                f"{'workers' if workers is not None else 'address' if address is not None else 'store'}: "
                "only with --engine local or ray"
            )
        full_examples = None
        for n, setting in enumerate(settings, 1):
            say(f"kv-curves: {n}/{len(settings)} {setting.label} ({len(items)} prompts)")
            rows, found = setting_rows(pm, items, keys, setting, new_tokens, batch_size, task == "ppl")
            result.rows += rows
            full_examples = full_examples if found is None else found
    else:
        full_examples = None
        result.rows += _swept(
            model,
            tokenizer,
            engine,
            workers,
            address,
            store,
            settings,
            say,
            dict(task=task, lengths=lengths, depths=depths, pairs=pairs, samples=samples, seed=seed, batch_size=batch_size),
        )
    failures = [{k: r[k] for k in ("policy", "budget")} | {"error": r["value"]} for r in result.rows if r["metric"] == "error"]
    x = "position" if task == "kv-retrieval" else "depth"
    metric, y_title = (
        ("answer_nll", "the answer's negative log-likelihood (nats per token)")
        if task == "ppl"
        else ("exact_match", "accuracy (exact match)")
    )
    result.meta = {
        "model": pm.name,
        "seconds": time.perf_counter() - start,
        "max_new_tokens": new_tokens,
        "params": {
            "task": task,
            "policies": policies,
            "budgets": budgets,
            "protocol": protocol,
            "lengths": lengths,
            "depths": depths,
            "pairs": pairs,
            "samples": samples,
            "seed": seed,
            "batch_size": batch_size,
            "policy_params": policy_params,
        },
        "failures": failures,
        "examples": full_examples or [],
        "engine": engine,
        "figures": [
            {
                "kind": "curve",
                "x": "budget",
                "metric": metric,
                "series": "policy",
                "spread": "sample",
                "reference": {"policy": FULL},
                "x_title": "budget (fraction of the context kept)",
                "y_title": y_title,
                "title": f"{y_title[0].upper() + y_title[1:]} against KV budget per policy ({protocol} protocol; "
                "dashed: the full cache)",
            },
            {
                "kind": "curve",
                "x": x,
                "metric": metric,
                "series": "policy",
                "split": "budget",
                "spread": "sample",
                "reference": {"policy": FULL},
                "x_title": x,
                "y_title": y_title,
                "title": f"{y_title[0].upper() + y_title[1:]} by {x} per policy at each budget",
            },
            {
                "kind": "curve",
                "x": "budget",
                "metric": "kv_bytes",
                "series": "policy",
                "x_title": "budget",
                "y_title": "bytes of keys and values per prompt",
                "title": "Bytes held per prompt",
            },
            {
                "kind": "curve",
                "x": "budget",
                "metric": "decode_tokens_per_s",
                "series": "policy",
                "x_title": "budget",
                "y_title": "decoding steps per second",
                "title": "Decoding speed (question and answer tokens)",
            },
        ],
    }
    return result


def setting_rows(
    pm, items, keys, setting, new_tokens: int, batch_size: int, forced: bool = False
) -> tuple[list[dict], list | None]:
    """The rows of one setting (every prompt, then the setting's summary), and the full
    cache's examples (None for a policy). A policy that fails gives one ``error`` row.
    ``forced``: the answers teacher-forced and scored by their likelihood (task ``ppl``)."""
    from ..kv.protocol import FULL

    part = ProbeResult("kv-curves")
    where = {"policy": setting.policy, "budget": setting.budget}
    stats: list = []
    began = time.perf_counter()
    try:
        outcomes, _ = run_items(
            pm, items, new_tokens, batch_size, lambda line: None, "kv-curves", kv=setting, stats=stats, forced=forced
        )
    except Exception as e:  # one policy's failure is recorded in its rows; the others still run
        part.add("error", f"{type(e).__name__}: {e}", **where)
        return part.rows, None
    for o in outcomes:
        cell = {k: o.item.params[k] for k in keys}
        if forced:
            part.add("answer_nll", o.nll, **where, **cell, sample=o.item.params["sample"])
            continue
        part.add("exact_match", o.score, **where, **cell, sample=o.item.params["sample"])
        part.add("token_accuracy", o.token_accuracy(), **where, **cell, sample=o.item.params["sample"])
    if forced:
        part.add("perplexity", math.exp(sum(o.nll for o in outcomes) / len(outcomes)), **where)
    rows = sum(a.tokens.shape[0] for a in stats)
    part.add("kept", sum(a.kept * a.tokens.shape[0] for a in stats) / rows, **where)
    part.add("kv_bytes", sum(a.kv_bytes for a in stats) / rows, **where)
    steps = sum(a.decode_steps * a.tokens.shape[0] for a in stats)
    seconds = sum(a.decode_seconds for a in stats)
    part.add("decode_tokens_per_s", steps / seconds if seconds > 0 else math.nan, **where)
    part.add("seconds", time.perf_counter() - began, **where)
    return part.rows, examples(outcomes) if setting.policy == FULL else None


def kv_curve_cell(config: dict) -> list[dict]:
    """The sweep cell kind ``kv_curve``: one setting of a curve, its prompts rebuilt from
    the config (the same seed, the same prompts on any node)."""
    from ..kv.protocol import KVSetting
    from ..sweeps import report_line
    from .model import load_probe_model

    pm = load_probe_model(config["model"])
    items, keys, new_tokens = task_items(
        pm, prompts_of(config["task"]), config["lengths"], config["depths"], config["pairs"], config["samples"], config["seed"]
    )
    s = config["setting"]
    setting = KVSetting(s["policy"], s["budget"], tuple((k, v) for k, v in s["params"]), s["protocol"])
    report_line(f"{setting.label} ({len(items)} prompts)")
    rows, _ = setting_rows(pm, items, keys, setting, new_tokens, config["batch_size"], config["task"] == "ppl")
    return rows


def _swept(model, tokenizer, engine, workers, address, store, settings, say, grid) -> list[dict]:
    """The settings as sweep cells (one per setting) through ``engine`` into ``store``."""
    import os

    from ..sweeps import Cell, load, run_sweep
    from ..sweeps.engines import engine_named

    if not isinstance(model, (str, os.PathLike)) or tokenizer is not None:
        raise ValueError("model: a sweep's workers load the model themselves: give a directory or an organism name")
    if store is None:
        raise ValueError("store: a sweep writes its cells into a results directory; give one")
    runner = engine_named(engine, workers, address)
    cells = [
        Cell(
            "kv_curve",
            {
                "model": os.fspath(model),
                **grid,
                "setting": {
                    "policy": s.policy,
                    "budget": s.budget,
                    "params": [list(p) for p in s.params],
                    "protocol": s.protocol,
                },
            },
            label=s.label,
        )
        for s in settings
    ]
    say(f"kv-curves: {len(cells)} cells on the {engine} engine into {store}")
    run_sweep(cells, os.fspath(store), runner, on_status=lambda status: say(f"kv-curves: {status.line()}"))
    wanted = {c.hash for c in cells}
    return [{k: v for k, v in row.items() if k != "cell"} for row in load(os.fspath(store)) if row.get("cell") in wanted]


def _names(policies) -> list[str]:
    from ..kv import POLICIES

    if isinstance(policies, str):
        policies = [p for p in policies.split(",") if p]
    policies = list(policies or ())
    if not policies:
        raise ValueError("policies: expected at least one policy")
    for name in policies:
        if name not in POLICIES or POLICIES[name].needs_mechanism is not None:
            offered = [n for n, p in POLICIES.items() if p.needs_mechanism is None]
            raise ValueError(f"policies: unknown policy {name!r}; expected some of {', '.join(offered)}")
    if len(set(policies)) != len(policies):
        raise ValueError(f"policies: policies repeat in {policies}")
    return policies


def _budgets(budgets) -> list[float]:
    try:
        out = check_fractions(budgets, "budgets")
    except ValueError:
        out = [-1.0]
    if any(b <= 0 for b in out):
        raise ValueError(f"budgets: expected fractions of the context in (0, 1], e.g. 0.1,0.25, got {budgets!r}")
    return sorted(out)


def _policy_params(params, policies) -> dict:
    """``{policy: {name: value}}``, or its text ``snapkv.window=8,pyramid.beta=2``."""
    if params is None:
        return {}
    if isinstance(params, str):
        from ..kv.protocol import parameter_value

        parsed: dict = {}
        for part in filter(None, params.split(",")):
            key, sep, value = part.partition("=")
            policy, dot, name = key.partition(".")
            if not sep or not dot or not policy or not name:
                raise ValueError(f"policy_params: expected POLICY.NAME=VALUE[,...], got {part!r}")
            parsed.setdefault(policy, {})[name] = parameter_value(value)
        params = parsed
    if not isinstance(params, dict) or not all(isinstance(v, dict) for v in params.values()):
        raise ValueError("policy_params: expected {policy: {name: value}}, e.g. {'snapkv': {'window': 8}}")
    stray = sorted(set(params) - set(policies))
    if stray:
        raise ValueError(f"policy_params: {stray[0]!r} is not among --policies")
    return {k: dict(v) for k, v in params.items()}


__all__ = ["DEFAULT_BUDGETS", "DEFAULT_POLICIES", "kv_curves"]
