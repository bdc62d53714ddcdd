"""The ruler probe: RULER's task generators read back with plain Python (templates, needle
counts, key and value formats, the vt chain, cwe/fwe frequencies, token lengths), its
scores and effective length on hand-made cases, and an end-to-end run on a tiny random
Llama whose needle mass equals transformers' eager attention weights."""

import math
import re
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wordlevel import eager_answer_mass, tiny_llama  # noqa: E402

from attnkit.probes import ProbeModel, ProbeResult, string_match_all, string_match_part
from attnkit.probes.ruler import effective_length, ruler
from attnkit.probes.ruler_tasks import ALL, NOISE, make_sample, sample_rng
from attnkit.probes.ruler_tasks.common import essay_haystack, word_list

NIAH_TASKS = [t for t in ALL if t.startswith("niah_")]
NEEDLE_RE = re.compile(r"One of the special magic (numbers|uuids) for (\S+) is: (\S+?)\.(?= |\n|$)")
NEEDLE_TEXT_RE = re.compile(r"One of the special magic (?:numbers|uuids) for \S+ is: \S+?\.(?= |\n|$)")
NUMBER_RE = re.compile(r"[1-9][0-9]{6}")
UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


class CharTokenizer:
    """One token per character: decoding gives back the exact text, so prompts can be read."""

    bos_token_id = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


CHARS = CharTokenizer()


def prompt(task, budget, index=0, tokenizer=CHARS, seed=0):
    sample = make_sample(task, tokenizer, budget, sample_rng(seed, task, budget, index))
    return sample, tokenizer.decode(sample.ids)


def split_prompt(text):
    """(head line, body, question line): every template has one line before the body and
    the question on the last line."""
    head, rest = text.split("\n", 1)
    body, question = rest.rsplit("\n", 1)
    return head, body, question


def is_word_key(key):
    adjective, _, noun = key.partition("-")
    return adjective in word_list("adjectives") and noun in word_list("nouns")


# -- needle tasks -----------------------------------------------------------------------

# task: (haystack, key format, value format, keys in a noise/essay haystack, queried keys, values per key)
NIAH_RULES = {
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needles", "words", "numbers", None, 1, 1),
    "niah_multikey_3": ("needles", "uuids", "uuids", None, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 1, 4),
    "niah_multiquery": ("essay", "words", "numbers", 4, 4, 1),
}


@pytest.mark.parametrize("task", NIAH_TASKS)
def test_niah_prompt_follows_the_task_rules(task):
    haystack, key_kind, value_kind, n_keys, n_queried, n_values = NIAH_RULES[task]
    sample, text = prompt(task, 3000)
    head, body, question = split_prompt(text)
    assert (
        head == f"Some special magic {value_kind} are hidden in the text below. Remember them, because there "
        "will be a question about them after the text."
    )
    needles = NEEDLE_RE.findall(body)
    assert all(kind == value_kind for kind, _, _ in needles)
    keys = [k for _, k, _ in needles]
    values = [v for _, _, v in needles]
    assert all((UUID_RE if value_kind == "uuids" else NUMBER_RE).fullmatch(v) for v in values)
    assert all(UUID_RE.fullmatch(k) if key_kind == "uuids" else is_word_key(k) for k in keys)
    assert len(set(values)) == len(values)
    match = re.fullmatch(
        rf"Question: What are all the special magic {value_kind} for (.+) that the text above "
        rf"mentions\? Answer: The special magic {value_kind} for (.+) mentioned in the text above are:",
        question,
    )
    assert match and match.group(1) == match.group(2)
    queried = re.split(r", and |, | and ", match.group(1))
    assert len(queried) == n_queried == len(set(queried))
    # the answer is every value that a needle gives a queried key
    expected = [v for k, v in zip(keys, values) if k in queried]
    assert sorted(sample.answers) == sorted(expected)
    assert len(expected) == n_queried * n_values
    for key in queried:
        assert keys.count(key) == n_values
    # needles go to different depths of RULER's grid of 40
    assert len(set(sample.info["depths"])) == len(sample.info["depths"])
    assert all(d in [round(100 * i / 39) / 100 for i in range(40)] for d in sample.info["depths"])
    # the needle spans are exactly the needles of the answer
    spans = [sample.ids[a:e] for a, e in sample.spans]
    assert sorted(CHARS.decode(s).strip() for s in spans) == sorted(
        f"One of the special magic {value_kind} for {k} is: {v}." for k, v in zip(keys, values) if k in queried
    )
    if haystack == "needles":
        # a haystack of distractors: every key different, none of them a queried key
        assert len(needles) > 10 and len(set(keys)) == len(keys)
        assert body.startswith(" One of the special magic")
    else:
        assert len(needles) == n_keys * n_values
        assert len(set(keys)) == n_keys
        filler = NOISE if haystack == "noise" else essay_haystack().sentences
        rest = body
        for needle in NEEDLE_TEXT_RE.findall(body):
            rest = rest.replace(" " + needle, "", 1)
        sentences = [s for s in re.split(r"(?<=[.?!]) ", rest.strip())]
        # every sentence but the last (which may be cut short) comes from the haystack
        assert all(s in filler for s in sentences[:-1])
        assert any(s.startswith(sentences[-1]) for s in filler)


