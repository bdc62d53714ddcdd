"""``attnkit inspect`` against a plain forward of the same model on the same input.

The instruments' cost is one extra pass over each layer's (query, key) tiles plus the
meters' work on them; the target is <= 2.5x a plain forward for the default
run (all-MiniLM-L6-v2 on the bundled sample text, every default meter). A tiny Llama at
long context shows the attention-bound extreme (its forward is almost all attention),
and peak memory at long context is read in a fresh subprocess.
"""

from __future__ import annotations

import torch

from .harness import Row, peak_rss_growth, run_steps, time_pair

STEPS = 3


def minilm_case(repeats: int) -> list[Row]:
    from .. import hf
    from ..inspection import inspect, sample_text

    model, tok = hf.load_default_model()
    enc = dict(tok(sample_text(), return_tensors="pt"))
    n = enc["input_ids"].shape[1]

    def plain():
        with torch.no_grad():
            model(**enc)

    cand, base = time_pair(lambda: inspect(model, enc), plain, repeats=repeats)
    return [
        Row(
            "inspect",
            "inspect MiniLM, all default meters",
            f"N={n}",
            cand,
            "plain forward",
            base,
            "<= 2.5x",
            cand / base <= 2.5,
            "sink, entropy, distance, logits, top keys; 6 layers x 12 heads",
        )
    ]


def _tiny_llama(n: int):
    import transformers as T

    torch.manual_seed(0)
    config = T.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=n,
    )
    return T.LlamaForCausalLM(config).eval()


def long_case(n: int, repeats: int) -> list[Row]:
    from ..inspection import inspect

    model = _tiny_llama(n)
    ids = torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(0))

    def plain():
        with torch.no_grad():
            model.model(input_ids=ids, use_cache=False)

    cand, base = time_pair(lambda: inspect(model, ids), plain, repeats=repeats)
    return [
        Row(
            "inspect",
            "inspect tiny Llama (attention-bound)",
            f"N={n}",
            cand,
            "plain forward (sdpa)",
            base,
            "",
            None,
            "2 layers x 4 heads, hidden 64: attention is nearly all of the forward",
        )
    ]


def memory_setup(n: int) -> str:
    return f"""
import transformers as T
import attnkit as ak
config = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, max_position_embeddings={n})
model = T.LlamaForCausalLM(config).eval()
ids = torch.randint(0, 64, (1, {n}))
"""


def memory_case(n: int) -> list[Row]:
    eager_gib = 2 * 2 * n * n * 4 / 2**30  # what output_attentions=True would hold: L x H x N^2 float32
    res = peak_rss_growth(memory_setup(n), 'ak.inspect(model, ids, meters=["sink", "entropy", "distance", "logits", "topkeys"])')
    case = "peak RSS, inspect tiny Llama, every meter"
    if "error" in res:
        return [Row("inspect", case, f"N={n}", None, "-", None, "<= 3 GiB", False, res["error"])]
    return [
        Row(
            "inspect",
            case,
            f"N={n}",
            res["seconds"] * 1e3,
            "-",
            None,
            "<= 3 GiB",
            res["peak_mb"] <= 3 * 1024,
            f"{res['peak_mb']:.0f} MB peak (eager attentions alone: {eager_gib:.1f} GiB)",
            extra=res,
        )
    ]


def run(quick: bool = False, progress=None) -> list[Row]:
    repeats = 3 if quick else 5
    steps = [
        ("MiniLM", lambda: minilm_case(repeats)),
        ("long context", lambda: long_case(2048 if quick else 8192, repeats)),
        ("memory", lambda: memory_case(8192 if quick else 32768)),
    ]
    return run_steps(steps, progress)
