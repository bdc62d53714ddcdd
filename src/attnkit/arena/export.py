"""A trained arena model as a transformers model: ``LlamaForCausalLM``, tokenizer, task.json.

``TransformerLM`` with softmax attention and RoPE is a Llama (Touvron et al. 2023,
arXiv 2302.13971): pre-norm RMSNorm blocks (arXiv 1910.07467), a SwiGLU MLP (arXiv
2002.05202), RoPE with the "rotate half" pairing (arXiv 2104.09864), no biases, an LM
head that may be tied to the embedding. The two agree on every convention that
matters here, so the weights carry over unchanged (no permutation of q/k rows):

- RoPE: both pair dim ``i`` with ``i + d/2`` and use ``theta_i = base^(-2i/d)`` over
  the whole head; linear scaling and YaRN exist in both with the same formulas, and
  attnkit's static NTK is plain RoPE with the base ``base * s^(d/(d-2))``;
- RMSNorm: ``x / sqrt(mean(x^2) + eps) * weight`` with the same ``eps``;
- SwiGLU ``w2(silu(w1 x) * w3 x)`` is Llama's ``down(silu(gate x) * up x)``;
- softmax attention with scale ``1/sqrt(head_dim)`` and a causal mask, GQA by
  repeating key/value heads.

Another mechanism than softmax exports when it has no weights of its own (sigmoid,
the parameter-free linear attentions): the weights are Llama's, and config.json's
``attnkit_mechanisms`` names the layers, mechanism and parameters (sigmoid's ``context``
fixed to the one it trained with); transformers alone would run softmax on them, so such
an export is run inside ``mechanism_switch(model)`` (``attnkit.hf.use`` on those layers).
What Llama cannot express is refused, naming the setting: a mechanism with weights of
its own, positions other than RoPE, partial rotary, QK-norm, output gates, sinks, MLA
latents, sliding windows, and models that are not TransformerLM.

The directory holds ``config.json`` and ``model.safetensors`` (``save_pretrained``),
the tokenizer files (see tokenizer.py: one token per symbol, nothing added, a pad
that is one of the task's symbols), ``generation_config.json`` (no eos: generation
runs for ``max_new_tokens``) and ``task.json``: the task's name and parameters, its
symbol table with roles, and one held-out example as text.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import fields
from typing import cast

import torch
from torch import nn

from ..extras import require
from ..nn import Block, TransformerLM
from ..nn.positions import RopeScaling, rope_frequencies
from .tasks import Task, make_task
from .tokenizer import Symbols, build_tokenizer, task_symbols
from .trainer import generator

FORMAT = "attnkit.arena.export"
VERSION = 1
TASK_FILE = "task.json"


def llama_config(model: nn.Module) -> dict:
    """Keyword arguments of the ``transformers.LlamaConfig`` that computes what ``model``
    computes; a ValueError naming the setting when there is none."""
    if not isinstance(model, TransformerLM):
        raise ValueError(f"model: expected an attnkit TransformerLM (what token tasks train), got {type(model).__name__}")
    c = model.config
    if c.positions != "rope":
        raise ValueError(f"positions: Llama has RoPE only, this model uses {c.positions!r}")
    head_dim = c.head_dim or c.d_model // c.n_heads
    if c.rotary_dim is not None and c.rotary_dim != head_dim:
        raise ValueError(
            f"rotary_dim: Llama rotates the whole head ({head_dim} dims), this model rotates {c.rotary_dim} (partial rotary)"
        )
    for name, off in (("qk_norm", False), ("gate", None), ("latent", None)):
        if getattr(c, name) != off:
            raise ValueError(f"{name}: Llama has no {_WHAT[name]}, this model sets {name}={getattr(c, name)!r}")
    layers = []
    for i in range(c.n_layers):
        mechanism, params = c.layer_value("mechanism", i), dict(c.layer_value("mechanism_params", i) or {})
        if mechanism != "softmax" or params:
            owned = [name for name, _ in cast(Block, model.blocks[i]).attn.mechanism.named_parameters()]
            if owned:
                raise ValueError(
                    f"mechanism: layer {i} runs {mechanism!r}, whose own weights ({', '.join(owned[:4])}) "
                    "Llama has no place for; only mechanisms without weights of their own export"
                )
            if "context" in _init_keywords(mechanism):
                params.setdefault("context", c.max_len)  # the n it trained with, whatever loads it later
            layers.append({"layer": i, "mechanism": mechanism, "params": params})
        if c.layer_value("window", i) is not None:
            raise ValueError(
                f"window: Llama attends to every earlier token, layer {i} has a sliding window of {c.layer_value('window', i)}"
            )
        if c.layer_value("sinks", i):
            raise ValueError(f"sinks: Llama has no learned attention sinks, layer {i} has them")
    return dict(
        vocab_size=c.vocab_size,
        hidden_size=c.d_model,
        intermediate_size=c.ff_dim,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads or c.n_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=c.max_len,
        rms_norm_eps=c.norm_eps,
        rope_parameters=_rope_parameters(c.rope_base, c.rope_scaling, head_dim),
        attention_bias=c.bias,
        mlp_bias=c.bias,
        attention_dropout=0.0,
        tie_word_embeddings=c.tie_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        use_cache=True,
        **({MECHANISMS_KEY: layers} if layers else {}),
    )


#: config.json's record of the layers that run another mechanism than softmax:
#: ``[{"layer": i, "mechanism": name, "params": {...}}]``. Llama computes softmax; such an
#: export is run with ``attnkit.hf.use`` on those layers (``mechanism_switch``).
MECHANISMS_KEY = "attnkit_mechanisms"


def _init_keywords(name: str) -> set[str]:
    from ..mechanisms import mechanism_class
    from .models import constructor_keywords

    return constructor_keywords(mechanism_class(name)) or set()


def export_mechanisms(config) -> list[dict]:
    """The layers of an export (its transformers config, or config.json as a dict) that run
    another mechanism than softmax; [] for a plain Llama."""
    value = config.get(MECHANISMS_KEY) if isinstance(config, dict) else getattr(config, MECHANISMS_KEY, None)
    return list(value or [])


def mechanism_switch(model):
    """A context manager that makes the loaded export ``model`` compute what it was trained
    to: ``attnkit.hf.use`` on the layers config.json names (nothing for softmax exports).
    One mechanism (with one set of parameters) at most besides softmax."""
    from contextlib import nullcontext

    layers = export_mechanisms(model.config)
    if not layers:
        return nullcontext()
    kinds = {(entry["mechanism"], json.dumps(entry["params"], sort_keys=True)) for entry in layers}
    if len(kinds) > 1:
        raise ValueError(f"config: {MECHANISMS_KEY} names {len(kinds)} different mechanisms; one is run at a time")
    from ..hf import use

    return use(model, layers[0]["mechanism"], layers=[entry["layer"] for entry in layers], **layers[0]["params"])


_WHAT = {"qk_norm": "norm on queries and keys", "gate": "output gate on attention", "latent": "latent (MLA) attention"}


def _rope_parameters(base: float, scaling, head_dim: int) -> dict:
    if scaling is None:
        return {"rope_type": "default", "rope_theta": float(base)}
    s = scaling if isinstance(scaling, RopeScaling) else RopeScaling(**scaling)
    if s.kind == "linear":
        return {"rope_type": "linear", "rope_theta": float(base), "factor": float(s.factor)}
    if s.kind == "ntk":
        # Static NTK-aware scaling is a change of base; Llama's "dynamic" NTK is another method.
        return {"rope_type": "default", "rope_theta": float(base) * float(s.factor) ** (head_dim / (head_dim - 2))}
    _, attention_factor = rope_frequencies(head_dim, base, s)
    return {
        "rope_type": "yarn",
        "rope_theta": float(base),
        "factor": float(s.factor),
        "original_max_position_embeddings": s.original_max_len,
        "beta_fast": float(s.beta_fast),
        "beta_slow": float(s.beta_slow),
        "truncate": bool(s.truncate),
        "attention_factor": float(attention_factor),
    }


def llama_names(n_layers: int, tie_embeddings: bool) -> dict[str, str]:
    """TransformerLM's weight names -> LlamaForCausalLM's (the tied LM head has none)."""
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    per_layer = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight"}
    for ours, theirs in (
        ("attn.q_proj", "self_attn.q_proj"),
        ("attn.k_proj", "self_attn.k_proj"),
        ("attn.v_proj", "self_attn.v_proj"),
        ("attn.o_proj", "self_attn.o_proj"),
        ("mlp.w1", "mlp.gate_proj"),
        ("mlp.w3", "mlp.up_proj"),
        ("mlp.w2", "mlp.down_proj"),
    ):
        for kind in ("weight", "bias"):
            per_layer[f"{ours}.{kind}"] = f"{theirs}.{kind}"
    for i in range(n_layers):
        for ours, theirs in per_layer.items():
            names[f"blocks.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    return names


def llama_state_dict(model: TransformerLM) -> dict[str, torch.Tensor]:
    """``model``'s weights under LlamaForCausalLM's names (no transposes or permutations
    needed: same layouts, same RoPE pairing)."""
    names = llama_names(model.config.n_layers, model.config.tie_embeddings)
    state = model.state_dict()
    skipped = {"lm_head.weight"} if model.config.tie_embeddings else set()
    unmapped = sorted(set(state) - set(names) - skipped)
    if unmapped:
        raise ValueError(f"model: weights Llama has no place for: {', '.join(unmapped[:6])}")
    return {names[k]: v.detach().clone() for k, v in state.items() if k in names}


def export(model: nn.Module, task: Task, directory: str, training: dict | None = None) -> str:
    """Write ``model`` trained on ``task`` to ``directory`` as a transformers model (see
    the module docstring); ``training`` (optional, JSON-able) is recorded in task.json.
    Returns the directory. Nothing is written when the model or task cannot export, and
    the model is left as it was."""
    require("transformers", "attnkit.arena's export")
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if not isinstance(task, Task):
        raise ValueError(f"task: expected an arena Task, got {type(task).__name__}")
    kwargs = llama_config(model)
    assert isinstance(model, TransformerLM)  # llama_config refuses any other model
    symbols = task_symbols(task)
    if model.config.vocab_size != len(symbols.tokens):
        raise ValueError(
            f"model: vocab_size {model.config.vocab_size} does not match the {task.name} task's {len(symbols.tokens)} symbols"
        )
    state = llama_state_dict(model)
    dtype = model.embed.weight.dtype
    pad_id = symbols.ids[symbols.pad]
    config = LlamaConfig(**kwargs, pad_token_id=pad_id)
    config.architectures = ["LlamaForCausalLM"]
    with torch.random.fork_rng():  # its random initialisation is overwritten; leave the caller's RNG alone
        llama = LlamaForCausalLM(config).to(dtype)  # type: ignore[arg-type]  # transformers' wrapped .to reads as unbound
    missing, unexpected = llama.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:  # a mapping out of step with transformers' names
        raise ValueError(f"model: Llama weights left unset {missing}, unknown {unexpected}")
    if config.tie_word_embeddings:
        llama.tie_weights()
    llama.generation_config = GenerationConfig(pad_token_id=pad_id, bos_token_id=None, eos_token_id=None, do_sample=False)

    os.makedirs(directory, exist_ok=True)
    with _quiet_transformers():
        llama.save_pretrained(directory)
    tokenizer = build_tokenizer(symbols)
    tokenizer.model_max_length = model.config.max_len
    tokenizer.save_pretrained(directory)
    with open(os.path.join(directory, TASK_FILE), "w") as f:
        json.dump(task_record(task, symbols, training), f, indent=1)
    return directory


@contextmanager
def _quiet_transformers():
    """No progress bar while saving (the arena prints its own progress)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def task_record(task: Task, symbols: Symbols | None = None, training: dict | None = None) -> dict:
    """What task.json holds: the task's name, source and every parameter (so
    ``make_task(name, **params)`` rebuilds it), its symbol table and one held-out example."""
    symbols = task_symbols(task) if symbols is None else symbols
    example = task.held_out(1, generator(0, "export-example", task.seq_len))
    ids = example.inputs[0].tolist()
    answers = [[int(p), symbols.tokens[int(t)]] for p, t in enumerate(example.targets[0].tolist()) if example.mask[0, p]]
    record = {
        "format": FORMAT,
        "version": VERSION,
        "task": task.name,
        "paper": task.paper,
        "params": _jsonable({f.name: getattr(task, f.name) for f in fields(task)}),
        "seq_len": task.seq_len,
        "eval_lengths": list(task.eval_lengths()),
        "vocab_size": len(symbols.tokens),
        "symbols": symbols.to_dict(),
        # answers: [position, symbol] pairs; the model's output at the position predicts the symbol.
        "example": {"text": symbols.decode(ids), "answers": answers},
    }
    if training is not None:
        record["training"] = _jsonable(training)
    return record


