"""The probes at long context: memory of ``needle`` and ``heads`` against what eager
attention needs, and the time of a needle grid cell against a plain ``generate``.

The subject is a tiny random Llama (2 layers, hidden 64, 4 query heads, 2 key-value
heads, 64k positions) reading the bundled all-MiniLM-L6-v2 tokenizer's vocabulary, so the
natural-language needle prompt and the random-token head prompts are built exactly as for
a real model. Its weights are random: accuracy means nothing here, cost does.

- memory: peak RSS growth of one probe call in a fresh subprocess (``harness``: the
  high-water mark is reset after the set-up), at N tokens, under an address-space cap.
  The baseline is what a probe built on transformers' eager attention must hold: one
  forward of an N-token prompt with ``output_attentions=True`` keeps L x H x N^2 float32
  weights (2 GiB at 8k, 32 GiB at 32k), run under the same cap, where at 32k it cannot
  allocate; the note says what it would need.
- time: one needle grid cell (one length, one depth, one sample: prompt building,
  prefill and cached decoding through attnkit with the needle meter, scoring) against one
  plain greedy ``model.generate`` of the same prompt for the same number of new tokens
  on transformers' sdpa attention; interleaved medians, target <= 1.5x.

``quick`` runs 1024 tokens (memory) and 512 (time), a minute or so: for smoke runs.
"""

from __future__ import annotations

import torch

from .harness import Row, Step, peak_rss_growth, run_steps, time_pair

STEPS = 3
LAYERS, D_MODEL, HEADS, KV_HEADS = 2, 64, 4, 2
MAX_POSITIONS = 65536
MEMORY_CAP_GB = 8
NEW_TOKENS = 8  # the needle's answer (7 digits) and a little room, as the probe's default would give
TARGET_TIME = 1.5
TARGET_MEMORY_GB = 2


def tiny_probe_model():
    """The benchmark's subject as a ``ProbeModel``: a random tiny Llama with the bundled
    MiniLM tokenizer (its vocabulary, no eos: every answer runs ``NEW_TOKENS`` steps)."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers as T

    from ..hf.default_model import default_model_path
    from ..probes import ProbeModel

    tokenizer = T.AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)
    torch.manual_seed(0)
    config = T.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=D_MODEL,
        intermediate_size=2 * D_MODEL,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = T.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return ProbeModel(model, tokenizer, "causal", MAX_POSITIONS, None, "tiny-llama")


def _needle_prompt(pm, n: int) -> list[int]:
    """The token ids of the needle probe's prompt at (length n, depth 0.5, sample 0)."""
    from ..probes.needle import text_items

    items, _ = text_items(pm, [n], [0.5], 1, 0)
    return items[0].ids


# -- memory -----------------------------------------------------------------------------------

_SETUP = """
import resource
cap = {cap} * 1024 ** 3
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
from attnkit.bench.probes import tiny_probe_model
pm = tiny_probe_model()
"""

BODIES = {
    "needle": "from attnkit.probes.needle import needle\n"
    "needle(pm, lengths=[{n}], depths=[0.5], samples=1, batch_size=1, max_new_tokens={new})",
    "heads": "from attnkit.probes.heads import heads\n"
    "heads(pm, length={n} // 2, repeats=2, samples=1, context={n}, needle=8, batch_size=1)",
}

_EAGER_SETUP = (
    _SETUP
    + """
pm.model.set_attn_implementation("eager")
ids = torch.randint(0, pm.model.config.vocab_size, (1, {n}), generator=torch.Generator().manual_seed(0))
"""
)
_EAGER_BODY = "with torch.no_grad():\n    out = pm.model.model(input_ids=ids, output_attentions=True, use_cache=False)"


def eager_weights_gib(n: int) -> float:
    """What ``output_attentions=True`` returns for one N-token prompt: L x H x N^2 float32."""
    return LAYERS * HEADS * n * n * 4 / 2**30


