"""``LinearAttention``: the Mechanism that every named linear-attention instance is.

A mechanism is the recurrence (feature map, sum or delta rule, normalised or not), where
its decays and β come from (fixed per head, computed from the keys, or passed per call),
and an optional short convolution. It runs in four forms that agree to rounding:
``reference`` (token by token, the literal definition), ``parallel`` (quadratic masked),
``chunked`` (O(N) time and memory, the default) and ``recurrent`` (token by token, for
decoding); ``backend=`` picks one, ``"auto"`` takes the recurrent form for a few tokens
and the chunked one otherwise.
"""

from __future__ import annotations

import torch
from torch import nn

from ...kernels import make_request
from ...kernels.request import all_finite
from ..base import Mechanism, register
from .call import LinearCall
from .chunked import chunked_form, default_chunk
from .conv import ShortConv
from .core import Recurrence
from .feature_maps import feature_map as as_feature_map
from .gates import (
    BetaGate,
    FixedDecay,
    GLAGate,
    MambaGate,
    lightning_log_decays,
    retnet_log_decays,
)
from .inputs import check_per_token, expand_heads, nonfinite_error, read_mask
from .parallel import parallel_form
from .recurrent import recurrent_form
from .reference import reference_form
from .state import LinearState

Tensor = torch.Tensor

FORMS = {"reference": reference_form, "parallel": parallel_form, "chunked": chunked_form, "recurrent": recurrent_form}
#: under backend="auto", calls with at most this many keys run the recurrent form
RECURRENT_MAX_TOKENS = 16

# Gate factories by name; the learned ones take the sizes to create their weights at once.
_DECAYS = {
    "retnet": lambda **sizes: FixedDecay(retnet_log_decays),
    "lightning": lambda **sizes: FixedDecay(lightning_log_decays),
    "gla": GLAGate,
    "mamba2": MambaGate,
}
_BETAS = {"learned": BetaGate}


