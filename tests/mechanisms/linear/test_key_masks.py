"""Key masks (padding): the recurrence skips the hidden keys, so a padded batch row gives
the same outputs and state as the same row without its padding."""

import pytest
import torch
from linear_cases import Recorder, dense_weights, qkv

import attnkit as ak
from attnkit.mechanisms import get_mechanism
from attnkit.mods import Mask
from helpers import assert_close

FORMS = ["reference", "parallel", "chunked", "recurrent"]
NAMES = ["linear_elu", "retnet", "gla", "gated_deltanet"]


class LeftPadding(Mask):
    """The first ``pad[b]`` keys of row b are padding (as in batched generation)."""

    key_only = True
    batch_dependent = True

    def __init__(self, pad):
        self.pad = torch.as_tensor(pad)

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx >= self.pad[b]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_right_padding_is_the_shorter_row(name, form, causal):
    mech = get_mechanism(name, chunk_size=4).double()
    N, lengths = 13, [13, 8]
    q, k, v = qkv(2, 2, 2, N, N, 4, 3)
    mask = ak.padding(torch.tensor(lengths))
    mask = ak.causal() & mask if causal else mask
    out, state = mech(q, k, v, mask=mask, backend=form, return_state=True)
    for b, n in enumerate(lengths):
        row = slice(b, b + 1)
        want, want_state = mech(
            q[row, :, :n] if causal else q[row],
            k[row, :, :n],
            v[row, :, :n],
            mask=ak.causal() if causal else None,
            backend="reference",
            return_state=True,
        )
        assert_close(out[row, :, :n] if causal else out[row], want)
        assert_close(state.memory[row], want_state.memory)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("form", FORMS)
def test_left_padding_is_the_shorter_row(name, form):
    mech = get_mechanism(name, chunk_size=4).double()
    N, pads = 11, [0, 5]
    q, k, v = qkv(2, 2, 2, N, N, 4, 3)
    out = mech(q, k, v, mask=ak.causal() & LeftPadding(pads), backend=form)
    for b, p in enumerate(pads):
        row = slice(b, b + 1)
        want = mech(q[row, :, p:], k[row, :, p:], v[row, :, p:], mask=ak.causal(), backend="reference")
        assert_close(out[row, :, p:], want)


@pytest.mark.parametrize("name", ["linear_elu", "gla", "gated_deltanet"])
def test_observers_see_no_weight_on_padding(name, monkeypatch):
    from attnkit.mechanisms.linear import observe

    monkeypatch.setattr(observe, "OBSERVE_K_BLOCK", 4)  # padding spans several key blocks
    q, k, v = qkv(2, 2, 2, 15, 15, 4, 3)
    rec = Recorder()
    out = ak.attention(q, k, v, mechanism=name, mask=ak.causal() & ak.padding(torch.tensor([15, 6])), observers=[rec])
    w, _ = dense_weights(rec, 2, 2, 15, 15)
    assert bool((w[1, :, :, 6:] == 0).all())
    assert_close(w @ v, out)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("form", FORMS)
def test_nan_in_padded_keys_stays_out(name, form):
    mech = get_mechanism(name, chunk_size=4).double()
    q, k, v = qkv(2, 2, 2, 10, 10, 4, 3)
    k, v = k.clone(), v.clone()
    k[1, :, 7:] = float("nan")
    v[1, :, 7:] = float("inf")
    mask = ak.causal() & ak.padding(torch.tensor([10, 7]))
    out = mech(q, k, v, mask=mask, backend=form, check_finite=False)
    assert torch.isfinite(out[:, :, :7]).all() and torch.isfinite(out[0]).all()
    want = mech(q[1:, :, :7], k[1:, :, :7], v[1:, :, :7], mask=ak.causal(), backend="reference")
    assert_close(out[1:, :, :7], want)
