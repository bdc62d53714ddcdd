"""bfloat16 over N = 16384 random tokens: no NaN or inf in outputs, states or gradients.

Fast linear-attention kernels elsewhere have shipped NaN bugs (fla issues #99, #111, #122:
WY-representation and gate overflow in half precision); here every form computes in
float32 from bfloat16 inputs, and decays are exponentiated only where they cannot
overflow. Inputs at unit scale, and at 30x (large logits, strong data-dependent gates)
for the mechanisms with exponential features, gates or the delta rule.
"""

import pytest
import torch

import attnkit as ak
from attnkit.mechanisms import get_mechanism
from attnkit.mechanisms.linear import NAMED, CosReweight

# Large inputs where something can overflow: exp-like features, gates, the delta rule.
CASES = [(name, 1.0) for name in NAMED] + [
    (name, 30.0) for name in ("based", "performer", "fast_weight", "deltanet", "gla", "gated_deltanet")
]


@pytest.mark.slow
@pytest.mark.parametrize("name,magnitude", CASES)
def test_bfloat16_long_sequence_is_finite(name, magnitude):
    B, H, N, D = 1, 2, 16384, 8
    gen = torch.Generator().manual_seed(0)
    q, k, v = ((magnitude * torch.randn(B, H, N, D, generator=gen)).bfloat16().requires_grad_() for _ in range(3))
    extra = {"short_conv": 4} if name == "based" else {"feature_map": CosReweight(N)} if name == "cosformer" else {}
    mech = get_mechanism(name, **extra)
    if name in ("gla", "gated_deltanet"):
        with torch.no_grad():
            mech(q[:, :, :2], k[:, :, :2], v[:, :, :2], mask=ak.causal())  # materialise the gate weights
            for p in mech.decay.parameters():
                p.normal_(generator=gen)  # trained-looking, data-dependent gates
    out, state = mech(q, k, v, mask=ak.causal(), return_state=True)
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out).all() and torch.isfinite(state.memory).all()
    (out.float().square().mean() + state.memory.square().mean()).backward()
    for t in (q, k, v, *mech.parameters()):
        assert torch.isfinite(t.grad).all()