@register("linear")
class LinearAttention(Mechanism):
    """Linear attention with any feature map, rule, decay and normalisation.

    Args:
        feature_map: a FeatureMap or one of ``feature_maps.FEATURE_MAPS`` ("identity",
            "elu+1", "relu", "dpfp", "taylor2", "favor+", "cosformer", "silu+l2", ...).
        rule: "sum" (S += φ(k)vᵀ) or "delta" (S += β φ(k)(v - Sᵀφ(k))ᵀ).
        normalize: divide by φ(q)ᵀz, z the running sum of key features.
        decay: None, "retnet" / "lightning" (fixed per-head decays), "gla" (diagonal gates
            from k), "mamba2" (scalar gates from k, Gated DeltaNet), or a gate module.
        beta: for the delta rule: None (β = 1), "learned" (σ of a projection of k) or a module.
        short_conv: width of the causal convolution on q, k, v (0: none).
        chunk_size: tokens per chunk in the chunked form (None: 64 for the sum rule, 32 for
            the delta rule).
        eps: added to the denominator when normalised.
        heads, head_dim, kv_heads, value_dim: create learnable weights now instead of on the
            first call (kv_heads defaults to heads, value_dim to head_dim).

    Call as ``mech(q, k, v, mask=None | attnkit.causal(), ...)`` with the keyword arguments
    of ``attnkit.attention`` plus ``initial_state=`` (a LinearState), ``return_state=True``
    (returns ``(out, state)``), ``g=`` log-gates <= 0 of shape (B, H, Nk) or
    (B, H, Nk, D_f) and ``beta=`` (B, H, Nk), with H the query or key/value heads; explicit
    g and beta override the mechanism's own.
    """

    recurrent = True
    paper = "arXiv:2006.16236"

    def __init__(
        self,
        feature_map="identity",
        *,
        rule: str = "sum",
        normalize: bool = False,
        decay=None,
        beta=None,
        short_conv: int = 0,
        chunk_size: int | None = None,
        eps: float = 1e-6,
        heads: int | None = None,
        head_dim: int | None = None,
        kv_heads: int | None = None,
        value_dim: int | None = None,
    ):
        super().__init__()
        if rule not in ("sum", "delta"):
            raise ValueError(f"rule: expected 'sum' or 'delta', got {rule!r}")
        if beta is not None and rule != "delta":
            raise ValueError("beta: only the delta rule has a β")
        if chunk_size is None:
            chunk_size = default_chunk(rule)
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
        if not eps >= 0:
            raise ValueError(f"eps: expected a non-negative number, got {eps!r}")
        self.feature_map = as_feature_map(feature_map)
        self.rule, self.normalize, self.chunk_size, self.eps = rule, bool(normalize), chunk_size, float(eps)
        kv_heads = kv_heads or heads
        feature_dim = None if head_dim is None else self.feature_map.out_dim(head_dim)
        self.decay = _make_gate(decay, _DECAYS, "decay", kv_heads, head_dim, feature_dim)
        self.beta = _make_gate(beta, _BETAS, "beta", kv_heads, head_dim, feature_dim)
        self.conv = ShortConv(short_conv) if short_conv else None
        if self.conv is not None and heads is not None and head_dim is not None:
            assert kv_heads is not None  # defaults to heads
            self.conv.initialize_parameters(
                *(
                    torch.empty(1, h, 0, d)
                    for h, d in ((heads, head_dim), (kv_heads, head_dim), (kv_heads, value_dim or head_dim))
                )
            )

    # ------------------------------------------------------------------ calls

    # not the template: a recurrence, no Request: its forms as backends, its own option errors, a LinearState back
    def forward(
        self,
        q,
        k,
        v,
        *,
        mask=None,
        score=None,
        scale=None,
        sinks=None,
        return_lse=False,
        backend="auto",
        check_finite=True,
        observers=None,
        layer=None,
        initial_state=None,
        return_state=False,
        g=None,
        beta=None,
    ):
        if backend not in ("auto", *FORMS):
            raise ValueError(f"backend: linear attention runs as 'auto', {', '.join(repr(f) for f in FORMS)}; got {backend!r}")
        call, conv_cache = self._prepare(q, k, v, mask, score, scale, sinks, return_lse, initial_state, return_state, g, beta)
        form = backend
        if call.k.shape[2] == 0:
            form = "recurrent"  # no keys: only the initial state can be read
        elif backend == "auto":
            form = "recurrent" if call.k.shape[2] <= RECURRENT_MAX_TOKENS else "chunked"
        out, memory = chunked_form(call, self.chunk_size) if form == "chunked" else FORMS[form](call)
        out = out.to(q.dtype)
        if check_finite and not all_finite(out):
            raise nonfinite_error(q, k, v, g, beta, initial_state)
        if observers:
            from .observe import observe_linear

            observe_linear(call, observers, layer, self.name)
        if not return_state:
            return out
        Dv = v.shape[-1]
        state = LinearState(
            memory=memory[..., :Dv],
            normalizer=memory[..., Dv] if self.normalize else None,
            position=call.start + call.k.shape[2],
            conv=conv_cache,
        )
        return out, state

    def reference(self, q, k, v, **call):
        """The token-by-token definition (``backend="reference"``)."""
        call.pop("backend", None)
        return self.forward(q, k, v, backend="reference", **call)

    # ------------------------------------------------------------------ preparation

    def _prepare(self, q, k, v, mask, score, scale, sinks, return_lse, initial_state, return_state, g, beta):
        req = make_request(q, k, v, scale=scale)
        causal, keep = read_mask(mask, q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)
        if score is not None:
            raise ValueError("score: linear attention has no logits for a score mod to modify")
        if sinks is not None:
            raise ValueError("sinks: linear attention has no softmax for a sink to join")
        if return_lse:
            raise ValueError("return_lse: linear attention has no logsumexp; use return_state=True for its state")
        B, Hq, Nq, D = q.shape
        Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
        if causal and Nq > Nk:
            raise ValueError(
                f"q: causal linear attention needs Nq <= Nk (queries are the last Nq key positions), got Nq={Nq}, Nk={Nk}"
            )
        if initial_state is not None and not isinstance(initial_state, LinearState):
            raise ValueError(
                f"initial_state: expected a LinearState (from return_state=True), got {type(initial_state).__name__}"
            )
        start = 0 if initial_state is None else initial_state.position
        fmap = self.feature_map.for_call(start + Nk, stateful=initial_state is not None or bool(return_state))
        if fmap.approximates_exp and req.scale < 0:
            raise ValueError(f"scale: {fmap!r} approximates exp(scale·q·k) with √scale, so scale must be >= 0, got {req.scale}")
        Df = fmap.out_dim(D)

        conv_cache = None
        if self.conv is not None:
            if Nq != Nk:
                raise ValueError(
                    f"q: with short_conv every query needs its own history, so Nq must equal Nk, got Nq={Nq}, Nk={Nk}"
                )
            past = None if initial_state is None else initial_state.conv
            if initial_state is not None and past is None:
                raise ValueError("initial_state: has no convolution cache but this mechanism has short_conv")
            q, k, v, conv_cache = self.conv(q, k, v, past)

        g = self._gates(g, k, B, Hq, Hkv, Nk, Df)
        beta = self._beta(beta, k, B, Hq, Hkv, Nk, Df)
        if Hq != Hkv:
            k, v = (t.repeat_interleave(Hq // Hkv, dim=1) for t in (k, v))
        rec = Recurrence(fmap, self.rule, self.normalize, req.scale, self.eps)
        memory = None
        if initial_state is not None:
            memory = self._memory_from_state(
                initial_state, B, Hq, Df, Dv, torch.float64 if q.dtype == torch.float64 else torch.float32, q.device
            )
        return LinearCall(rec, q, k, v, g, beta, memory, start, causal, keep), conv_cache

    def _gates(self, g, k, B, Hq, Hkv, Nk, Df):
        if g is None:
            if self.decay is None:
                return None
            if hasattr(self.decay, "key_gate"):
                return self.decay.key_gate(k, Hq, Df)
            g = self.decay(k, Hq, Df)
            check_per_token(g, "decay", B, Hq, Hkv, Nk, Df)
        else:
            check_per_token(g, "g", B, Hq, Hkv, Nk, Df)
            if not torch.compiler.is_compiling() and (not bool(torch.isfinite(g.detach()).all()) or bool((g.detach() > 0).any())):
                raise ValueError(
                    "g: log-gates must be finite and <= 0 (decay exp(g) in (0, 1]); pass a very negative value for a decay near 0"
                )
        return expand_heads(g, Hq)

    def _beta(self, beta, k, B, Hq, Hkv, Nk, Df):
        if self.rule == "sum":
            if beta is not None:
                raise ValueError("beta: only the delta rule has a β; this mechanism uses the sum rule")
            return None
        if beta is None:
            if self.beta is None:
                beta = k.new_ones(B, Hkv, Nk, dtype=torch.float64 if k.dtype == torch.float64 else torch.float32)
            elif hasattr(self.beta, "key_gate"):
                return self.beta.key_gate(k, Hq, Df)
            else:
                beta = self.beta(k, Hq, Df)
                check_per_token(beta, "beta", B, Hq, Hkv, Nk, None)
        else:
            check_per_token(beta, "beta", B, Hq, Hkv, Nk, None)
            if not torch.compiler.is_compiling() and not bool(torch.isfinite(beta.detach()).all()):
                raise ValueError("beta: contains NaN or inf")
        return expand_heads(beta, Hq)

    def _memory_from_state(self, state: LinearState, B, H, Df, Dv, dtype, device) -> Tensor:
        want = (B, H, Df, Dv)
        if tuple(state.memory.shape) != want:
            raise ValueError(
                f"initial_state: memory must have shape (B, H, D_f, Dv) = {want} for this call, got {tuple(state.memory.shape)}"
            )
        if self.normalize != (state.normalizer is not None):
            raise ValueError(
                f"initial_state: normalizer must be {'a (B, H, D_f) tensor' if self.normalize else 'None'} for this mechanism"
            )
        memory, normalizer = state.memory, state.normalizer
        if normalizer is not None:  # self.normalize, checked above
            if tuple(normalizer.shape) != want[:3]:
                raise ValueError(f"initial_state: normalizer must have shape {want[:3]}, got {tuple(normalizer.shape)}")
            memory = torch.cat([memory, normalizer.unsqueeze(-1)], dim=-1)
        return memory.to(device=device, dtype=dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, feature_map={self.feature_map!r}, rule={self.rule!r}, normalize={self.normalize}"


def _make_gate(spec, named: dict, arg: str, heads, head_dim, feature_dim):
    if spec is None or isinstance(spec, nn.Module):
        return spec
    if spec not in named:
        raise ValueError(f"{arg}: expected None, one of {', '.join(map(repr, named))} or a gate module, got {spec!r}")
    return named[spec](heads=heads, head_dim=head_dim, feature_dim=feature_dim)