def test_noise_haystack_repeats_rulers_sentences_in_order():
    _, text = prompt("niah_single_1", 2000)
    body = NEEDLE_RE.sub("", split_prompt(text)[1])
    sentences = [s.strip() for s in re.split(r"(?<=\.) ", body) if s.strip()]
    for a, b in zip(sentences[:-2], sentences[1:-1]):
        assert NOISE.index(b) == (NOISE.index(a) + 1) % len(NOISE)


def test_prompts_are_deterministic_per_seed_and_sample():
    for task in ALL:
        a, _ = prompt(task, 1500)
        b, _ = prompt(task, 1500)
        c, _ = prompt(task, 1500, index=1)
        d, _ = prompt(task, 1500, seed=1)
        assert a.ids == b.ids and a.answers == b.answers
        assert a.ids != c.ids and a.ids != d.ids


# -- variable tracking ------------------------------------------------------------------


def test_vt_hides_one_four_hop_chain_in_noise():
    sample, text = prompt("vt", 2000)
    _, body, question = split_prompt(text)
    statements = re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|[0-9]{5})\.", body)
    assert len(statements) == 5
    value = statements[0][1]
    assert re.fullmatch(r"[1-9][0-9]{4}", value)
    # in reading order: the first assigns the value, each next one copies the one before
    names = [n for n, _ in statements]
    assert len(set(names)) == 5
    assert [src for _, src in statements[1:]] == [f"VAR {n}" for n in names[:-1]]
    # following the chain from the value reaches every variable, and only those
    holders, changed = set(), True
    while changed:
        changed = False
        for name, src in statements:
            if name not in holders and (src == value or src[4:] in holders):
                holders.add(name)
                changed = True
    assert sorted(sample.answers) == sorted(holders) == sorted(names)
    assert question == (
        f"Question: Which variables in the text above are assigned the value {value}, directly or "
        f"through other variables? Answer: The 5 variables assigned the value {value} in the text "
        "above are:"
    )
    rest = re.sub(r" VAR [A-Z]{5} = (VAR [A-Z]{5}|[0-9]{5})\.", "", body)
    assert all(s in NOISE for s in re.split(r"(?<=\.) ", rest.strip())[:-1])
    assert [CHARS.decode(sample.ids[a:e]).strip() for a, e in sample.spans] == [f"VAR {n} = {src}." for n, src in statements]


# -- aggregation ------------------------------------------------------------------------


def cwe_list(text):
    _, body, question = split_prompt(text)
    entries = re.findall(r" ([0-9]+)\. (\S+)", body)
    assert "".join(f" {i}. {w}" for i, w in entries) == body  # nothing else in the list
    assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
    return [w for _, w in entries], question


@pytest.mark.parametrize("budget, freq", [(6000, 30), (1200, None)])
def test_cwe_has_ten_common_words_among_words_seen_three_times(budget, freq):
    sample, text = prompt("cwe", budget)
    words, question = cwe_list(text)
    assert (
        question == "Question: What are the 10 most common words in the list above? Answer: The 10 words that "
        "appear most often in the list above are:"
    )
    counts = Counter(words)
    common = sorted(w for w, c in counts.items() if c > 3)
    assert len(common) == 10
    assert sorted(sample.answers) == common
    top = {counts[w] for w in common}
    assert len(top) == 1
    if freq is not None:
        assert top == {freq}
    else:  # too short for 30 each: the largest frequency that fits, still above 3
        assert 3 < top.pop() < 30
    assert {c for w, c in counts.items() if w not in common} == {3}
    assert sum(c == 3 for c in counts.values()) >= 10


