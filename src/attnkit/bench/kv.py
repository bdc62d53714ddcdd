"""KV-cache policies on a tiny Llama at a long prompt: bytes, decode speed, prefill cost.

The subject is a tiny random Llama chosen so that attention over the cache is a real part
of a decoding step (4 layers, hidden 256, 8 query heads and 2 key-value heads of 32
dimensions, MLP 512, vocabulary 256; fp32, batch 1, transformers' ``sdpa``), reading an
N-token prompt (N = 8192). For every policy (``selective`` needs a model trained with
selective attention and is left out):

- bytes: keys and values the policy cache holds after the prefill at budgets 0.1, 0.25
  and 0.5 of the prompt, against ``DynamicCache`` after the same prefill (reported);
- decode: after one prefill each, ``DECODE_STEPS`` greedy decoding steps on the policy
  cache at budget 0.25 against the same steps on the full ``DynamicCache`` (same model,
  same prompt), interleaved blocks, medians (target: at least 1.5x the full cache's
  tokens/s, as each step attends to a quarter of the keys);
- floor: a ``DynamicCache`` holding only a quarter of the prompt, against the full one
  (reported): the speed-up of attending to a quarter of the keys with no policy at all,
  which bounds the decode rows;
- prefill: the prefill with the policy's scoring and compression (at budget 0.25)
  against a plain prefill into ``DynamicCache`` on sdpa (target: at most 1.2x). Policies
  that read attention weights stay on sdpa and the cache computes the scored rows'
  weights itself (kv/weights.py; on Llama-style modules, as here), or else run their
  prefill through ``attnkit.hf.use`` with an observer; one extra row times a plain
  prefill under ``attnkit.hf.use`` (no observer, no policy) against sdpa.

A prefill is a forward that returns the last position's logits only (as ``generate``
does). ``quick`` runs N=512 with fewer steps and repeats.

A second subject repeats the decode rows where the cache is a larger part of a step:
the same Llama with 8 key-value heads of 64 dimensions (hidden 512, MLP 1024; 16 times
the cache per token), closer to the cache a real model holds per token. On the first
subject a step's fixed costs (projections, MLP, the cache's own bookkeeping) are most of
it, which bounds what a quarter of the keys can give.
"""

from __future__ import annotations

from typing import Any

import torch

from .harness import Row, Step, run_steps, time_pair

LAYERS, D_MODEL, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 4, 256, 8, 2, 32, 512, 256
WIDE = {"hidden_size": 512, "intermediate_size": 1024, "num_key_value_heads": 8, "head_dim": 64}  # the second subject
BUDGETS = (0.1, 0.25, 0.5)
BUDGET = 0.25  # where decoding and prefill are timed
DECODE_STEPS = 16  # decoding steps per timed block
TARGET_DECODE = 1.5  # x the full cache's tokens/s
TARGET_PREFILL = 1.2  # x a plain sdpa prefill
POLICIES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("streaming", {}),
    ("h2o", {}),
    ("snapkv", {}),
    ("tova", {}),
    ("quest", {}),
    ("pyramid", {}),
    ("adakv", {}),
    ("knorm", {}),
)
STEPS = len(POLICIES) + 3


def tiny_llama(n: int, **sizes):
    """The subject, on transformers' sdpa attention (the policies' masks and the full
    cache's baseline go through the same kernel); ``sizes`` override its config."""
    import transformers as T

    torch.manual_seed(0)
    config = (
        dict(
            vocab_size=VOCAB,
            hidden_size=D_MODEL,
            intermediate_size=MLP,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            max_position_embeddings=max(2 * n, 256),
        )
        | sizes
    )
    return T.LlamaForCausalLM._from_config(T.LlamaConfig(**config), attn_implementation="sdpa").eval()


def prompt(n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def prefill(model, ids, cache):
    """One prefill into ``cache``; returns the greedy next token (1, 1)."""
    out = model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1:].argmax(-1)


@torch.no_grad()
def decode(model, cache, token, steps: int):
    """``steps`` greedy decoding steps on ``cache`` from ``token``; returns the last token."""
    for _ in range(steps):
        token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    return token


def full_bytes(cache) -> int:
    from ..kv.compare import dynamic_cache_bytes

    return dynamic_cache_bytes(cache)


