"""Steering and re-ranking: what an intervention adds to a forward pass, what a re-rank
costs against one forward of the same prompt, and peak memory at long context against
PASTA's eager approach.

The subject is the probes suite's tiny random Llama (2 layers, hidden 64, 4 query heads,
2 key-value heads) reading the bundled all-MiniLM-L6-v2 tokenizer's vocabulary; its
weights are random: cost is measured here, not quality.

- forward: one forward at N tokens through ``attnkit.steer.apply`` with emphasize
  (PASTA, every head, a span of N/8 tokens), ablate (half the heads) or temperature
  (half the heads, t = 2), against the same forward through ``attnkit.hf.use`` without
  an intervention; interleaved medians, target <= 1.1x.
- rerank: ``steer.rerank`` of 20 natural-language documents (icr: one prefill and two
  query-row passes; sorting: two rounds of prefill and one query row; basin: as icr)
  against one plain forward of the same prompt (documents and query) on transformers'
  sdpa, last position's logits only (as the re-rank computes); target <= 2.5x for icr.
- memory: peak RSS growth in a fresh subprocess (``harness.peak_rss_growth``) of an
  emphasize forward and an icr re-rank at 16k tokens, under an address-space cap, and
  the eager forward that PASTA's head steering runs on (transformers' eager attention,
  which with ``output_attentions`` holds L x H x N^2 float32 weights: 8 GiB at 16k for
  this model), run under the same cap.

``quick`` times N = 256 and 20 documents of 12 tokens, and skips the memory subprocesses
(seconds: for smoke runs and tests).
"""

from __future__ import annotations

import functools

import torch

from .harness import Row, peak_rss_growth, run_steps, time_pair

STEPS = 4
DOCUMENTS = 20
MEMORY_CAP_GB = 8
TARGET_FORWARD = 1.1
TARGET_RERANK = 2.5
TARGET_MEMORY_GB = 2
QUERY = "Which sentence says where we go?"


def subject():
    """The probes suite's tiny Llama as a ProbeModel."""
    from .probes import tiny_probe_model

    return tiny_probe_model()