def test_fwe_counts_follow_zipf_with_alpha_two():
    sample, text = prompt("fwe", 30000)
    _, body, question = split_prompt(text)
    assert (
        question == "Question: Which 3 coded words appear most often in the coded text above? Answer: The 3 most "
        "frequent coded words in the coded text above are:"
    )
    words = body.split()
    assert all(re.fullmatch(r"[a-z]{3,6}", w) for w in words)
    counts = Counter(words).most_common()
    assert sample.answers == [w for w, _ in counts[:3]]
    assert counts[2][1] > counts[3][1]
    # P(rank 1) = 1 / sum_{k<=1000} k^-2; n ~ 5000 draws -> sd ~ 0.007, allow 5 sd
    p1 = 1 / sum(k**-2.0 for k in range(1, 1001))
    assert abs(counts[0][1] / len(words) - p1) < 0.035
    assert 2.5 < counts[0][1] / counts[1][1] < 6.0  # (2/1)^2 = 4 in expectation


def test_fwe_top_three_is_never_a_tie():
    for index in range(20):
        sample, text = prompt("fwe", 400, index=index)
        counts = sorted(Counter(split_prompt(text)[1].split()).values(), reverse=True)
        assert counts[2] > counts[3]


# -- token lengths with a real subword tokenizer ------------------------------------------


@pytest.fixture(scope="module")
def wordpiece():
    from transformers import AutoTokenizer

    from attnkit.hf import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)


@pytest.mark.parametrize("budget", [500, 2000])
def test_prompt_length_is_close_to_the_budget_and_never_above(wordpiece, budget):
    for task in ALL:
        sample, _ = prompt(task, budget, tokenizer=wordpiece)
        assert len(sample.ids) <= budget
        if task.startswith("niah_") or task == "vt":
            assert len(sample.ids) == budget
        else:  # whole list entries / whole words
            assert len(sample.ids) >= budget - 25, task


def test_too_short_a_length_names_the_keyword():
    with pytest.raises(ValueError, match="^lengths: "):
        make_sample("niah_multiquery", CHARS, 300, sample_rng(0, "x", 0, 0))
    with pytest.raises(ValueError, match="^lengths: "):
        make_sample("cwe", CHARS, 300, sample_rng(0, "x", 0, 0))
    with pytest.raises(ValueError, match="^task: unknown task 'qa_1'"):
        make_sample("qa_1", CHARS, 3000, sample_rng(0, "x", 0, 0))


# -- scoring and effective length -----------------------------------------------------------


def test_string_match_scores_on_hand_written_answers():
    refs = ["1234567", "7654321", "ABCDE", "e3b0c442-98fc-4c14-9afb-f4c8996fb924"]
    assert string_match_all("1234567, 7654321, abcde and E3B0C442-98FC-4C14-9AFB-F4C8996FB924", refs) == 1.0
    assert string_match_all("the numbers are 1234567 and 7654322", refs) == 0.25
    assert string_match_all("nothing here", refs) == 0.0
    assert string_match_all("123456", ["1234567"]) == 0.0
    assert string_match_part("maybe abcde", refs) == 1.0
    assert string_match_part("no", refs) == 0.0


def hand_made(accuracies):
    result = ProbeResult("ruler")
    for task, by_length in accuracies.items():
        for length, value in by_length.items():
            result.add("accuracy", value, task=task, length=length)
    return result


def test_effective_length_is_the_longest_length_reaching_the_threshold():
    result = hand_made({"average": {4096: 95.0, 8192: 85.6, 16384: 70.0, 32768: 40.0}, "vt": {4096: 50.0, 8192: 20.0}})
    assert effective_length(result) == 8192  # 85.6 itself counts (Llama-2-7B at 4k is effective at 4k)
    assert effective_length(result, 85.7) == 4096
    assert effective_length(result, 50.0) == 16384
    assert effective_length(result, 96.0) == 0
    assert effective_length(result, 100, "vt") == 0
    assert effective_length(result, 50, "vt") == 4096
    with pytest.raises(ValueError, match="threshold"):
        effective_length(result, 0)
    with pytest.raises(ValueError, match="task"):
        effective_length(result, 50, "cwe")


# -- end to end -------------------------------------------------------------------------

LENGTHS = (300, 340)
NEW = 3


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(30522)  # the WordPiece vocabulary's size


@pytest.fixture(scope="module")
def run(llama, wordpiece):
    lines = []
    result = ruler(llama, wordpiece, lengths=LENGTHS, samples=2, batch_size=2, max_new_tokens=NEW, progress=lines.append)
    return result, lines