def read_task(directory: str) -> tuple[Task, Symbols, dict]:
    """(task, symbols, the whole record) of an export written by ``export``."""
    path = os.path.join(directory, TASK_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"directory: {directory} has no {TASK_FILE} (not an attnkit arena export)")
    with open(path) as f:
        record = json.load(f)
    if record.get("format") != FORMAT:
        raise ValueError(f"directory: {path} has format {record.get('format')!r}, expected {FORMAT!r}")
    if record.get("version", 0) > VERSION:
        raise ValueError(f"directory: {path} is version {record['version']}, this attnkit reads up to {VERSION}")
    return make_task(record["task"], **record["params"]), Symbols.from_dict(record["symbols"]), record


def check_run(run) -> None:
    """Refuse, before any training, a grid run (``runner.Run``) whose model could not export."""
    from .models import build_model

    with torch.random.fork_rng():
        model = build_model(run.task, run.mechanism, run.d_model, run.layers, run.heads, run.max_len)
    llama_config(model)
    task_symbols(run.task)


def export_run(run, record: dict, rows: list[dict], overrides: dict | None, directory: str) -> str:
    """Export a finished grid run from the checkpoint it wrote (``record["checkpoint"]``,
    as ``runner.execute`` returns it, or its best weights when the run kept them);
    ``rows`` (its evaluations) go into task.json."""
    from .checkpoint import load_weights
    from .models import build_model
    from .runner import train_config
    from .trainer import Trainer

    path = record.get("best_checkpoint") or record.get("checkpoint")
    if not path or not os.path.isfile(path):
        raise ValueError(f"record: the run wrote no checkpoint to export from (got {path!r})")
    with torch.random.fork_rng():  # resuming restores the run's RNG state; keep the caller's
        model = build_model(run.task, run.mechanism, run.d_model, run.layers, run.heads, record.get("max_len"))
        if path == record.get("best_checkpoint"):
            model.load_state_dict(load_weights(path))
        else:
            Trainer(model, run.task, train_config(run.task, run.seed, overrides)).resume(path)
    return export(model.eval(), run.task, directory, run_training(run, record, rows))


