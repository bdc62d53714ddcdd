"""Haystack rules, checked by reading the prompts back as words with plain Python."""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wordlevel import word_tokenizer  # noqa: E402

from attnkit.probes.haystack import FILLER, Haystack, build_context, encode, fill, split_sentences  # noqa: E402

TOK = word_tokenizer()
NEEDLE = " The secret code of the tiger is 4 1 7."
QUESTION = " Question: What is the secret code of the tiger? Answer:"


def words(ids):
    return TOK.convert_ids_to_tokens(ids)


def sentence_starts(tokens):
    """Indices where a sentence begins in a list of word tokens: 0 and after every '.'."""
    return [0] + [i + 1 for i, w in enumerate(tokens) if w == "." and i + 1 < len(tokens)]


def test_split_sentences():
    text = 'One two.  Three\nfour?  "Five!" Six (seven.) Eight'
    assert split_sentences(text) == ["One two.", "Three four?", '"Five!"', "Six (seven.)", "Eight"]
    assert split_sentences("   ") == []


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.33, 0.5, 0.77, 0.99, 1.0])
@pytest.mark.parametrize("length", [40, 97, 200])
def test_needle_goes_to_the_sentence_start_at_or_before_its_depth(length, depth):
    head, needle, tail = encode(TOK, "Read the text."), encode(TOK, NEEDLE), encode(TOK, QUESTION)
    ctx = build_context(
        TOK, Haystack.default(), length=length, needles=[(needle, depth)], head=head, tail=tail, rng=random.Random(3)
    )
    assert len(ctx.ids) == length  # the question's buffer was kept: exact length
    assert ctx.ids[: len(head)] == head and ctx.ids[-len(tail) :] == tail
    start, end = ctx.spans[0]
    assert ctx.ids[start:end] == needle
    hay = ctx.ids[len(head) : start] + ctx.ids[end : length - len(tail)]  # the haystack without the needle
    assert len(hay) == length - len(head) - len(tail) - len(needle)
    n, at = len(hay), start - len(head)
    target = round(depth * n)
    if target >= n:
        assert at == n  # depth 1: the end, just before the question
    else:
        assert at == max(s for s in sentence_starts(words(hay)) if s <= target)
        assert at == 0 or words(hay)[at - 1] == "."  # never inside a sentence


def test_filler_is_whole_sentences_of_the_filler_and_seeded():
    a = fill(TOK, Haystack.default(), 150, random.Random(7))
    b = fill(TOK, Haystack.default(), 150, random.Random(7))
    c = fill(TOK, Haystack.default(), 150, random.Random(8))
    assert a.ids == b.ids and a.ids != c.ids and len(a.ids) == 150
    known = {tuple(encode(TOK, " " + s)) for s in FILLER}
    for s, e in zip(a.starts, a.starts[1:]):
        assert tuple(a.ids[s:e]) in known
    assert a.starts == sentence_starts(words(a.ids))


def test_file_haystack_is_read_in_order(tmp_path):
    path = tmp_path / "essay.txt"
    sentences = [f"Sentence {i} is here." for i in range(10)]
    path.write_text(" ".join(sentences), encoding="utf-8")
    hay = Haystack.from_file(str(path))
    assert hay.ordered and hay.sentences == tuple(sentences)
    got = fill(TOK, hay, 60, random.Random(0))
    text = TOK.decode(got.ids)
    digits = [int(w) for w in text.split() if w.isdigit()]
    assert all((b - a) % 10 == 1 for a, b in zip(digits, digits[1:]))  # consecutive, wrapping around


def test_several_needles_keep_their_spans_and_order():
    a, b = encode(TOK, " red is 1."), encode(TOK, " blue is 2.")
    ctx = build_context(
        TOK,
        Haystack.default(),
        length=120,
        needles=[(b, 0.8), (a, 0.2), (encode(TOK, " green is 3."), 0.2)],
        rng=random.Random(1),
    )
    spans = ctx.spans
    assert ctx.ids[spans[0][0] : spans[0][1]] == b and ctx.ids[spans[1][0] : spans[1][1]] == a
    assert spans[1][1] <= spans[2][0] < spans[0][0]  # same depth: given order; deeper: later
    assert len(ctx.ids) == 120 and ctx.haystack == (0, 120)


def test_bad_input(tmp_path):
    needle = encode(TOK, NEEDLE)
    with pytest.raises(ValueError, match="^lengths: "):
        build_context(TOK, Haystack.default(), length=len(needle), needles=[(needle, 0.5)], rng=random.Random(0))
    with pytest.raises(ValueError, match="^lengths: "):
        build_context(TOK, Haystack.default(), length=0, needles=[], rng=random.Random(0))
    with pytest.raises(ValueError, match="depth"):
        build_context(TOK, Haystack.default(), length=50, needles=[(needle, 1.5)], rng=random.Random(0))
    with pytest.raises(ValueError, match="^haystack: no such file"):
        Haystack.resolve(str(tmp_path / "missing.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n ", encoding="utf-8")
    with pytest.raises(ValueError, match="^haystack: the haystack text has no sentences"):
        Haystack.resolve(str(empty))
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(ValueError, match="^haystack: could not read"):
        Haystack.from_file(str(binary))
    with pytest.raises(ValueError, match="^haystack: "):
        Haystack.resolve(42)


def test_encode_adds_only_the_beginning_of_sequence_token_when_asked():
    tok = word_tokenizer(bos=True)
    plain = encode(tok, "The river runs.")
    assert tok.convert_ids_to_tokens(plain) == ["The", "river", "runs", "."]
    assert encode(tok, "The river runs.", bos=True) == [tok.bos_token_id] + plain
    assert encode(TOK, "The river runs.", bos=True) == plain  # no BOS token: nothing added
    assert encode(tok, "") == []
