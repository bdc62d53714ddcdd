"""attnkit.hf.use(model, context_parallel=group) in one process (a group of one rank):
the switch's wiring and its refusals; tests/distributed/cp_worker.py checks 2 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import attnkit.distributed as cp
import attnkit.hf

T = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def group():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _model():
    config = T.MistralConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        sliding_window=3,
    )
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(config).double().eval()


def test_sharded_logits_equal_the_plain_switch(group):
    model = _model()
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(0))
    with attnkit.hf.use(model):
        ref = model(ids, use_cache=False).logits
    with attnkit.hf.use(model, context_parallel=group):
        got = model(cp.shard(ids, 1), position_ids=cp.positions(9)[None], use_cache=False).logits
    torch.testing.assert_close(cp.unshard(got, 1), ref, atol=1e-12, rtol=1e-12)


def test_padding_and_caches_are_refused(group):
    model = _model()
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(0))
    pad = torch.tensor([[1, 1, 1, 1, 0, 0]])
    with attnkit.hf.use(model, context_parallel=group):
        with pytest.raises(ValueError, match="attention_mask: context_parallel takes unpadded shards"):
            model(ids, attention_mask=pad, use_cache=False)
    with pytest.raises(ValueError, match="layout: expected 'zigzag' or 'contiguous'"):
        with attnkit.hf.use(model, context_parallel=group, context_layout="striped"):
            pass
