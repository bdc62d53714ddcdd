"""Helpers for mechanisms that torch.compile builds inside the graph it traces.

``attnkit.attention(q, k, v, mechanism="name")`` builds the mechanism inside the call, so
under ``torch.compile`` its constructor runs in the traced region. Dynamo refuses to
construct an ``nn.Parameter`` there, and a parameter of an object discarded at the end of
the call could not be trained anyway: such a mechanism holds its initial weights as
plain tensors. Everywhere else they are parameters as usual.
"""

from __future__ import annotations

import torch
from torch import nn


def learnable(t: torch.Tensor) -> torch.Tensor:
    """``nn.Parameter(t)``, or ``t`` itself while torch.compile traces the constructor."""
    return t if torch.compiler.is_compiling() else nn.Parameter(t)