def bytes_row(name: str, held: dict, full: int, n: int) -> Row:
    ratios = {b: held[b] / full for b in BUDGETS}
    note = ", ".join(f"{b}: {ratios[b]:.3f}x" for b in BUDGETS) + f" of {full / 2**20:.1f} MiB"
    return Row(
        "kv",
        f"{name}: keys+values held after prefill, budgets {'/'.join(map(str, BUDGETS))}",
        f"N={n}",
        None,
        "DynamicCache",
        None,
        "report",
        None,
        note,
        extra={
            "policy_bytes": {str(b): held[b] for b in BUDGETS},
            "full_bytes": full,
            "ratio": {str(b): ratios[b] for b in BUDGETS},
        },
    )


def measure(name: str, params: dict, n: int, repeats: int, decode_steps: int, decode_repeats: int, model=None) -> list[Row]:
    from transformers import DynamicCache

    from ..kv import POLICIES as KV_POLICIES
    from ..kv import policy_cache

    model = tiny_llama(n) if model is None else model
    ids = prompt(n)
    held, last = {}, {}
    for b in BUDGETS:
        if b != BUDGET:
            cache = policy_cache(model, name, budget=b, **params)
            prefill(model, ids, cache)
            held[b] = cache.kv_nbytes()

    def with_policy():
        cache = policy_cache(model, name, budget=BUDGET, **params)
        last["policy"] = (cache, prefill(model, ids, cache))

    def plain():
        cache = DynamicCache()
        last["full"] = (cache, prefill(model, ids, cache))

    pre_c, pre_b = time_pair(with_policy, plain, repeats=repeats, warmup=0)  # each call is a long prefill
    (pcache, ptok), (fcache, ftok) = last["policy"], last["full"]
    held[BUDGET] = pcache.kv_nbytes()
    full = full_bytes(fcache)
    state = {"policy": ptok, "full": ftok}

    def step_policy():
        state["policy"] = decode(model, pcache, state["policy"], decode_steps)

    def step_full():
        state["full"] = decode(model, fcache, state["full"], decode_steps)

    dec_c, dec_b = time_pair(step_policy, step_full, repeats=decode_repeats)
    speed = dec_b / dec_c
    weights = KV_POLICIES[name].needs_weights
    mean_len = sum(int(pcache.lengths(i).float().mean()) for i in range(LAYERS)) / LAYERS
    tokens_s = f"{decode_steps / dec_c * 1e3:.0f} vs {decode_steps / dec_b * 1e3:.0f} tokens/s, {speed:.2f}x"
    how = (
        "on sdpa"
        if not weights
        else "on sdpa, the scored rows' weights computed by the cache"
        if pcache.direct
        else "through attnkit with an observer"
    )
    return [
        bytes_row(name, held, full, n),
        Row(
            "kv",
            f"{name} at budget {BUDGET}: {decode_steps} decoding steps",
            f"N={n}",
            dec_c,
            "DynamicCache (sdpa)",
            dec_b,
            f">= {TARGET_DECODE}x tokens/s",
            speed >= TARGET_DECODE,
            f"{tokens_s}; about {mean_len:.0f} of {n} entries per head held"
            + ("; attends to its pages' tokens only" if name == "quest" else ""),
            extra={"tokens_per_s": decode_steps / dec_c * 1e3, "full_tokens_per_s": decode_steps / dec_b * 1e3, "speedup": speed},
        ),
        Row(
            "kv",
            f"{name} at budget {BUDGET}: prefill with scoring",
            f"N={n}",
            pre_c,
            "plain prefill, DynamicCache (sdpa)",
            pre_b,
            f"<= {TARGET_PREFILL}x",
            pre_c / pre_b <= TARGET_PREFILL,
            f"policy prefill {how}",
        ),
    ]


def attnkit_prefill_row(n: int, repeats: int, model=None) -> list[Row]:
    """A plain prefill (full cache, no observer) under ``attnkit.hf.use`` against sdpa:
    the share of the weight-reading policies' prefill that is attnkit's attention."""
    from transformers import DynamicCache

    import attnkit.hf as akhf

    model = tiny_llama(n) if model is None else model
    ids = prompt(n)

    def ours():
        with akhf.use(model):
            prefill(model, ids, DynamicCache())

    a, b = time_pair(ours, lambda: prefill(model, ids, DynamicCache()), repeats=repeats, warmup=0)
    return [
        Row(
            "kv",
            "plain prefill under attnkit.hf.use (no policy, no observer)",
            f"N={n}",
            a,
            "plain prefill, DynamicCache (sdpa)",
            b,
            "report",
            None,
            "the part of a weight-reading policy's prefill that is attnkit's attention, not scoring",
        )
    ]


