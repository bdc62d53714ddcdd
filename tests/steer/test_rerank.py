"""Attention-based re-ranking: the query-row attention read against the cached context
equals eager attention; ICR scores equal a literal float64 computation of the paper's
formula on the whole prompt; sorting and basin orders follow their rules; a planted
relevant document; bad input."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "probes"))
from tiny_models import build  # noqa: E402
from wordlevel import tiny_llama, word_tokenizer  # noqa: E402

from attnkit.steer.query_rows import prefill, query_key_mass  # noqa: E402
from attnkit.steer.rerank import basin_order, basin_slots, rerank  # noqa: E402
from helpers import TOL  # noqa: E402

DENSE = "attnkit_test_rerank_dense"
WEIGHTS: list = []

DOCS = ["the sky is blue .", "red tiger opens door", "the grass is green .", "silver falcon", "quiet otter"]
QUERY = "What opens the door ?"


def dense(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """softmax(scale q k^T + mask) in float64, written out; the weights are recorded."""
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1).double()
    v = value.repeat_interleave(groups, dim=1).double()
    s = query.double() @ k.transpose(-1, -2) * scaling
    if attention_mask is not None:
        s = s + attention_mask.double()
    a = torch.softmax(s, dim=-1)
    WEIGHTS.append(a)
    return (a @ v).to(query.dtype).transpose(1, 2).contiguous(), a


@pytest.fixture(scope="module")
def subject():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(DENSE, dense)
    AttentionMaskInterface.register(DENSE, eager_mask)
    tok = word_tokenizer(extra=["N/A"])
    return tiny_llama(len(tok)).double(), tok


def words(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def dense_per_token(model, ids, n_context, last_only=False):
    """Sum over layers and heads of the mean weight of the query rows (positions >=
    n_context, or only the last) on each key, from one dense float64 forward of ``ids``."""
    WEIGHTS.clear()
    impl = model.config._attn_implementation
    model.set_attn_implementation(DENSE)
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        model.set_attn_implementation(impl)
    lo = len(ids) - 1 if last_only else n_context
    return sum(a[0, :, lo:, :].mean(1).sum(0) for a in WEIGHTS)


def literal_icr(real, calib, spans):
    """ICR (arXiv 2410.02642): per document, calibrated token scores real - calib, tokens
    below mean - 2 std (unbiased) dropped, the rest summed."""
    out = []
    for a, b in spans:
        c = [real[j].item() - calib[j].item() for j in range(a, b)]
        mean = sum(c) / len(c)
        std = (sum((x - mean) ** 2 for x in c) / (len(c) - 1)) ** 0.5 if len(c) > 1 else 0.0
        out.append(sum(x for x in c if x >= mean - 2 * std))
    return out


def context(tok, docs, prefix, separator):
    ids, spans = words(tok, prefix), []
    for doc in docs:
        d = words(tok, doc)
        spans.append((len(ids), len(ids) + len(d)))
        ids += d + words(tok, separator)
    return ids, spans


# -- query rows against the cache -----------------------------------------------------------


@pytest.mark.parametrize(
    "name, last_only, n_ctx",
    [("llama", False, 17), ("llama", True, 17), ("qwen3", False, 17), ("gpt2", False, 17), ("llama", False, 240)],
)  # 240: many key tiles
def test_query_rows_against_the_cache_equal_eager_output_attentions(name, last_only, n_ctx):
    model = build(name)  # float32, eager; llama and qwen3: GQA 4 query / 2 key-value heads
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (n_ctx + 6,), generator=g).tolist()
    got = query_key_mass(model, prefill(model, ids[:n_ctx]), n_ctx, ids[n_ctx:], last_only=last_only)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True)
    lo = len(ids) - 1 if last_only else n_ctx
    want = sum(a[0, :, lo:, :].double().mean(1).sum(0) for a in out.attentions)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_the_cache_is_left_holding_the_context_only():
    model = build("llama")
    ids = list(range(1, 15))
    cache = prefill(model, ids)
    first = query_key_mass(model, cache, len(ids), [20, 21, 22])
    assert cache.get_seq_length() == len(ids)  # the pass ran on a copy
    again = query_key_mass(model, cache, len(ids), [20, 21, 22])
    torch.testing.assert_close(first, again, rtol=0, atol=0)


def test_a_sliding_window_cache_is_refused_naming_layers():
    model = build("mistral")  # window 5: the cache keeps only the window, key indices are not positions
    ids = list(range(1, 15))
    with pytest.raises(ValueError, match="^layers: "):
        query_key_mass(model, prefill(model, ids), len(ids), [20, 21])


# -- ICR against the literal formula ----------------------------------------------------------


@pytest.mark.parametrize("prefix, separator", [("", "\n\n"), ("Read text below :", " - ")])
def test_icr_scores_equal_the_literal_float64_formula(subject, prefix, separator):
    model, tok = subject
    ids, spans = context(tok, DOCS, prefix, separator)
    real = dense_per_token(model, ids + words(tok, QUERY), len(ids))
    calib = dense_per_token(model, ids + words(tok, "N/A"), len(ids))
    want = literal_icr(real, calib, spans)
    order, scores = rerank(model, tok, QUERY, DOCS, prefix=prefix, separator=separator)
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(want), **TOL[torch.float64])
    assert order == sorted(range(len(DOCS)), key=lambda i: -want[i])
    # the uncalibrated variant: the query's attention summed over each document
    order, scores = rerank(model, tok, QUERY, DOCS, prefix=prefix, separator=separator, calibrate=False)
    raw = [real[a:b].sum().item() for a, b in spans]
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(raw), **TOL[torch.float64])
    assert order == sorted(range(len(DOCS)), key=lambda i: -raw[i])


def test_a_tokenizer_that_adds_bos_gets_it_once_at_the_start(subject):
    from tokenizers.processors import TemplateProcessing

    from attnkit.steer.rerank import build_context

    model, tok = subject
    bos_tok = word_tokenizer(extra=["N/A"], bos=True)
    bos = bos_tok.convert_tokens_to_ids("<s>")
    bos_tok._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    assert bos_tok("sky")["input_ids"] == [bos, bos_tok.convert_tokens_to_ids("sky")]  # as Llama's tokenizer does
    ids, spans = build_context(bos_tok, DOCS)
    plain_ids, plain_spans = context(tok, DOCS, "", "\n\n")
    assert ids == [bos] + plain_ids and spans == [(a + 1, b + 1) for a, b in plain_spans]
    real = dense_per_token(model, ids + words(tok, QUERY), len(ids))
    calib = dense_per_token(model, ids + words(tok, "N/A"), len(ids))
    _, scores = rerank(model, bos_tok, QUERY, DOCS)
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(literal_icr(real, calib, spans)), **TOL[torch.float64])


def test_icr_on_chosen_layers_and_heads_sums_only_those(subject):
    model, tok = subject
    ids, spans = context(tok, DOCS, "", "\n\n")
    WEIGHTS.clear()
    dense_per_token(model, ids + words(tok, QUERY), len(ids))
    real = WEIGHTS[1][0, [0, 3], len(ids) :, :].mean(1).sum(0)
    _, scores = rerank(model, tok, QUERY, DOCS, calibrate=False, layers=[1], heads=[0, 3])
    raw = [real[a:b].sum().item() for a, b in spans]
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(raw), **TOL[torch.float64])


def test_icr_query_template_wraps_the_query_and_the_calibration_alike(subject):
    model, tok = subject
    ids, spans = context(tok, DOCS, "", "\n\n")
    real = dense_per_token(model, ids + words(tok, "Question : " + QUERY + " Answer :"), len(ids))
    calib = dense_per_token(model, ids + words(tok, "Question : N/A Answer :"), len(ids))
    _, scores = rerank(model, tok, QUERY, DOCS, query_template="Question : {query} Answer :")
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(literal_icr(real, calib, spans)), **TOL[torch.float64])


# -- sorting and basin: their rules ------------------------------------------------------------


def test_sorting_one_round_puts_documents_in_ascending_order_of_last_row_attention(subject):
    model, tok = subject
    ids, spans = context(tok, DOCS, "", "\n\n")
    last = dense_per_token(model, ids + words(tok, QUERY), len(ids), last_only=True)
    received = [last[a:b].sum().item() for a, b in spans]
    order, scores = rerank(model, tok, QUERY, DOCS, method="sorting", rounds=1)
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(received), **TOL[torch.float64])
    assert order == sorted(range(len(DOCS)), key=lambda i: received[i])  # highest last
    assert order[-1] == max(range(len(DOCS)), key=lambda i: received[i])


def test_sorting_rounds_measure_the_sorted_context_again(subject):
    model, tok = subject
    order1, _ = rerank(model, tok, QUERY, DOCS, method="sorting", rounds=1)
    order, scores = rerank(model, tok, QUERY, DOCS, method="sorting", rounds=2)
    # round 2 measures the arrangement of round 1 (unless it was already a fixed point)
    ids, spans = context(tok, [DOCS[i] for i in order1], "", "\n\n")
    last = dense_per_token(model, ids + words(tok, QUERY), len(ids), last_only=True)
    received = {doc: last[a:b].sum().item() for doc, (a, b) in zip(order1, spans)}
    torch.testing.assert_close(torch.tensor(scores), torch.tensor([received[i] for i in range(len(DOCS))]), **TOL[torch.float64])
    assert order == sorted(order1, key=lambda i: received[i])


def test_basin_slots_and_order_by_hand():
    assert basin_slots(1) == [0]
    assert basin_slots(4) == [0, 3, 1, 2]
    assert basin_slots(5) == [0, 4, 1, 3, 2]
    # ranking r0 > r1 > ... goes to slots first, last, second, second to last, middle
    assert basin_order(["r0", "r1", "r2", "r3", "r4"]) == ["r0", "r2", "r4", "r3", "r1"]
    assert basin_order(["a", "b", "c"], positions=[2, 1, 0]) == ["c", "b", "a"]


def test_slot_attention_is_the_mean_per_slot_attention_over_the_calibration_set(subject):
    from attnkit.steer.rerank import basin_slots_from, slot_attention

    model, tok = subject
    examples = [(QUERY, DOCS), ("Which does open ?", DOCS[::-1]), ("What is green ?", DOCS[1:] + DOCS[:1])]
    want = [0.0] * len(DOCS)
    for query, docs in examples:
        ids, spans = context(tok, docs, "", "\n\n")
        per_token = dense_per_token(model, ids + words(tok, query), len(ids))
        for slot, (a, b) in enumerate(spans):
            want[slot] += per_token[a:b].sum().item() / len(examples)
    got = slot_attention(model, tok, examples)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL[torch.float64])
    assert basin_slots_from(got) == sorted(range(len(DOCS)), key=lambda i: -want[i])
    with pytest.raises(ValueError, match="^examples: example 1 has 4 documents, the first has 5"):
        slot_attention(model, tok, [(QUERY, DOCS), (QUERY, DOCS[:4])])
    with pytest.raises(ValueError, match="^examples: expected a non-empty list"):
        slot_attention(model, tok, [])


def test_basin_places_the_icr_ranking_at_both_ends(subject):
    model, tok = subject
    ranked, icr_scores = rerank(model, tok, QUERY, DOCS)
    order, scores = rerank(model, tok, QUERY, DOCS, method="basin")
    assert scores == icr_scores
    assert order[0] == ranked[0] and order[-1] == ranked[1] and order[1] == ranked[2] and order[-2] == ranked[3]
    assert order[2] == ranked[4]
    order, _ = rerank(model, tok, QUERY, DOCS, method="basin", positions=[2, 0, 1, 3, 4])
    assert order[2] == ranked[0] and order[0] == ranked[1] and order[4] == ranked[4]


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(documents=[]), "^documents: expected at least one document"),
        (dict(documents="one text"), "^documents: expected a list"),
        (dict(documents=["ok", ""]), "^documents: document 1 must be a non-empty string"),
        (dict(documents=["ok", "   "]), "^documents: document 1 must be a non-empty string"),
        (dict(method="bm25"), "^method: expected one of icr, sorting, basin, got 'bm25'"),
        (dict(query=""), "^query: expected a non-empty string"),
        (dict(rounds=0), "^rounds: expected an int >= 1"),
        (dict(calibration=""), "^calibration: expected a non-empty"),
        (dict(query_template="no placeholder"), "^query_template: expected a string containing"),
        (dict(method="basin", positions=[0, 0, 1, 2, 3]), "^positions: expected a permutation of 0..4"),
        (dict(layers=[2]), r"^layers: expected None or a non-empty list of indices below 2, got \[2\]"),
        (dict(heads=[0, 4]), "^heads: expected None or a non-empty list of indices below 4"),
        (dict(layers=[]), "^layers: expected None or a non-empty list"),
    ],
)
def test_bad_input_names_the_argument(subject, kwargs, message):
    model, tok = subject
    args = dict(query=QUERY, documents=DOCS) | kwargs
    with pytest.raises(ValueError, match=message):
        rerank(model, tok, args.pop("query"), args.pop("documents"), **args)


def test_a_prompt_longer_than_the_model_reads_is_refused(subject):
    model, tok = subject  # 512 positions
    with pytest.raises(ValueError, match="^documents: the prompt .* has 545 tokens, more than the 512 positions"):
        rerank(model, tok, QUERY, DOCS * 30)
    with pytest.raises(ValueError, match="^documents: the prompt .* more than the 512 positions"):
        rerank(model, tok, QUERY, DOCS * 30, method="sorting")


def test_models_that_cannot_rerank_get_a_clear_error(subject):
    import transformers as T

    _, tok = subject
    mpnet = T.MPNetModel(
        T.MPNetConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    )
    with pytest.raises(ValueError, match="^model: MPNetModel does not route its attention"):
        rerank(mpnet, tok, QUERY, DOCS)
    bert = build("bert")
    with pytest.raises(ValueError, match="^model: re-ranking reads a causal language model"):
        rerank(bert, tok, QUERY, DOCS)
    with pytest.raises(ValueError, match="^model: expected a transformers model"):
        rerank(torch.nn.Linear(2, 2), tok, QUERY, DOCS)


def test_the_model_is_restored_after_reranking(subject):
    model, tok = subject
    impl = model.config._attn_implementation
    ids = torch.tensor([words(tok, QUERY)])
    with torch.no_grad():
        before = model(ids).logits
    rerank(model, tok, QUERY, DOCS)
    rerank(model, tok, QUERY, DOCS, method="sorting")
    assert model.config._attn_implementation == impl
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)


# -- behaviour: a planted relevant document ---------------------------------------------------


def test_icr_ranks_the_queried_pair_first_more_often_than_uncalibrated_on_the_trained_needle_model(needle_export):
    """The needle-32 organism (the needle_export fixture) matches keys: it finds the
    queried key's value among 3 distractor pairs. Documents here are key-value pairs in
    the task's format ("k v" among filler tokens); the relevant one holds the queried key
    and is short ("k v" alone), the three others hold other pairs among 6 filler tokens.
    Longer documents collect more attention whatever the query (a query-independent
    pull), which the uncalibrated sum counts and ICR's content-free query ("Q f0", a
    query of the task's form naming no key) subtracts. 28 tokens: the trained length."""
    import random

    from attnkit.probes import load_probe_model

    pm = load_probe_model(needle_export)
    rng = random.Random(0)
    found = {"icr": 0, "raw": 0}
    samples = 30
    for _ in range(samples):
        keys, values = rng.sample(range(8), 4), rng.sample(range(8), 4)
        docs = []
        for i in range(4):
            tokens = [f"f{rng.randrange(8)}" for _ in range(2 if i == 0 else 8)]
            cell = rng.randrange(len(tokens) // 2)
            tokens[2 * cell : 2 * cell + 2] = [f"k{keys[i]}", f"v{values[i]}"]
            docs.append(" ".join(tokens))
        order = rng.sample(range(4), 4)
        texts, target = [docs[i] for i in order], order.index(0)
        query = f"Q k{keys[0]}"
        icr, _ = rerank(pm, None, query, texts, separator=" ", calibration="Q f0")
        raw, _ = rerank(pm, None, query, texts, separator=" ", calibrate=False)
        found["icr"] += icr[0] == target
        found["raw"] += raw[0] == target
    assert found["icr"] >= 0.9 * samples and found["icr"] > found["raw"], found


def test_icr_and_sorting_find_the_queried_pair_among_equal_documents(needle_export):
    """Documents of equal length, four holding key-value pairs: ICR ranks the queried one
    first and attention sorting puts it last (nearest the question)."""
    import random

    from attnkit.probes import load_probe_model

    pm = load_probe_model(needle_export)
    rng = random.Random(1)
    found = {"icr": 0, "sorting": 0}
    samples = 12
    for _ in range(samples):
        docs = [[f"f{rng.randrange(8)}" for _ in range(4)] for _ in range(7)]
        holders, keys, values = rng.sample(range(7), 4), rng.sample(range(8), 4), rng.sample(range(8), 4)
        for d, k, v in zip(holders, keys, values):
            cell = rng.randrange(2)
            docs[d][2 * cell : 2 * cell + 2] = [f"k{k}", f"v{v}"]
        texts = [" ".join(d) for d in docs]
        icr, _ = rerank(pm, None, f"Q k{keys[0]}", texts, separator=" ", calibration="Q f0")
        arranged, _ = rerank(pm, None, f"Q k{keys[0]}", texts, separator=" ", method="sorting", rounds=1)
        found["icr"] += icr[0] == holders[0]
        found["sorting"] += arranged[-1] == holders[0]
    assert found["icr"] >= samples - 1 and found["sorting"] >= samples - 1, found


WORDS = ["<pad>", "N/A", "B"] + [f"w{i}" for i in range(21)]


def built_retriever(pull: float):
    """A one-layer GPT-2 built by hand (no positions; token i embedded as the i-th unit
    vector): queries and keys are both the layer-normed embedding, so a query token
    attends to the keys of the same token (retrieval by content), and a query bias along
    token "B"'s key adds a pull towards every "B" whatever the query: the
    query-independent attention (sinks, positional and length biases) that ICR's
    content-free calibration is there to remove."""
    import transformers as T
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>")
    d = 32
    model = T.GPT2LMHeadModel(
        T.GPT2Config(vocab_size=len(WORDS), n_embd=d, n_layer=1, n_head=1, n_positions=64, bos_token_id=None, eos_token_id=None)
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.transformer.wte.weight.copy_(torch.eye(d)[: len(WORDS)])
        for norm in (model.transformer.h[0].ln_1, model.transformer.h[0].ln_2, model.transformer.ln_f):
            norm.weight.fill_(1.0)
        attn = model.transformer.h[0].attn
        attn.c_attn.weight[:, :d] = torch.eye(d)  # queries
        attn.c_attn.weight[:, d : 2 * d] = torch.eye(d)  # keys
        attn.c_attn.bias[:d] = pull * torch.nn.functional.layer_norm(torch.eye(d)[WORDS.index("B")], (d,))
    return model, tok


def test_icr_ranks_the_planted_document_first_more_often_than_uncalibrated():
    import random

    model, tok = built_retriever(pull=1.1)
    rng = random.Random(0)
    found = {"icr": 0, "raw": 0}
    samples = 30
    for _ in range(samples):
        key = rng.randrange(3, len(WORDS))
        others = [w for w in WORDS[3:] if w != WORDS[key]]
        target, docs = rng.randrange(5), []
        for i in range(5):
            words_ = [rng.choice(others) for _ in range(4)]
            words_[rng.randrange(4)] = WORDS[key] if i == target else "B"  # the query's word, or the pull
            docs.append(" ".join(words_))
        icr, _ = rerank(model, tok, WORDS[key], docs)
        raw, _ = rerank(model, tok, WORDS[key], docs, calibrate=False)
        found["icr"] += icr[0] == target
        found["raw"] += raw[0] == target
    assert found["icr"] == samples and found["raw"] <= samples // 2, found
