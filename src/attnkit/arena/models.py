"""The models the arena trains, and the mechanism specs that configure them.

- token tasks: ``attnkit.nn.TransformerLM`` (every layer runs the mechanism);
- real-valued inputs (in-context regression): ``VectorTransformer``, TransformerLM's
  blocks between a linear read-in and read-out, as Garg et al. (arXiv 2208.01066)
  wrap GPT-2;
- the single-layer associative-retrieval probe: ``RetrievalLayer``, one attention layer
  whose query reads a memory written by all the (key, value) pairs, as in Schlag et al.
  (arXiv 2102.11174, section 6.1).

A mechanism spec is a registered name with optional parameters, written
``name:key=value:key=value`` (values parsed as JSON, else kept as strings), e.g.
``linear:rule=delta:feature_map=elu+1``; a hybrid names one per layer, first to
last, separated by ``/`` (``linear_elu/softmax``: layer 0 linear, layer 1 softmax).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field

import torch
from torch import nn

from ..api import attention
from ..mechanisms import available, mechanism_class
from ..nn import Block, LearnedPositions, TransformerConfig, TransformerLM, build_mechanism
from ..nn.transformer import _init_weights

Tensor = torch.Tensor

#: short names the arena accepts besides the registry's (the name the delta-rule papers use)
ALIASES = {"delta": "deltanet"}


@dataclass(frozen=True)
class MechanismSpec:
    """A mechanism as the arena runs it: ``label`` (how tables name it), the registered
    ``name`` and constructor ``params``."""

    label: str
    name: str
    params: dict = field(default_factory=dict)
    #: a hybrid's layers, first to last: ((name, params), ...); () when every layer runs ``name``
    per_layer: tuple = ()

    @classmethod
    def parse(cls, text: str) -> MechanismSpec:
        text = text.strip()
        if "/" in text:  # one mechanism per layer, first to last: "softmax/linear_elu"
            parts = [cls.parse(part) for part in text.split("/")]
            if any(not part.label for part in parts):
                raise ValueError(f"mechanisms: expected one mechanism per layer as a/b/..., got {text!r}")
            return cls(text, text, {}, tuple((part.name, part.params) for part in parts))
        name, *assignments = text.split(":")
        name = ALIASES.get(name, name)
        if name not in available():
            raise ValueError(f"mechanisms: unknown mechanism {name!r} in {text!r}; registered: {', '.join(available())}")
        params = {}
        for item in assignments:
            pair = parse_assignment(item)
            if pair is None:
                raise ValueError(f"mechanisms: expected name:key=value:..., got {text!r}")
            params[pair[0]] = pair[1]
        check_parameters(name, params, text)
        return cls(text, name, params)


#: constructor keywords the model sets from its own sizes (``attnkit.nn.build_mechanism``)
SIZE_KEYWORDS = ("heads", "num_heads", "head_dim", "kv_heads", "value_dim", "v_dim")


def constructor_keywords(cls) -> set[str] | None:
    """Keyword names ``cls(...)`` accepts, following ``**overrides`` up to the parent
    constructors they are passed to; None when a constructor takes any keyword."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        if klass in (nn.Module, object):
            return names
        params = inspect.signature(init).parameters.values()
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            return names
    return None


def check_parameters(name: str, params: dict, text: str) -> None:
    """Refuse, before any model is built, a parameter the mechanism's constructor does
    not take (it would be a TypeError deep inside the first build) or one the model sets."""
    accepted = constructor_keywords(mechanism_class(name))
    for key in params:
        if key in SIZE_KEYWORDS:
            raise ValueError(f"mechanisms: {key!r} in {text!r} is set by the model (d_model and heads); leave it out")
        if accepted is not None and key not in accepted:
            takes = ", ".join(sorted(accepted - set(SIZE_KEYWORDS))) or "no parameters"
            raise ValueError(f"mechanisms: {name} has no parameter {key!r} (in {text!r}); it takes {takes}")


