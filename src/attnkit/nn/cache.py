"""What attention layers keep between decoding calls.

One ``LayerCache`` per layer holds either growing tensors along the sequence — keys and
values for softmax-like mechanisms, the compressed latent and rotary key for MLA — or,
for mechanisms with ``recurrent = True`` (linear attention), the fixed-size state the
mechanism returns (``mech(..., initial_state=state, return_state=True)``). Either way the
layer asks the same object, and ``length`` counts the tokens seen, which is where the
next token's position starts. A mechanism with ``cache_state = True`` also keeps what
its earlier queries leave behind in ``decode_state``, beside its keys and values
(selective attention: the selection F per cached key; multi-token attention: the last
queries its convolution looks back to), batch rows first.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


class LayerCache:
    """One layer's decoding memory: named sequence tensors (..., N, D) or a recurrent state."""

    def __init__(self):
        self.tensors: dict[str, Tensor] = {}
        self.state = None
        #: what a ``cache_state`` mechanism returned after the cached tokens (batch first), or None
        self.decode_state: Tensor | None = None
        self.length = 0

    def extend(self, **new: Tensor) -> dict[str, Tensor]:
        """Append ``new`` tensors along their sequence dim (-2); return the full ones."""
        if self.state is not None:
            raise ValueError("cache: this layer holds a recurrent state; it cannot also hold keys and values")
        if self.tensors and set(new) != set(self.tensors):
            raise ValueError(f"cache: expected tensors named {sorted(self.tensors)}, got {sorted(new)}")
        steps = {t.shape[-2] for t in new.values()}
        if len(steps) != 1:
            raise ValueError(f"cache: new tensors disagree on the number of tokens: {sorted(steps)}")
        for name, t in new.items():
            old = self.tensors.get(name)
            self.tensors[name] = t if old is None else torch.cat((old, t), dim=-2)
        self.length += steps.pop()
        return dict(self.tensors)

    def set_state(self, state, tokens: int) -> None:
        """Replace the recurrent state after ``tokens`` more tokens."""
        if self.tensors:
            raise ValueError("cache: this layer holds keys and values; it cannot also hold a recurrent state")
        self.state = state
        self.length += tokens

    def select(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (beam search reordering, dropping finished rows)."""
        self.tensors = {k: t.index_select(0, index.to(t.device)) for k, t in self.tensors.items()}
        if self.decode_state is not None:
            self.decode_state = self.decode_state.index_select(0, index.to(self.decode_state.device))
        if self.state is not None:
            self.state = self.state.select(index)

    def __repr__(self):
        held = (
            "state" if self.state is not None else ", ".join(f"{k} {tuple(t.shape)}" for k, t in self.tensors.items()) or "empty"
        )
        return f"LayerCache({self.length} tokens: {held})"


class Cache:
    """The decoding memory of a whole model: one LayerCache per layer."""

    def __init__(self, n_layers: int):
        self.layers = [LayerCache() for _ in range(n_layers)]

    def __getitem__(self, i: int) -> LayerCache:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def length(self) -> int:
        """Tokens seen so far (the position of the next one)."""
        return self.layers[0].length if self.layers else 0

    def select(self, index: Tensor) -> None:
        for layer in self.layers:
            layer.select(index)