def run_training(run, record: dict, rows: list[dict]) -> dict:
    """What task.json's ``training`` records of a grid run."""
    training = {
        "mechanism": run.mechanism.label,
        "d_model": run.d_model,
        "layers": run.layers,
        "heads": run.heads,
        "seed": run.seed,
        "steps": rows[0]["steps"] if rows else None,
        "accuracy": {str(r["eval_len"]): r["accuracy"] for r in rows},
    }
    for key in ("schedule", "init", "max_len", "best_step", "best_score"):
        if record.get(key) is not None:
            training[key] = record[key]
    if rows and not rows[0].get("finished", True):
        training["finished"] = False  # written as the run went: the latest (or best) evaluation so far
    return training


def export_atomic(model: TransformerLM, task: Task, directory: str, training: dict | None = None) -> str:
    """``export`` into a sibling folder, then swapped in: a run killed mid-write leaves
    the previous export whole (exports written as a run goes)."""
    directory = os.path.normpath(directory)
    staging, old = directory + ".writing", directory + ".previous"
    for leftover in (staging, old):
        shutil.rmtree(leftover, ignore_errors=True)
    was_training = model.training
    try:
        export(model.eval(), task, staging, training)
    finally:
        model.train(was_training)
    if os.path.isdir(directory):
        os.replace(directory, old)
    os.replace(staging, directory)
    shutil.rmtree(old, ignore_errors=True)
    return directory


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


__all__ = [
    "FORMAT",
    "MECHANISMS_KEY",
    "TASK_FILE",
    "check_run",
    "export",
    "export_atomic",
    "export_mechanisms",
    "export_run",
    "llama_config",
    "llama_names",
    "mechanism_switch",
    "llama_state_dict",
    "read_task",
    "run_training",
    "task_record",
]
