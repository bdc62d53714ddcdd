"""Tiny random-init transformers models built from configs (nothing is downloaded)."""

import torch
import transformers as T

VOCAB = 97
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

# Sliding windows (5) are shorter than the test sequences (14 tokens), so dropping one
# would change the outputs.
CONFIGS = {
    "llama": lambda: T.LlamaConfig(**_COMMON),
    "mistral": lambda: T.MistralConfig(**_COMMON, sliding_window=5),
    "qwen2": lambda: T.Qwen2Config(
        **_COMMON,
        use_sliding_window=True,
        sliding_window=5,
        max_window_layers=1,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
    ),
    "gemma2": lambda: T.Gemma2Config(
        **_COMMON, head_dim=16, sliding_window=5, attn_logit_softcapping=2.0, query_pre_attn_scalar=24
    ),
    "qwen3": lambda: T.Qwen3Config(**_COMMON, head_dim=16),
    "gemma3": lambda: T.Gemma3TextConfig(
        **_COMMON, head_dim=16, sliding_window=5, layer_types=["sliding_attention", "full_attention", "sliding_attention"]
    ),
    "gpt_oss": lambda: T.GptOssConfig(**_COMMON, head_dim=16, sliding_window=5, num_local_experts=2, num_experts_per_tok=1),
    "gpt2": lambda: T.GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=3,
        n_head=4,
        n_positions=256,
        scale_attn_by_inverse_layer_idx=True,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "bert": lambda: T.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=256,
    ),
}
DECODERS = [n for n in CONFIGS if n != "bert"]


def build(name: str, attn_implementation: str = "eager"):
    torch.manual_seed(0)
    config = CONFIGS[name]()
    if name == "bert":
        config._attn_implementation = attn_implementation
        model = T.BertModel(config)
    else:
        model = T.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    with torch.no_grad():
        if name == "gpt_oss":
            # Random-init sinks are zeros; make them matter.
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()
        if name == "gemma2":
            # Random-init logits are ~1e-3; scale the queries so the softcap (2.0) bites.
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(100.0)
    return model.eval()


def outputs(model, *args, **kwargs) -> torch.Tensor:
    out = model(*args, **kwargs)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") and not hasattr(out, "logits") else out.logits