def parse_assignment(item: str) -> tuple[str, object] | None:
    """``key=value`` -> (key, value as JSON, else the string); None when it is not one."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        return None
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def parse_mechanisms(mechanisms) -> list[MechanismSpec]:
    """``"softmax,sigmoid,linear:rule=delta"`` (or a list of such strings and specs) ->
    specs, each label once."""
    if isinstance(mechanisms, str):
        mechanisms = [part for part in mechanisms.split(",") if part.strip()]
    specs = [m if isinstance(m, MechanismSpec) else MechanismSpec.parse(m) for m in mechanisms]
    if not specs:
        raise ValueError(f"mechanisms: expected a comma-separated list of names, got {mechanisms!r}")
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"mechanisms: each may appear once, got {', '.join(labels)}")
    return specs


def build_model(task, spec: MechanismSpec, d_model: int, n_layers: int, n_heads: int, max_len: int | None = None) -> nn.Module:
    """The model ``task`` is read by (``task.model_kind``), running ``spec`` in every attention layer.
    Call ``torch.manual_seed`` first to fix its initialisation. ``max_len``: the longest
    sequence it is built for (RoPE's and the export's context; default: the task's
    longest test length)."""
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
        raise ValueError(f"max_len: expected a positive int or None, got {max_len!r}")
    if task.fixed_layers is not None and n_layers != task.fixed_layers:
        raise ValueError(f"layers: the {task.name} task is a {task.fixed_layers}-layer probe, got {n_layers}")
    mechanism: str | list[str] = spec.name
    params: dict | list[dict] = dict(spec.params)
    if spec.per_layer:
        if len(spec.per_layer) != n_layers:
            raise ValueError(
                f"mechanisms: {spec.label!r} names {len(spec.per_layer)} layers' mechanisms, the model has {n_layers} layers"
            )
        if task.model_kind == "retrieval":
            raise ValueError(f"mechanisms: the {task.name} task is a one-layer probe; {spec.label!r} is one mechanism per layer")
        mechanism, params = [name for name, _ in spec.per_layer], [dict(p) for _, p in spec.per_layer]
    if task.model_kind == "retrieval":
        return RetrievalLayer(task.num_keys, task.num_values, d_model, n_heads, spec.name, spec.params)
    config = TransformerConfig(
        vocab_size=getattr(task, "vocab_size", 1),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        max_len=max_len or max(task.eval_lengths()),
        mechanism=mechanism,
        mechanism_params=params,
    )
    if task.model_kind == "lm":
        return TransformerLM(config)
    if task.model_kind == "vectors":
        return VectorTransformer(config, task.input_dim, task.output_dim)
    raise ValueError(f"task: unknown model_kind {task.model_kind!r}")


class VectorTransformer(nn.Module):
    """TransformerLM's blocks on real-valued inputs: read-in ``Linear(input_dim, d_model)``,
    the pre-norm blocks, a final RMSNorm and read-out ``Linear(d_model, output_dim)``
    (``config.vocab_size`` is unused). x (B, N, input_dim) -> (B, N, output_dim)."""

    def __init__(self, config: TransformerConfig, input_dim: int, output_dim: int):
        super().__init__()
        self.config = config
        self.read_in = nn.Linear(input_dim, config.d_model)
        self.positions = LearnedPositions(config.max_len, config.d_model) if config.positions == "learned" else None
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.read_out = nn.Linear(config.d_model, output_dim)
        _init_weights(self)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 3 or x.shape[-1] != self.read_in.in_features:
            raise ValueError(f"x: expected (B, N, {self.read_in.in_features}), got {tuple(x.shape)}")
        positions = torch.arange(x.shape[1], device=x.device)
        h = self.read_in(x)
        if self.positions is not None:
            h = h + self.positions(positions)
        for block in self.blocks:
            h = block(h, positions=positions)
        return self.read_out(self.norm(h))


class RetrievalLayer(nn.Module):
    """One attention layer as an associative memory (Schlag et al. 2021, arXiv 2102.11174).

    Each pair is one position, ``x_t = E_key[k_t] + E_value[v_t]``; keys and values are
    projections of it, the query a projection of ``E_key[query]``. The query reads after
    every pair has been written (no mask: a linear mechanism's state after the last pair),
    and a linear read-out gives logits over the values. No positions, no MLP: what is
    retrieved is what the mechanism's memory holds.

    inputs (B, L + 1, 2): (key, value) rows, then (query, anything) -> logits (B, 1, num_values).
    """

    def __init__(self, num_keys: int, num_values: int, d_model: int, n_heads: int, mechanism: str, params: dict | None = None):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"heads: must divide d_model={d_model}, got {n_heads}")
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.key_embed = nn.Embedding(num_keys, d_model)
        self.value_embed = nn.Embedding(num_values, d_model)
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.mechanism = build_mechanism(mechanism, dict(params or {}), n_heads, self.head_dim, n_heads, self.head_dim)
        self.readout = nn.Linear(d_model, num_values, bias=False)

    def forward(self, inputs: Tensor) -> Tensor:
        if inputs.dim() != 3 or inputs.shape[-1] != 2 or inputs.shape[1] < 2:
            raise ValueError(f"inputs: expected (B, L + 1, 2) key/value ids with L >= 1, got {tuple(inputs.shape)}")
        B, L = inputs.shape[0], inputs.shape[1] - 1
        pairs = self.key_embed(inputs[:, :L, 0]) + self.value_embed(inputs[:, :L, 1])
        query = self.key_embed(inputs[:, L:, 0])
        q = self._heads(self.q_proj(query))
        k, v = self._heads(self.k_proj(pairs)), self._heads(self.v_proj(pairs))
        out = attention(q, k, v, mechanism=self.mechanism)  # (B, H, 1, Dh)
        return self.readout(out.transpose(1, 2).reshape(B, 1, -1))

    def _heads(self, x: Tensor) -> Tensor:
        B, N, _ = x.shape
        return x.view(B, N, self.n_heads, self.head_dim).transpose(1, 2)
