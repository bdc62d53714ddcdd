"""Prefill and one training step of a tiny random Llama with its sequence sharded over ranks.

    torchrun --nproc-per-node 2 examples/context_parallel_llama.py

Every rank builds the same model (same seed), feeds its zigzag shard of input_ids with
the global position_ids of those tokens, and gets its shard of the logits; rank 0 checks
the gathered logits and a weight gradient against the whole sequence in one process.
gloo runs on CPU; on GPUs use backend="nccl" and move the model to the rank's device.
"""

import torch
import torch.distributed as dist
import transformers as T

import attnkit.distributed as cp
import attnkit.hf


def main(n_tokens: int = 37) -> None:
    dist.init_process_group("gloo")
    config = T.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config).double()
    ids = torch.randint(0, 97, (1, n_tokens), generator=torch.Generator().manual_seed(1))

    with attnkit.hf.use(model, context_parallel=dist.group.WORLD):
        logits = model(cp.shard(ids, 1), position_ids=cp.positions(n_tokens)[None], use_cache=False).logits
    whole = cp.unshard(logits, 1)
    # training: each rank back-propagates its share of the loss; weight gradients are
    # summed over the group as data parallelism does
    (logits.square().sum() / whole.numel()).backward()
    grad = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
    dist.all_reduce(grad)

    if dist.get_rank() == 0:
        model.zero_grad()
        with attnkit.hf.use(model):
            ref = model(ids, use_cache=False).logits
        ref.square().mean().backward()
        ref_grad = model.model.layers[0].self_attn.q_proj.weight.grad
        print(f"{dist.get_world_size()} ranks, {n_tokens} tokens: max |logits - single process| = "
              f"{(whole - ref).abs().max().item():.2e}, max |grad diff| = {(grad - ref_grad).abs().max().item():.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