def test_rows_and_metrics(run):
    result, lines = run
    assert len(lines) == len(ALL) * len(LENGTHS)
    assert set(result.metrics) == {"score", "accuracy", "effective_length", "needle_mass", "needle_mass_best"}
    for task in ALL:
        for length in LENGTHS:
            scores = [r["value"] for r in result.select("score", task=task, length=length)]
            assert len(scores) == 2 and all(0 <= s <= 100 for s in scores)
            assert result.value("accuracy", task=task, length=length) == pytest.approx(sum(scores) / 2)
            masses = result.select("needle_mass", task=task, length=length)
            if task in ("cwe", "fwe"):
                assert not masses
                continue
            assert {(r["layer"], r["head"]) for r in masses} == {(l, h) for l in range(2) for h in range(4)}
            assert all(0 <= r["value"] <= 1 + 1e-6 for r in masses)
            best = result.select("needle_mass_best", task=task, length=length)
            assert len(best) == 1 and best[0]["value"] == max(r["value"] for r in masses)
            assert (
                result.value("needle_mass", task=task, length=length, layer=best[0]["layer"], head=best[0]["head"])
                == best[0]["value"]
            )
    for length in LENGTHS:
        mean = sum(result.value("accuracy", task=t, length=length) for t in ALL) / len(ALL)
        assert result.value("accuracy", task="average", length=length) == pytest.approx(mean)
    for task in (*ALL, "average"):
        accuracies = {r["length"]: r["value"] for r in result.select("accuracy", task=task)}
        passing = [n for n, a in accuracies.items() if a >= 85.6]
        assert result.value("effective_length", task=task) == (max(passing) if passing else 0)
    assert result.meta["params"]["lengths"] == list(LENGTHS) and result.meta["params"]["threshold"] == 85.6
    kinds = [(f["kind"], f["metric"]) for f in result.meta["figures"]]
    assert ("heatmap", "accuracy") in kinds and ("curve", "accuracy") in kinds
    table = result.table("task", "length", "accuracy")
    assert table.row_labels == sorted([*ALL, "average"]) and table.col_labels == list(LENGTHS)


def eager_greedy(model, ids, steps):
    """Greedy tokens from full eager forwards, no cache (an independent reference)."""
    seq = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(steps):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[0, len(ids) :]


@pytest.mark.parametrize("task", ["niah_multivalue", "vt"])
def test_needle_mass_and_scores_equal_eager_attention(llama, wordpiece, task):
    length = LENGTHS[0]
    result = ruler(llama, wordpiece, tasks=[task], lengths=[length], samples=2, batch_size=2, max_new_tokens=NEW, seed=3)
    masses = []
    for i in range(2):
        sample = make_sample(task, wordpiece, length - NEW, sample_rng(3, task, length, i))
        tokens = eager_greedy(llama, sample.ids, NEW)
        masses.append(eager_answer_mass(llama, torch.tensor([sample.ids]), tokens[None], [sample.spans])[0])
        text = wordpiece.decode(tokens.tolist(), skip_special_tokens=True)
        assert result.value("score", task=task, length=length, sample=i) == pytest.approx(
            100 * sum(a.lower() in text.lower() for a in sample.answers) / len(sample.answers)
        )
    expected = torch.stack(masses).mean(0)
    got = torch.tensor(
        [[result.value("needle_mass", task=task, length=length, layer=l, head=h) for h in range(4)] for l in range(2)],
        dtype=torch.float64,
    )
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)  # float32 attention weights


