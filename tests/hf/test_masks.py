"""transformers mask requests -> attnkit masks, checked against transformers' own
``sdpa_mask`` (the tensor its sdpa backend would have used) on every kind of request:
offsets of dynamic, sliding and static caches, padding, and/or compositions, packed
sequences, and functions attnkit does not recognise."""

import pytest
import torch
from transformers import masking_utils as M

from attnkit.hf.masks import FunctionMask, KeyMask, mask_spec, tensor_to_attnkit, to_attnkit
from attnkit.mods import EMPTY, TileGrid


def dense(mask, B, q_len, k_len):
    if mask is None:
        return torch.ones(B, 1, q_len, k_len, dtype=torch.bool)
    return mask.dense(B, 1, q_len, k_len).expand(B, 1, q_len, k_len)


def check(B, q_len, kv_length, q_offset, kv_offset, fn, attention_mask=None, k_len=None, use_vmap=False):
    """attnkit's mask equals transformers' on the keys the layer holds (k_len of them)."""
    k_len = kv_length if k_len is None else k_len
    want = M.sdpa_mask(
        B,
        q_len,
        kv_length,
        q_offset,
        kv_offset,
        mask_function=fn,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        use_vmap=use_vmap,
    )
    spec = mask_spec(B, q_len, kv_length, q_offset, kv_offset, mask_function=fn, attention_mask=attention_mask, use_vmap=use_vmap)
    mask = to_attnkit(spec, q_len, k_len)
    assert torch.equal(dense(mask, B, q_len, k_len), want[..., :k_len].expand(B, 1, q_len, k_len))
    return mask


def padding(B, n, left):
    am = torch.ones(B, n, dtype=torch.bool)
    am[1, :left] = False
    return am


@pytest.mark.parametrize(
    "q_len, kv_length, q_offset, kv_offset",
    [
        (12, 12, 0, 0),  # prefill
        (1, 13, 12, 0),  # decoding against a dynamic cache
        (3, 15, 12, 0),  # chunked prefill
        (1, 5, 20, 16),  # a sliding-window cache that dropped old keys
    ],
)
@pytest.mark.parametrize("kind", ["causal", "sliding", "bidirectional", "causal+pad", "sliding+pad"])
def test_structured_masks_equal_transformers(q_len, kv_length, q_offset, kv_offset, kind):
    fn = {
        "causal": M.causal_mask_function,
        "sliding": M.sliding_window_causal_mask_function(4),
        "bidirectional": M.bidirectional_mask_function,
    }[kind.split("+")[0]]
    am = padding(2, kv_offset + kv_length, 3) if kind.endswith("pad") else None
    mask = check(2, q_len, kv_length, q_offset, kv_offset, fn, am)
    assert not isinstance(mask, FunctionMask)  # read as structure: the kernels can skip tiles


def test_static_cache_with_a_negative_shift():
    # A static cache holds 16 slots; 5 tokens seen, 2 new: keys past position 6 are empty.
    check(1, 2, 16, 5, 0, M.causal_mask_function)
    check(1, 2, 16, 5, 0, M.sliding_window_causal_mask_function(3))


def test_causal_prefill_plans_skip_the_upper_triangle():
    mask = to_attnkit(mask_spec(1, 256, 256), 256, 256)
    grid = TileGrid(q_start=0, q_len=256, q_block=64, k_len=256, k_block=64)
    assert int((mask.classify(grid) == EMPTY).sum()) == 6


def test_or_and_compositions_and_unknown_functions():
    def even_keys(b, h, q, kv):
        return kv % 2 == 0

    check(2, 10, 10, 0, 0, M.or_masks(M.causal_mask_function, even_keys), padding(2, 10, 2), use_vmap=True)
    check(2, 10, 10, 0, 0, M.and_masks(M.sliding_window_causal_mask_function(3), even_keys))
    check(2, 1, 11, 10, 0, M.and_masks(M.causal_mask_function, even_keys), padding(2, 11, 2))
    mask = check(1, 1, 11, 10, 0, M.and_masks(M.causal_mask_function, even_keys))
    assert isinstance(mask.parts[1], FunctionMask)  # the known part stays structured


def test_packed_sequences():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4]])
    packed = M.find_packed_sequence_indices(position_ids)
    fn = M.and_masks(
        M.remap_positions_for_packed_sequence(M.causal_mask_function, position_ids), M.packed_sequence_mask_function(packed)
    )
    check(1, 10, 10, 0, 0, fn)


def test_key_mask_classifies_blocks_per_row():
    keep = torch.tensor([[True] * 8, [False] * 4 + [True] * 4])
    grid = TileGrid(q_start=0, q_len=8, q_block=4, k_len=8, k_block=4)
    states = KeyMask(keep).classify(grid)
    assert states.shape == (2, 2, 2)
    assert states[0].tolist() == [[2, 2], [2, 2]] and states[1].tolist() == [[0, 2], [0, 2]]
    with pytest.raises(ValueError, match=r"key mask: has shape \(2, 8\) but the call needs \(B, Nk\) = \(2, 9\)"):
        KeyMask(keep).check(2, 1, 8, 9)


def test_custom_4d_masks():
    keep = torch.rand(2, 1, 5, 7) > 0.3
    mask, bias = tensor_to_attnkit(keep)
    assert bias is None and torch.equal(mask.dense(2, 1, 5, 7), keep)
    additive = torch.where(keep, torch.randn(2, 1, 5, 7), torch.finfo(torch.float32).min)
    mask, bias = tensor_to_attnkit(additive)
    assert torch.equal(mask.dense(2, 1, 5, 7), keep)
    assert torch.equal(bias, torch.where(keep, additive, 0.0))
    with pytest.raises(ValueError, match="attention_mask: expected a 4-D tensor"):
        tensor_to_attnkit(torch.ones(2, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attention_mask: a 4-D mask must have shape"):
        mask.bind(2, 1, 5, 8)
