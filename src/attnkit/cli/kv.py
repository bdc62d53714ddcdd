"""``attnkit kv MODEL --policy NAME [--budget FRACTION | --tokens N]``: generate with a
KV-cache policy beside the full cache, and print both continuations, where they part,
and the bytes each cache holds. The two forms of a budget are two options, so that a
number never means a fraction in one place and a count in another.

``attnkit kv curves --model M --policies ... --budgets ... [--task needle|kv-retrieval]
[--protocol agnostic|aware] ...``: accuracy against KV budget per policy
(``attnkit.probes.kv_curves``), written as the probes write (results.csv,
results.json, report.html); its options are that function's keywords."""

from __future__ import annotations

import argparse
import json
import math

from .options import Parser, options_named, positive_int


def offered_policies() -> list[str]:
    """The policies this command can run: those that need no attnkit mechanism switched
    on (``selective`` needs a model trained with selective attention, run inside
    ``attnkit.hf.use(model, mechanism="selective")``: a Python call)."""
    from ..kv import POLICIES

    return [name for name, policy in POLICIES.items() if policy.needs_mechanism is None]


def add_parser(sub) -> None:
    offered = offered_policies()  # without the [hf] extra this fails, and the CLI lists kv as unavailable
    p = sub.add_parser(
        "kv",
        help="generate with a KV-cache policy (StreamingLLM, H2O, SnapKV, ...) beside the full cache; "
        "'kv curves': accuracy against budget per policy",
        usage="attnkit kv MODEL --policy NAME [options] | attnkit kv curves --model M [options]",
        description="attnkit kv MODEL --policy NAME: greedy generation from a local causal LM with a "
        "KV-cache policy and with the full cache: both continuations, the first token where "
        "they differ, the entries kept and the bytes each cache holds. attnkit kv curves: a "
        "retrieval task answered through every policy at every budget beside the full cache, "
        "written as results.csv, results.json and report.html.",
        epilog=f"policies: {', '.join(offered)}. attnkit kv MODEL --help and attnkit kv curves --help list each form's options",
    )
    p.add_argument("model", metavar="MODEL", help="a local transformers causal LM directory or organism name, or 'curves'")
    p.add_argument("options", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def generate_parser() -> argparse.ArgumentParser:
    """The options of ``attnkit kv MODEL``."""
    offered = offered_policies()
    p = Parser(
        prog="attnkit kv MODEL",
        description="Greedy generation with a KV-cache policy beside the full cache.",
        epilog=f"policies: {', '.join(offered)} (selective, for models trained with selective attention, "
        "runs from Python inside attnkit.hf.use(model, mechanism='selective'))",
    )
    p.add_argument("--policy", required=True, choices=offered, help="the policy")
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--budget",
        type=fraction,
        metavar="FRACTION",
        help="entries kept as a fraction of the prompt, in (0, 1] (1 keeps the whole prompt); default 0.5",
    )
    size.add_argument("--tokens", type=positive_int, metavar="N", help="entries kept as a token count instead, e.g. 64")
    p.add_argument(
        "--param", action="append", default=[], metavar="KEY=VALUE", help="a policy parameter, e.g. window=8 (repeatable)"
    )
    p.add_argument("--prompt", help="the prompt text (default: an arena export's example)")
    p.add_argument("--max-new-tokens", type=positive_int, default=16, help="tokens to generate (default 16)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def fraction(text: str) -> float:
    """--budget: a fraction of the prompt in (0, 1]; a count above 1 belongs to --tokens."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction of the prompt in (0, 1], got {text!r}") from None
    if math.isfinite(value) and value > 1 and value == int(value):
        raise argparse.ArgumentTypeError(
            f"expected a fraction of the prompt in (0, 1], got {text!r}; for a count of tokens use --tokens {int(value)}"
        )
    if not (math.isfinite(value) and 0 < value <= 1):
        raise argparse.ArgumentTypeError(f"expected a fraction of the prompt in (0, 1], got {text!r}")
    return value


def _params(items: list[str]) -> dict:
    from ..kv.protocol import parameter_value

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--param: expected KEY=VALUE, got {item!r}")
        out[key] = parameter_value(value)
    return out


def run(args) -> int:
    if args.model == "curves":
        from . import probe  # the kv-curves probe through the probe command: its options read off kv_curves

        return probe.run(argparse.Namespace(name="kv-curves", options=list(args.options), command="kv"))
    try:
        options = generate_parser().parse_args(args.options)
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    options.model = args.model
    return generate(options)


def generate(args) -> int:
    from ..kv import POLICIES, compare
    from ..kv.budget import check_budget
    from ..probes.model import load_probe_model

    budget = args.tokens if args.tokens is not None else (0.5 if args.budget is None else args.budget)
    params = _params(args.param)
    names = {
        "budget": "--tokens" if args.tokens is not None else "--budget",
        "policy": "--policy",
        "model": "MODEL",
        "--model": "MODEL",
        "max_new_tokens": "--max-new-tokens",
        **{k: f"--param {k}" for k in params},
    }
    with options_named(names):  # every option checked before the model loads
        check_budget(budget)
        POLICIES[args.policy](**params)
        pm = load_probe_model(args.model)  # an encoder loads as one, not as a causal LM with a random head
        pm.require("causal", "kv")
    prompt = args.prompt
    if prompt is None:
        example = (pm.task or {}).get("example", {}).get("text")
        if example is None:
            raise ValueError("--prompt: this model is not an arena export with an example; give a prompt")
        prompt = example
    encoded = pm.tokenizer([prompt], return_tensors="pt")
    with options_named(names):
        result = compare(
            pm.model,
            encoded["input_ids"],
            encoded.get("attention_mask"),
            policy=args.policy,
            budget=budget,
            max_new_tokens=args.max_new_tokens,
            **params,
        )
    result["model"] = pm.name
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    decode = lambda ids: pm.tokenizer.decode(ids)  # noqa: E731
    kept = f"{budget} tokens" if args.tokens is not None else f"budget {budget} of the prompt"
    print(f"{result['policy']} keeping {kept} on {pm.name}")
    print(f"  full cache : {decode(result['full'][0])}")
    print(f"  policy     : {decode(result['pruned'][0])}")
    first = result["first_difference"][0]
    print(f"  first difference: {'none' if first is None else f'new token {first}'}")
    kept = ", ".join(f"{k:.1f}" for k in result["kept"])
    print(f"  entries kept per KV head, by layer: {kept}")
    print(
        f"  keys+values held: {result['policy_bytes']} bytes (full cache {result['full_bytes']}; "
        f"{result['policy_bytes'] / max(result['full_bytes'], 1):.2f}x); with bookkeeping {result['policy_bytes_all']}"
    )
    return 0