def test_answers_known_to_be_right_or_partly_right_score_as_rulers_metric(monkeypatch, llama, wordpiece):
    """The model's real generation (so the meters are fed) with its text replaced by all
    the references, or by the first one only: 100 everywhere, or 100 / (references)."""
    import attnkit.probes.ruler as module

    samples, real_make, real_generate = {}, module.make_sample, module.greedy_generate
    keep = {"n": None}

    def recording(*args, **kwargs):
        sample = real_make(*args, **kwargs)
        samples[tuple(sample.ids)] = sample
        return sample

    def answering(model, tokenizer, prompts, max_new_tokens, observers=None):
        generation = real_generate(model, tokenizer, prompts, max_new_tokens, observers=observers)
        rows = [samples[tuple(row[pad:].tolist())] for row, pad in zip(prompts.input_ids, prompts.pads)]
        generation.texts = [" and ".join(s.answers[: keep["n"]]).upper() for s in rows]
        return generation

    monkeypatch.setattr(module, "make_sample", recording)
    monkeypatch.setattr(module, "greedy_generate", answering)
    tasks = ["niah_single_1", "niah_multivalue", "vt", "cwe", "fwe"]
    kwargs = dict(tasks=tasks, lengths=LENGTHS, samples=2, batch_size=2, max_new_tokens=NEW)
    right = ruler(llama, wordpiece, **kwargs)
    assert {r["value"] for r in right.select("score")} == {100.0}
    assert all(right.value("effective_length", task=t) == max(LENGTHS) for t in (*tasks, "average"))
    keep["n"] = 1
    partly = ruler(llama, wordpiece, **kwargs)
    shares = {"niah_single_1": 100.0, "niah_multivalue": 25.0, "vt": 20.0, "cwe": 10.0, "fwe": 100 / 3}
    for task, share in shares.items():
        assert [r["value"] for r in partly.select("score", task=task)] == pytest.approx([share] * 2 * len(LENGTHS))
        assert partly.value("effective_length", task=task) == (max(LENGTHS) if share == 100 else 0)
    for length in LENGTHS:
        assert partly.value("accuracy", task="average", length=length) == pytest.approx(sum(shares.values()) / 5)


# -- refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, keyword",
    [
        ({"tasks": ["niah_single_1", "qa_1"]}, "tasks"),
        ({"tasks": "vt,vt"}, "tasks"),
        ({"tasks": []}, "tasks"),
        ({"lengths": []}, "lengths"),
        ({"lengths": [0]}, "lengths"),
        ({"lengths": [-300]}, "lengths"),
        ({"lengths": [300.5]}, "lengths"),
        ({"lengths": [True]}, "lengths"),
        ({"lengths": "300"}, "lengths"),
        ({"lengths": [300, 300]}, "lengths"),
        ({"lengths": [100], "max_new_tokens": 100}, "lengths"),
        ({"lengths": [1024]}, "lengths"),  # longer than the model's 512 positions
        ({"lengths": [200], "tasks": ["cwe"]}, "lengths"),  # too short for cwe's list
        ({"samples": 0}, "samples"),
        ({"samples": -1}, "samples"),
        ({"samples": 1.5}, "samples"),
        ({"threshold": 0}, "threshold"),
        ({"threshold": 100.5}, "threshold"),
        ({"threshold": math.nan}, "threshold"),
        ({"threshold": "high"}, "threshold"),
        ({"batch_size": 0}, "batch_size"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"seed": "zero"}, "seed"),
        ({"progress": "print"}, "progress"),
    ],
)
def test_bad_input_names_the_keyword(llama, wordpiece, kwargs, keyword):
    kwargs = {"lengths": [300], "samples": 1, "max_new_tokens": NEW, "tasks": ["niah_single_1"], **kwargs}
    with pytest.raises(ValueError, match=f"^{keyword}: "):
        ruler(llama, wordpiece, **kwargs)


def test_a_length_too_short_for_one_task_fails_before_any_generation(llama, wordpiece):
    lines = []
    with pytest.raises(ValueError, match="^lengths: 197 prompt tokens cannot hold the cwe task's list"):
        ruler(
            llama,
            wordpiece,
            tasks=["niah_single_1", "cwe"],
            lengths=[300, 200],
            samples=1,
            max_new_tokens=NEW,
            progress=lines.append,
        )
    assert lines == []


def test_default_lengths_are_rulers_that_fit_the_model(wordpiece):
    with pytest.raises(ValueError, match="^lengths: none of RULER's lengths"):
        ruler(tiny_llama(30522, max_positions=2048), wordpiece, tasks=["vt"], samples=1)


def test_refuses_encoders_and_arena_exports(llama, wordpiece):
    from attnkit.hf import load_default_model

    encoder, tokenizer = load_default_model()
    with pytest.raises(ValueError, match="^model: the ruler probe needs a causal language model"):
        ruler(encoder, tokenizer, lengths=[300], samples=1)
    arena = ProbeModel(llama, wordpiece, "causal", 512, {"task": "needle"}, "needle-export")
    with pytest.raises(ValueError, match="^model: the ruler probe asks English questions.*'needle'"):
        ruler(arena, lengths=[300], samples=1)


def test_uuid_values_are_version_4():
    sample, _ = prompt("niah_multikey_3", 3000)
    assert uuid.UUID(sample.answers[0]).version == 4
