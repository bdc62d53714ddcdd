"""A transformers model on attnkit: tiny random Llama (4 layers, d=256, 4 heads of 64,
2 kv heads), base model without the LM head, batch 1, fp32.

- time: ``attnkit.hf.use(model)`` against the same model on transformers' "sdpa", one
  forward at N tokens, interleaved medians (target: within 1.3x);
- memory: one forward at a long context in fresh subprocesses under the same address
  space cap, attnkit against transformers' "eager" (which holds H x N x N weights per
  layer); peak RSS of both is reported, and eager's error when it cannot run.

``quick`` times 512 and 1024 tokens and probes memory at 4096 (where eager still fits).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch

from .harness import Row, Step, run_steps, time_pair

STEPS = 4
LAYERS, D_MODEL, HEADS, KV_HEADS = 4, 256, 4, 2
MEMORY_CAP_GB = 8


def tiny_llama(attn_implementation: str):
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=D_MODEL,
        intermediate_size=4 * D_MODEL,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=65536,
    )
    return LlamaModel._from_config(config, attn_implementation=attn_implementation).eval()


def speed_case(n: int, repeats: int) -> Row:
    import attnkit.hf as akhf

    model = tiny_llama("sdpa")
    ids = torch.randint(0, 1000, (1, n), generator=torch.Generator().manual_seed(n))

    def sdpa():
        model(ids)

    def ours():
        with akhf.use(model):
            model(ids)

    with torch.no_grad():
        a, b = time_pair(ours, sdpa, repeats=repeats)
    return Row(
        "hf",
        "tiny llama forward, attnkit softmax",
        f"N={n}",
        a,
        "transformers sdpa",
        b,
        "<= 1.3x",
        a / b <= 1.3,
        f"{LAYERS} layers, d={D_MODEL}, {HEADS} heads, {KV_HEADS} kv heads",
    )


def decode_case(prompt: int, new_tokens: int, repeats: int) -> Row:
    """Greedy decoding tokens/s: ``generate`` inside ``attnkit.hf.use`` against plain
    ``generate`` on transformers' sdpa (every layer of every step is a small call)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import attnkit.hf as akhf

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=D_MODEL,
        intermediate_size=4 * D_MODEL,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=65536,
    )
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa").eval()
    ids = torch.randint(0, 1000, (1, prompt), generator=torch.Generator().manual_seed(prompt))
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    def plain():
        model.generate(ids, **kw)

    def ours():
        with akhf.use(model):
            model.generate(ids, **kw)

    with torch.no_grad():
        a, b = time_pair(ours, plain, repeats=repeats)
    ratio = b / a  # attnkit's tokens/s over plain generate's
    return Row(
        "hf",
        "generate tokens/s, attnkit softmax",
        f"prompt={prompt} +{new_tokens}",
        a,
        "plain generate (sdpa)",
        b,
        ">= 0.9x tokens/s",
        ratio >= 0.9,
        f"{new_tokens / a * 1e3:.0f} vs {new_tokens / b * 1e3:.0f} tokens/s",
    )


_PROBE = """
import json, resource, time, traceback
cap = {cap} * 1024 ** 3
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
import torch
from attnkit.bench.hf import tiny_llama
import attnkit.hf as akhf
model = tiny_llama({impl!r})
ids = torch.randint(0, 1000, (1, {n}))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
error = None
try:
    with torch.no_grad():
        if {ours}:
            with akhf.use(model):
                model(ids)
        else:
            model(ids)
except (RuntimeError, MemoryError) as e:
    error = str(e).strip().splitlines()[0]
    if "you tried to allocate" in error:  # torch's allocator message: keep the size
        error = "can't allocate " + error.split("you tried to allocate ")[1].split(".")[0]
    error = error[:160]
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"error": error, "seconds": time.perf_counter() - t, "peak_mb": peak / 1024, "growth_mb": (peak - base) / 1024}}))
"""


def memory_probe(n: int, ours: bool) -> dict:
    """Peak RSS of one forward at ``n`` tokens in a fresh Python under an address space cap."""
    code = textwrap.dedent(_PROBE.format(cap=MEMORY_CAP_GB, impl="sdpa" if ours else "eager", n=n, ours=ours))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()
        return {"error": tail[-1] if tail else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def memory_cases(n: int) -> list[Row]:
    rows = []
    eager_weights_gb = HEADS * n * n * 4 / 1024**3
    for label, ours in (("attnkit", True), ("transformers eager", False)):
        res = memory_probe(n, ours)
        ran = res.get("error") is None
        note = f"peak RSS {res['peak_mb']:.0f} MB" if "peak_mb" in res else ""
        if not ran:
            note += f"{'; ' if note else ''}could not run: {res['error']}"
        if not ours:
            note += f"; eager's weights alone: {eager_weights_gb:.1f} GiB per layer"
        rows.append(
            Row(
                "hf",
                f"tiny llama forward, {label}, {MEMORY_CAP_GB} GiB address cap",
                f"N={n}",
                res.get("seconds", 0) * 1e3 if ran else None,
                "-",
                None,
                "runs" if ours else "",
                ran if ours else None,
                note,
                extra={k: v for k, v in res.items() if k != "error"} | {"ran": ran},
            )
        )
    return rows


def run(quick: bool = False, progress=None) -> list[Row]:
    speed_sizes, n_memory, repeats = ([512, 1024], 4096, 3) if quick else ([1024, 4096], 32768, 5)
    steps: list[Step] = [(f"speed N={n}", lambda n=n: [speed_case(n, repeats)]) for n in speed_sizes]
    steps.append(("decode", lambda: [decode_case(512, 32, repeats)]))
    steps.append((f"memory N={n_memory}", lambda: memory_cases(n_memory)))
    return run_steps(steps, progress)
