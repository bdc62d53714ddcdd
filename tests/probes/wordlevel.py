"""A word-level tokenizer built in the test (no download), and a tiny random Llama whose
vocabulary it covers: enough to run natural-language probes end to end.

Words split on whitespace and punctuation, digits one by one (so any number encodes);
a word outside the vocabulary becomes ``<unk>``. Decoding joins tokens with spaces.
"""

from __future__ import annotations

import torch

from attnkit.probes.haystack import FILLER

EXTRA = (
    "secret code of the is What ? Answer : Question Read text below and answer value key current "
    'Extract JSON object corresponding Key Corresponding { } " , - a b c d e f updates stream last '
    "red blue green amber violet tiger otter falcon badger heron lynx maple cedar silver quiet rapid gentle brave "
    "beaver raven salmon gecko Some special codes are hidden in below Remember them question about one follows "
    "opens door Which does open Below stream per line each sets to new Only latest counts Find stored under that "
    "asked for keys values"
).split()


def vocabulary(extra=()) -> list[str]:
    words = ["<pad>", "<unk>", "<eos>", "<s>", *map(str, range(10)), ".", ":", "?", ",", "{", "}", '"', "-", "'"]
    for sentence in FILLER:
        words += sentence.replace(".", " ").split()
    words += list(EXTRA) + list(extra)
    return list(dict.fromkeys(words))


def word_tokenizer(extra=(), bos: bool = False, eos: bool = False):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(vocabulary(extra))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)])
    kwargs = dict(pad_token="<pad>", unk_token="<unk>")
    if eos:
        kwargs["eos_token"] = "<eos>"
    if bos:
        kwargs["bos_token"] = "<s>"
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
        **kwargs,
    )


def tiny_llama(vocab_size: int, max_positions: int = 512, seed: int = 0, sharpen: float = 8.0):
    """A random 2-layer Llama (4 query heads, 2 key-value heads) with eager attention; its
    queries are scaled by ``sharpen`` so attention is far from uniform (random-init logits
    are tiny) and a wrong span would change the measured masses."""
    import transformers as T

    torch.manual_seed(seed)
    config = T.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(sharpen)
    return model


def eager_generate(model, prompts, max_new_tokens):
    """Greedy tokens (B, T) from transformers' own generate, one unpadded prompt at a time."""
    rows = []
    for ids in prompts:
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None
        )
        rows.append(out[0, len(ids) :])
    return torch.stack(rows)


def eager_answer_mass(model, input_ids, tokens, spans_per_row):
    """Reference needle mass from transformers' eager attention: one teacher-forced
    forward of prompt + generated tokens with ``output_attentions``; for each batch row,
    layer and head, the mean over the answer's rows (the last prompt row and each
    generated row but the last token's) of the weights summed over that row's spans.

    ``spans_per_row``: for each batch row a list of (start, end) ranges, summed together.
    Returns (B, L, H) float64. Prompts must be unpadded (all of one length)."""
    input_ids = torch.as_tensor(input_ids)
    P = input_ids.shape[1]
    full = torch.cat([input_ids, tokens[:, :-1]], dim=1)
    with torch.no_grad():
        out = model(input_ids=full, output_attentions=True)
    weights = torch.stack(out.attentions).double()[:, :, :, P - 1 :]  # (L, B, H, rows, keys)
    result = []
    for b, spans in enumerate(spans_per_row):
        total = sum(weights[:, b, :, :, a:e].sum(-1) for a, e in spans)
        result.append(total.mean(-1))
    return torch.stack(result)


def char_tokenizer():
    """One token per character (printable ASCII and newline), decoded by joining: text
    round-trips exactly, so a test can parse prompts (JSON, lines) back with plain Python."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["<pad>", "<unk>", *dict.fromkeys(string.printable)]
    core = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )
