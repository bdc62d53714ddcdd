"""``attnkit kv MODEL --policy NAME --budget B``: generate with a KV-cache policy beside
the full cache, and print both continuations, where they part, and the bytes each
cache holds."""

from __future__ import annotations

import json

from .options import options_named, positive_int


def add_parser(sub) -> None:
    from ..kv import POLICIES

    p = sub.add_parser("kv", help="generate with a KV-cache policy (StreamingLLM, H2O, SnapKV, ...) beside the full cache",
                       description="Greedy generation from a local causal LM with a KV-cache policy and with the full "
                                   "cache: both continuations, the first token where they differ, the entries kept and "
                                   "the bytes each cache holds.",
                       epilog=f"policies: {', '.join(POLICIES)}")
    p.add_argument("model", metavar="MODEL", help="a local transformers causal LM directory (arena exports included)")
    p.add_argument("--policy", required=True, choices=list(POLICIES), help="the policy")
    p.add_argument("--budget", default="0.5", help="a fraction of the prompt in (0, 1] (0.5) or a token count (64); default 0.5")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="a policy parameter, e.g. window=8 (repeatable)")
    p.add_argument("--prompt", help="the prompt text (default: an arena export's example)")
    p.add_argument("--max-new-tokens", type=positive_int, default=16, help="tokens to generate (default 16)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def _number(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _budget(text: str):
    value = _number(text)
    if isinstance(value, str):
        raise ValueError(f"--budget: expected a fraction in (0, 1] or a token count, got {text!r}")
    return value


def _params(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--param: expected KEY=VALUE, got {item!r}")
        out[key] = _number(value)
    return out


def run(args) -> int:
    from ..kv import compare
    from ..probes.model import load_probe_model

    from ..kv import POLICIES
    from ..kv.budget import check_budget

    budget = _budget(args.budget)
    params = _params(args.param)
    names = {"budget": "--budget", "policy": "--policy", "model": "MODEL", "max_new_tokens": "--max-new-tokens",
             **{k: f"--param {k}" for k in params}}
    with options_named(names):  # every option checked before the model loads
        check_budget(budget)
        POLICIES[args.policy](**params)
    pm = load_probe_model(args.model, kind="causal")
    prompt = args.prompt
    if prompt is None:
        example = (pm.task or {}).get("example", {}).get("text")
        if example is None:
            raise ValueError("--prompt: this model is not an arena export with an example; give a prompt")
        prompt = example
    encoded = pm.tokenizer([prompt], return_tensors="pt")
    with options_named(names):
        result = compare(pm.model, encoded["input_ids"], encoded.get("attention_mask"), policy=args.policy, budget=budget,
                         max_new_tokens=args.max_new_tokens, **params)
    result["model"] = pm.name
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    decode = lambda ids: pm.tokenizer.decode(ids)  # noqa: E731
    print(f"{result['policy']} at budget {budget} on {pm.name}")
    print(f"  full cache : {decode(result['full'][0])}")
    print(f"  policy     : {decode(result['pruned'][0])}")
    first = result["first_difference"][0]
    print(f"  first difference: {'none' if first is None else f'new token {first}'}")
    kept = ", ".join(f"{k:.1f}" for k in result["kept"])
    print(f"  entries kept per KV head, by layer: {kept}")
    print(f"  keys+values held: {result['policy_bytes']} bytes (full cache {result['full_bytes']}; "
          f"{result['policy_bytes'] / max(result['full_bytes'], 1):.2f}x); with bookkeeping {result['policy_bytes_all']}")
    return 0