def _short_error(message: str) -> str:
    if "you tried to allocate" in message:  # torch's allocator message: keep the size
        size = message.split("you tried to allocate ")[1].split(" ")[0]
        return f"can't allocate {int(size) / 2**30:.1f} GiB" if size.isdigit() else message[:160]
    return message[:160]


def memory_case(probe: str, n: int) -> Row:
    """Peak RSS growth of one ``probe`` call at ``n`` tokens, under the address cap."""
    res = peak_rss_growth(_SETUP.format(cap=MEMORY_CAP_GB), BODIES[probe].format(n=n, new=NEW_TOKENS))
    case = f"peak RSS growth, {probe} probe, tiny Llama, {MEMORY_CAP_GB} GiB address cap"
    if "error" in res:
        return Row(
            "probes",
            case,
            f"N={n}",
            None,
            "-",
            None,
            f"<= {TARGET_MEMORY_GB} GiB",
            False,
            f"could not run: {_short_error(res['error'])}",
        )
    return Row(
        "probes",
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


def eager_case(n: int) -> Row:
    """The baseline: one eager forward with ``output_attentions=True`` at ``n`` tokens."""
    res = peak_rss_growth(_EAGER_SETUP.format(cap=MEMORY_CAP_GB, n=n), _EAGER_BODY)
    need = f"needs {eager_weights_gib(n):.2f} GiB of weights (L x H x N^2 float32)"
    case = f"peak RSS growth, eager forward with output_attentions, {MEMORY_CAP_GB} GiB address cap"
    if "error" in res:
        return Row(
            "probes",
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
    return Row(
        "probes",
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


def memory_cases(n: int, probes=("needle", "heads"), eager: bool = True) -> list[Row]:
    return [memory_case(p, n) for p in probes] + ([eager_case(n)] if eager else [])


# -- time -------------------------------------------------------------------------------------


def needle_cell_case(n: int, repeats: int) -> list[Row]:
    """One needle grid cell against one plain generate of the same prompt."""
    from ..probes.generation import greedy_generate
    from ..probes.needle import needle

    pm = tiny_probe_model()
    ids = torch.tensor([_needle_prompt(pm, n)])

    def cell():
        result = needle(pm, lengths=[n], depths=[0.5], samples=1, batch_size=1, max_new_tokens=NEW_TOKENS)
        assert result.meta["max_new_tokens"] == NEW_TOKENS

    def plain():
        with torch.no_grad():
            out = pm.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=pm.tokenizer.pad_token_id,
            )
        assert out.shape[1] == ids.shape[1] + NEW_TOKENS

    def bare():  # the same decoding through attnkit without the probe around it: where the time goes
        greedy_generate(pm.model, pm.tokenizer, [ids[0].tolist()], NEW_TOKENS)

    a, b = time_pair(cell, plain, repeats=repeats)
    c, d = time_pair(bare, plain, repeats=repeats)
    shape = f"{NEW_TOKENS} new tokens; tiny Llama {LAYERS} layers x {HEADS} heads, hidden {D_MODEL}"
    return [
        Row(
            "probes",
            "needle grid cell (prompt, prefill + decode with the needle meter, score)",
            f"N={n}",
            a,
            "plain generate, sdpa",
            b,
            f"<= {TARGET_TIME}x",
            a / b <= TARGET_TIME,
            shape,
        ),
        Row(
            "probes",
            "  of which: attnkit greedy decoding alone (no meter, no prompt building)",
            f"N={n}",
            c,
            "plain generate, sdpa",
            d,
            "",
            None,
            "for reading the row above",
        ),
    ]


def run(quick: bool = False, progress=None) -> list[Row]:
    steps: list[Step]
    if quick:  # the same three steps at small sizes
        steps = [
            ("needle cell N=512", lambda: needle_cell_case(512, 3)),
            ("memory N=1024", lambda: memory_cases(1024, eager=False)),
            ("memory eager N=1024", lambda: [eager_case(1024)]),
        ]
    else:
        steps = [("needle cell N=4096", lambda: needle_cell_case(4096, 5))]
        steps += [(f"memory N={n}", lambda n=n: memory_cases(n)) for n in (8192, 32768)]
    return run_steps(steps, progress)