def interventions(n: int, heads: int) -> dict:
    from .. import steer

    half = {layer: list(range(heads // 2)) for layer in range(2)}
    return {
        "emphasize": steer.emphasize([(n // 4, n // 4 + n // 8)], "all", 0.01),
        "ablate": steer.ablate(half),
        "temperature": steer.temperature(half, 2.0),
    }


def forward_cases(n: int, repeats: int) -> list[Row]:
    from .. import hf, steer

    pm = subject()
    model = pm.model
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
    rows = []
    for name, iv in interventions(n, model.config.num_attention_heads).items():

        def steered(iv=iv):
            with torch.no_grad(), steer.apply(model, iv):
                model(ids, logits_to_keep=1)

        def plain():
            with torch.no_grad(), hf.use(model):
                model(ids, logits_to_keep=1)

        a, b = time_pair(steered, plain, repeats=repeats)
        rows.append(
            Row(
                "steer",
                f"forward with {name}",
                f"N={n}",
                a,
                "same forward, no intervention",
                b,
                f"<= {TARGET_FORWARD}x",
                a / b <= TARGET_FORWARD,
                repr(iv),
            )
        )
    return rows


def documents(pm, tokens_each: int, count: int = DOCUMENTS, seed: int = 0) -> list[str]:
    """``count`` documents of about ``tokens_each`` tokens of natural filler text."""
    import random

    from ..probes.haystack import FILLER

    rng = random.Random(seed)
    out = []
    for _ in range(count):
        text = ""
        while len(pm.tokenizer(text, add_special_tokens=False)["input_ids"]) < tokens_each:
            text += rng.choice(FILLER) + " "
        out.append(text.strip())
    return out


def rerank_cases(tokens_each: int, repeats: int) -> list[Row]:
    from ..steer import rerank
    from ..steer.rerank import build_context, encode

    pm = subject()
    docs = documents(pm, tokens_each)
    ids, _ = build_context(pm.tokenizer, docs)
    full = torch.tensor([ids + encode(pm.tokenizer, QUERY)])
    pm.model.set_attn_implementation("sdpa")

    def one_forward():
        with torch.no_grad():
            pm.model(full, use_cache=False, logits_to_keep=1)  # the answer's logits only, as re-ranking computes

    rows = []
    for method in ("icr", "sorting", "basin"):
        a, b = time_pair(functools.partial(rerank, pm, None, QUERY, docs, method=method), one_forward, repeats=repeats)
        target = f"<= {TARGET_RERANK}x" if method == "icr" else ""
        ok = a / b <= TARGET_RERANK if method == "icr" else None
        what = {
            "icr": "1 prefill + 2 query-row passes",
            "sorting": "2 rounds: prefill + last query row each",
            "basin": "as icr, then placed",
        }[method]
        rows.append(
            Row(
                "steer",
                f"rerank {DOCUMENTS} documents, {method}",
                f"N={full.shape[1]}",
                a,
                "one forward of the same prompt, sdpa",
                b,
                target,
                ok,
                what,
            )
        )
    return rows


# -- memory -----------------------------------------------------------------------------------

_SETUP = """
import resource
cap = {cap} * 1024 ** 3
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
from attnkit.bench.steer import subject, documents
pm = subject()
"""

BODIES = {
    "emphasize forward": "import attnkit.steer as steer, attnkit\n"
    "ids = torch.randint(0, pm.model.config.vocab_size, (1, {n}), generator=torch.Generator().manual_seed(0))\n"
    "with torch.no_grad(), steer.apply(pm.model, steer.emphasize([({n} // 4, {n} // 4 + {n} // 8)], 'all', 0.01)):\n"
    "    pm.model(ids, logits_to_keep=1)",
    "icr rerank": "from attnkit.steer import rerank\n"
    "docs = documents(pm, {n} // 20)\n"
    "rerank(pm, None, 'Which sentence says where we go?', docs)",
}

_EAGER_SETUP = (
    _SETUP
    + """
pm.model.set_attn_implementation("eager")
ids = torch.randint(0, pm.model.config.vocab_size, (1, {n}), generator=torch.Generator().manual_seed(0))
"""
)
_EAGER_BODY = "with torch.no_grad():\n    pm.model.model(input_ids=ids, output_attentions=True, use_cache=False)"


def memory_ours(n: int) -> list[Row]:
    """Peak RSS growth of an emphasize forward and of an icr re-rank at ``n`` tokens."""
    from .probes import _short_error, eager_weights_gib

    rows = []
    for name, body in BODIES.items():
        res = peak_rss_growth(_SETUP.format(cap=MEMORY_CAP_GB), body.format(n=n))
        case = f"peak RSS growth, {name}, {MEMORY_CAP_GB} GiB address cap"
        if "error" in res:
            rows.append(
                Row(
                    "steer",
                    case,
                    f"N={n}",
                    None,
                    "-",
                    None,
                    f"<= {TARGET_MEMORY_GB} GiB",
                    False,
                    f"could not run: {_short_error(res['error'])}",
                )
            )
            continue
        rows.append(
            Row(
                "steer",
                case,
                f"N={n}",
                res["seconds"] * 1e3,
                "-",
                None,
                f"<= {TARGET_MEMORY_GB} GiB",
                res["growth_mb"] <= TARGET_MEMORY_GB * 1024,
                f"{res['growth_mb']:.0f} MB growth, {res['peak_mb']:.0f} MB peak "
                f"(eager attentions alone: {eager_weights_gib(n):.2f} GiB)",
                extra=res,
            )
        )
    return rows


def memory_eager(n: int) -> list[Row]:
    """The baseline: one eager forward with ``output_attentions`` at ``n`` tokens."""
    from .probes import _short_error, eager_weights_gib

    rows = []
    res = peak_rss_growth(_EAGER_SETUP.format(cap=MEMORY_CAP_GB, n=n), _EAGER_BODY)
    need = f"needs {eager_weights_gib(n):.2f} GiB of weights (L x H x N^2 float32)"
    case = f"peak RSS growth, eager forward (PASTA's path) with output_attentions, {MEMORY_CAP_GB} GiB address cap"
    if "error" in res:
        rows.append(
            Row(
                "steer",
                case,
                f"N={n}",
                None,
                "-",
                None,
                "",
                None,
                f"could not run: {_short_error(res['error'])}; {need}",
                extra={"ran": False},
            )
        )
    else:
        rows.append(
            Row(
                "steer",
                case,
                f"N={n}",
                res["seconds"] * 1e3,
                "-",
                None,
                "",
                None,
                f"{res['growth_mb']:.0f} MB growth, {res['peak_mb']:.0f} MB peak; {need}",
                extra=res | {"ran": True},
            )
        )
    return rows


def run(quick: bool = False, progress=None) -> list[Row]:
    if quick:  # no memory subprocesses: seconds, for smoke runs and tests
        steps = [
            ("forward N=256", lambda: forward_cases(256, 2)),
            ("rerank 20 x 12 tokens", lambda: rerank_cases(12, 2)),
            ("memory: full mode only", lambda: []),
            ("done", lambda: []),
        ]
    else:
        steps = [
            ("forward N=4096", lambda: forward_cases(4096, 5)),
            ("rerank 20 x 200 tokens", lambda: rerank_cases(200, 5)),
            ("memory N=16384", lambda: memory_ours(16384)),
            ("memory eager N=16384", lambda: memory_eager(16384)),
        ]
    return run_steps(steps, progress)
