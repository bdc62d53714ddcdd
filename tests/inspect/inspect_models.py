"""Tiny random transformers models built from configs (nothing is downloaded), and a
tokenizer for them built from a word list."""

from __future__ import annotations

import torch
import transformers as T

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [
    w
    for w in (
        "the a lighthouse keeper wrote every night about ships birds weather fog bell lamp sea wind calm "
        "< > script document body data pwned / ' ( ) = . , 1 2 3 4 5 6 7 8 9 0 set attribute"
    ).split()
]


def tokenizer(tmp_path):
    """A WordPiece (BERT) tokenizer over ``WORDS``, saved in ``tmp_path``."""
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(dict.fromkeys(WORDS)) + "\n")
    return T.BertTokenizer(str(vocab), do_lower_case=True)


def llama(layers=2, heads=4, kv_heads=2, hidden=32, positions=256, vocab=len(WORDS), seed=0):
    torch.manual_seed(seed)
    config = T.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
    )
    model = T.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random-init logits are tiny: sharpen them so heads differ
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
    return model


def bert(layers=2, heads=4, hidden=32, positions=256, vocab=len(WORDS), seed=0):
    torch.manual_seed(seed)
    config = T.BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        max_position_embeddings=positions,
    )
    return T.BertModel(config).eval()


def saved(model, tok, path):
    """A model directory as ``from_pretrained`` reads it."""
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
