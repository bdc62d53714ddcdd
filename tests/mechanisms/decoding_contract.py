"""The decoding contract every registered mechanism is held to.

A causal model computes the same rows whatever way the sequence is fed to it:

- a prefix call (the first n tokens alone) gives the first n rows of the full call;
- token-by-token decoding against a KV cache (or a recurrent state, or the per-key state
  of ``cache_state`` mechanisms) gives the rows of the full call.

So nothing in a mechanism may depend on the length of the call (sigmoid's n and
cosFormer's horizon are a fixed ``context``) or on state the cache does not carry
(selective attention's F). The few mechanisms whose rows depend on the rest of the call
(``decodes = False``) must refuse a cache with a ValueError saying why; they are listed
in ``NO_CACHE`` so that a new one cannot slip in unannounced.

Used by ``test_decoding_contract.py`` (attnkit.nn layers) and by
``tests/hf/test_decoding.py`` (attnkit.hf.use on a tiny Llama, with ``generate``).
"""

from __future__ import annotations

import torch
from torch.nn.parameter import UninitializedParameter

from attnkit.nn import Attention, LayerCache
from helpers import assert_close

#: what a mechanism needs in a causal decoder of 4 query heads, 2 kv heads, and the
#: sizes that make its sparse or approximate parts act on 20-token sequences
PARAMS = {
    "neighborhood": dict(kernel=5, causal=True, rpb=True),
    "top_theta": dict(thresholds=torch.zeros(4)),
    "topk": dict(k=4),
    "adaptive_span": dict(max_span=8, ramp=4),
    "hyper_attention": dict(min_seq_len=4, block_size=4, sample_size=4),
    "block_sparse": dict(block_size=4, last_q=4, vertical_size=2, slash_size=2, sink_tokens=1, local_tokens=2),
    "nsa": dict(compress_block=4, compress_stride=2, select_block=4, num_selected=3, window=4),
}

#: mechanisms whose rows depend on the other queries of the call: no cached decoding
NO_CACHE = {"block_sparse", "hyper_attention"}

#: the model's context length (sigmoid's n, cosFormer's horizon M)
CONTEXT = 64

#: a prefill, then single tokens, a chunk of 3, single tokens
CHUNKS = (7, 1, 1, 3, 1, 1, 1, 5)
N = sum(CHUNKS)


def perturb(module: torch.nn.Module, seed: int = 0) -> None:
    """Move every learned parameter off its initial value, so that parts that start as the
    identity (talking heads, multi-token convolutions, decays) take part in the check."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if not isinstance(p, UninitializedParameter) and p.is_floating_point():
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))


def layer_for(name: str, mechanism=None, **kw) -> Attention:
    """A float64 causal GQA layer with RoPE running ``name`` (or the ``mechanism`` object)."""
    torch.manual_seed(0)
    layer = Attention(
        32,
        4,
        n_kv_heads=2,
        mechanism=mechanism if mechanism is not None else name,
        mechanism_params={} if mechanism is not None else dict(PARAMS.get(name, {})),
        rope=True,
        context=CONTEXT,
        **kw,
    ).double()
    perturb(layer.mechanism)
    return layer


def inputs(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, N, 32, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def decode(layer: Attention, x: torch.Tensor, chunks=CHUNKS) -> torch.Tensor:
    cache, outs, start = LayerCache(), [], 0
    for n in chunks:
        outs.append(layer(x[:, start : start + n], cache=cache))
        start += n
    assert cache.length == start
    return torch.cat(outs, dim=1)


def prefix_agrees(layer: Attention, x: torch.Tensor, lengths=(1, 5, 12)) -> None:
    """The first n rows of the full call equal a call on the first n tokens."""
    with torch.no_grad():
        full = layer(x)
        for n in lengths:
            assert_close(layer(x[:, :n]), full[:, :n], msg=f"{layer.mechanism.name}: prefix of {n} tokens != full call")


def cached_agrees(layer: Attention, x: torch.Tensor) -> None:
    """Decoding chunk by chunk against a cache (or state) equals the full call."""
    with torch.no_grad():
        assert_close(decode(layer, x), layer(x), msg=f"{layer.mechanism.name}: cached decoding != full call")
