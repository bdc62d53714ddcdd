"""``TransformerLM``: a small decoder to train and compare mechanisms on.

Pre-norm blocks (RMSNorm, Zhang & Sennrich 2019, arXiv 1910.07467) of attention and a
SwiGLU MLP (Shazeer 2020, arXiv 2002.05202), a final RMSNorm and a language-model head
tied to the token embedding. Every layer can run its own mechanism; the config says
which (name and parameters), so a saved model rebuilds itself. Weights are saved as
safetensors with the config in the file's metadata.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from ..extras import require
from .attention import Attention
from .cache import Cache
from .positions import POSITIONS, LearnedPositions

Tensor = torch.Tensor
FORMAT = "attnkit.nn.TransformerLM"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
#: config fields that may hold one value per layer
PER_LAYER = ("mechanism", "mechanism_params", "window", "sinks")


@dataclass
class TransformerConfig:
    """Everything that defines a TransformerLM.

    ``mechanism`` / ``mechanism_params`` / ``window`` / ``sinks`` are either one value
    for every layer or a list with one entry per layer. ``positions``: "rope", "alibi", "nope" or
    "learned". ``rope_scaling``: a RopeScaling dict ({"kind": "yarn", "factor": 4,
    "original_max_len": 2048}). ``rotary_dim``: partial rotary (None: the whole head).
    ``latent``: a LatentConfig dict for MLA. ``d_ff``: SwiGLU hidden size (default
    8/3 d_model rounded up to a multiple of 32).
    """

    vocab_size: int
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    head_dim: int | None = None
    d_ff: int | None = None
    max_len: int = 2048
    positions: str = "rope"
    rope_base: float = 10000.0
    rope_scaling: dict | None = None
    rotary_dim: int | None = None
    mechanism: str | list = "softmax"
    mechanism_params: dict | list = field(default_factory=dict)
    window: int | list | None = None
    qk_norm: bool = False
    gate: str | None = None
    sinks: bool | list = False
    latent: dict | None = None
    bias: bool = False
    dropout: float = 0.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True

    def __post_init__(self):
        if self.positions not in POSITIONS:
            raise ValueError(f"positions: expected one of {POSITIONS}, got {self.positions!r}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_len"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        for name in PER_LAYER:
            value = getattr(self, name)
            if isinstance(value, list) and len(value) != self.n_layers:
                raise ValueError(f"{name}: a list must have one entry per layer (n_layers={self.n_layers}), got {len(value)}")

    def layer_value(self, name: str, i: int):
        value = getattr(self, name)
        return value[i] if isinstance(value, list) else value

    @property
    def ff_dim(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        return -(-(8 * self.d_model // 3) // 32) * 32

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TransformerConfig:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"config: unknown fields {unknown} (saved by a newer attnkit?)")
        return cls(**data)


class SwiGLU(nn.Module):
    """``W2 (silu(W1 x) * W3 x)`` (Shazeer 2020, arXiv 2002.05202)."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = False):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=bias)
        self.w3 = nn.Linear(d_model, d_ff, bias=bias)
        self.w2 = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: TransformerConfig, i: int):
        super().__init__()
        c = config
        head_dim = c.head_dim or c.d_model // c.n_heads
        rope = None
        if c.positions == "rope" and c.latent is None:
            rope = dict(rotary_dim=c.rotary_dim, base=c.rope_base, scaling=c.rope_scaling)
        elif c.positions == "rope":
            rope = dict(base=c.rope_base, scaling=c.rope_scaling)
        self.attn_norm = nn.RMSNorm(c.d_model, eps=c.norm_eps)
        self.attn = Attention(
            c.d_model,
            c.n_heads,
            c.n_kv_heads,
            head_dim,
            mechanism=c.layer_value("mechanism", i),
            rope=rope,
            qk_norm=c.qk_norm,
            gate=c.gate,
            sinks=bool(c.layer_value("sinks", i)),
            bias=c.bias,
            dropout=c.dropout,
            latent=c.latent,
            window=c.layer_value("window", i),
            alibi=c.positions == "alibi",
            mechanism_params=dict(c.layer_value("mechanism_params", i) or {}),
            norm_eps=c.norm_eps,
            context=c.max_len,
        )
        self.mlp_norm = nn.RMSNorm(c.d_model, eps=c.norm_eps)
        self.mlp = SwiGLU(c.d_model, c.ff_dim, c.bias)
        self.mlp_dropout = nn.Dropout(c.dropout)

    def forward(self, x: Tensor, cache=None, mask=None, positions=None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cache=cache, mask=mask, positions=positions)
        return x + self.mlp_dropout(self.mlp(self.mlp_norm(x)))