def floor_row(n: int, decode_steps: int, decode_repeats: int, model=None) -> list[Row]:
    """The ceiling of the decode rows: a ``DynamicCache`` that holds only the budget's
    share of the prompt (its last ``BUDGET * n`` tokens, no policy at all) against the full
    one. A policy at that budget attends to as many keys, so its speed-up can only come
    near this one."""
    from transformers import DynamicCache

    model = tiny_llama(n) if model is None else model
    ids = prompt(n)
    short, full = DynamicCache(), DynamicCache()
    state = {"short": (short, prefill(model, ids[:, -int(BUDGET * n) :], short)), "full": (full, prefill(model, ids, full))}

    def step(key):
        cache, token = state[key]
        state[key] = (cache, decode(model, cache, token, decode_steps))

    dec_c, dec_b = time_pair(lambda: step("short"), lambda: step("full"), repeats=decode_repeats)
    speed = dec_b / dec_c
    return [
        Row(
            "kv",
            f"floor: a DynamicCache of {int(BUDGET * n)} tokens, {decode_steps} decoding steps",
            f"N={n}",
            dec_c,
            "DynamicCache (sdpa)",
            dec_b,
            "report",
            None,
            f"{speed:.2f}x: the most a policy keeping {BUDGET} of the prompt can give on this subject",
            extra={"speedup": speed},
        )
    ]


def wide_decode_rows(n: int, decode_steps: int, decode_repeats: int) -> list[Row]:
    """The decode rows again on the second subject (``WIDE``): one prefill per policy at
    budget ``BUDGET``, then each policy's blocks of steps interleaved with the full
    cache's."""
    from transformers import Cache, DynamicCache

    from ..kv import policy_cache

    model = tiny_llama(n, **WIDE)
    ids = prompt(n)
    full = DynamicCache()
    state: dict[str, tuple[Cache, Any]] = {"full": (full, prefill(model, ids, full))}
    rows = []
    for name, params in POLICIES:
        if full.get_seq_length() > n:  # every policy against the full cache of the prompt alone
            full.crop(n - full.get_seq_length())
        cache = policy_cache(model, name, budget=BUDGET, **params)
        state[name] = (cache, prefill(model, ids, cache))

        def step(key):
            cache, token = state[key]
            state[key] = (cache, decode(model, cache, token, decode_steps))

        dec_c, dec_b = time_pair(lambda: step(name), lambda: step("full"), repeats=decode_repeats)
        speed = dec_b / dec_c
        rows.append(
            Row(
                "kv",
                f"{name} at budget {BUDGET}: {decode_steps} decoding steps, 8 KV heads of 64",
                f"N={n}",
                dec_c,
                "DynamicCache (sdpa)",
                dec_b,
                f">= {TARGET_DECODE}x tokens/s",
                speed >= TARGET_DECODE,
                f"{decode_steps / dec_c * 1e3:.0f} vs {decode_steps / dec_b * 1e3:.0f} tokens/s, {speed:.2f}x",
                extra={"speedup": speed},
            )
        )
        del state[name]
    return rows


def run(quick: bool = False, progress=None) -> list[Row]:
    n, repeats, decode_steps, decode_repeats = (512, 2, 4, 3) if quick else (8192, 3, DECODE_STEPS, 9)
    model = tiny_llama(n)
    steps: list[Step] = [
        (name, lambda name=name, params=params: measure(name, params, n, repeats, decode_steps, decode_repeats, model))
        for name, params in POLICIES
    ]
    steps.append(("attnkit prefill", lambda: attnkit_prefill_row(n, repeats, model)))
    steps.append(("floor", lambda: floor_row(n, decode_steps, decode_repeats, model)))
    steps.append(("8 KV heads of 64: decoding", lambda: wide_decode_rows(n, decode_steps, max(3, decode_repeats - 2))))
    return run_steps(steps, progress)