class TransformerLM(nn.Module):
    """A decoder-only language model built from attnkit layers (see TransformerConfig)."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.positions = LearnedPositions(config.max_len, config.d_model) if config.positions == "learned" else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        _init_weights(self)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def new_cache(self) -> Cache:
        return Cache(self.config.n_layers)

    def forward(self, idx: Tensor, targets: Tensor | None = None, cache: Cache | None = None, mask=None):
        """Logits (B, N, vocab) for token ids ``idx`` (B, N); with ``targets`` (B, N) also
        the mean cross-entropy (targets of -100 are ignored): returns (logits, loss).

        ``cache`` (from ``new_cache()``) makes this call continue the previous ones;
        ``mask`` is an extra attnkit mask given to every layer (e.g. ``document(ids)``)."""
        if idx.dim() != 2 or idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"idx: expected integer token ids of shape (B, N), got {idx.dtype} {tuple(idx.shape)}")
        B, N = idx.shape
        start = 0 if cache is None else cache.length
        positions = torch.arange(start, start + N, device=idx.device)
        if start + N > self.config.max_len and self.config.positions == "learned":
            raise ValueError(f"idx: learned positions cover {self.config.max_len} tokens, this call reaches {start + N}")
        x = self.embed(idx)
        if self.positions is not None:
            x = x + self.positions(positions)
        x = self.drop(x)
        for i, block in enumerate(self.blocks):
            x = block(x, cache=None if cache is None else cache[i], mask=mask, positions=positions)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        flat = logits.reshape(-1, logits.shape[-1])
        if flat.dtype in (torch.float16, torch.bfloat16):
            flat = flat.float()  # the loss accumulates over the vocabulary
        loss = F.cross_entropy(flat, targets.reshape(-1), ignore_index=-100)
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Continue ``idx`` (B, N) by ``max_new_tokens`` tokens. ``temperature=0`` is greedy;
        otherwise sample from softmax(logits / temperature), restricted to the ``top_k``
        most likely tokens. With ``use_cache`` the prompt is read once and each new token
        attends to the cached keys (or recurrent state); without, every step recomputes."""
        if temperature < 0:
            raise ValueError(f"temperature: expected >= 0, got {temperature}")
        if top_k is not None and not (isinstance(top_k, int) and top_k >= 1):
            raise ValueError(f"top_k: expected a positive int or None, got {top_k!r}")
        cache = self.new_cache() if use_cache else None
        step_input = idx
        for _ in range(max_new_tokens):
            logits = self(step_input if use_cache else idx, cache=cache)[:, -1].float()
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat((idx, nxt), dim=1)
            step_input = nxt
        return idx

    # ------------------------------------------------------------------ files

    def save(self, path: str) -> None:
        """Weights as safetensors; the config travels in the file's metadata."""
        require("safetensors", "TransformerLM.save")
        from safetensors.torch import save_model

        save_model(self, path, metadata={"format": FORMAT, "config": self.config.to_json()})

    @classmethod
    def load(cls, path: str, device: str | torch.device = "cpu") -> TransformerLM:
        """A model saved by ``save``: rebuilt from its config, weights loaded strictly."""
        require("safetensors", "TransformerLM.load")
        from safetensors import safe_open
        from safetensors.torch import load_model

        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
        if meta.get("format") != FORMAT or "config" not in meta:
            raise ValueError(f"path: {path} is not a TransformerLM saved by attnkit (metadata format {meta.get('format')!r})")
        model = cls(TransformerConfig.from_json(meta["config"]))
        # Weights keep the precision they were saved in.
        saved = [_DTYPES[d] for d in dtypes if d in _DTYPES]
        if len(set(saved)) == 1:
            model = model.to(saved[0])
        load_model(model, path, strict=True, device=str(device))
        return model.to(device)


def _init_weights(model: nn.Module) -> None:
    """GPT-2 / nanoGPT initialisation (normal, std 0.02; zero biases) of the model's own
    layers; mechanisms keep the initialisation their papers prescribe."""
    from ..mechanisms import Mechanism

    skip = [m for m in model.modules() if isinstance(m, Mechanism)]
    inside = {id(sub) for m in skip for sub in m.modules()}
    for module in model.modules():
        if id(module) in inside:
            continue
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
