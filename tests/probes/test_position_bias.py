"""The position-bias probe on the bundled all-MiniLM-L6-v2: the known primacy bias,
permutation rules read with plain Python, similarities and attention mass against a dense
eager computation, every pooling, refusals and bad input."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf"))
from tiny_models import VOCAB, build  # noqa: E402

from attnkit.arena.tokenizer import Symbols, build_tokenizer
from attnkit.probes import load_probe_model, run
from attnkit.probes.position_bias import default_text, split_segments

SMALL = [
    "The cat sat on the warm mat by the door.",
    "Rain fell over the harbour all night long.",
    "A violin played softly in the empty hall.",
]


@pytest.fixture(scope="module")
def minilm():
    return load_probe_model(None)


@pytest.fixture(scope="module")
def eager_minilm():
    from transformers import AutoModel

    from attnkit.hf import default_model_path

    return AutoModel.from_pretrained(default_model_path(), local_files_only=True, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def bundled(minilm):
    return run("position-bias", minilm, samples=6, seed=0)


def test_first_position_reflected_more_than_last(bundled):
    """all-MiniLM-L6-v2 (mean pooling) reflects the first segment of a document better
    than the last, whatever segment sits there (six paragraphs, one Latin square)."""
    first, last = bundled.mean("similarity", position=0), bundled.mean("similarity", position=5)
    assert first > last
    assert bundled.value("first_last_gap") == pytest.approx(first - last)


def test_permutation_rules(bundled, minilm):
    segments, orders = bundled.meta["segments"], bundled.meta["permutations"]
    assert segments == [" ".join(p.split()) for p in default_text().split("\n\n") if p.strip()]
    S = len(segments)
    assert S == 6 and len(orders) == 6
    for sample, order in enumerate(orders):
        assert sorted(order) == list(range(S))  # a permutation
        rows = bundled.select("similarity", sample=sample)
        assert sorted(r["segment"] for r in rows) == list(range(S))  # each segment once per sample
        assert all(order[r["position"]] == r["segment"] for r in rows)  # at the position it held
    for p in range(S):  # one block of rotations: every segment at every position once
        assert sorted(order[p] for order in orders) == list(range(S))
    again = run("position-bias", minilm, samples=8, seed=0, segments=SMALL)
    assert again.meta["permutations"] == run("position-bias", minilm, samples=8, seed=0, segments=SMALL).meta["permutations"]
    assert again.meta["permutations"] != run("position-bias", minilm, samples=8, seed=1, segments=SMALL).meta["permutations"]


def _eager_reference(model, tokenizer, segments, orders, pooling):
    """Similarity per (sample, position) and pooled attention mass per (layer, position),
    from dense eager attention weights; token spans from each segment's own word pieces."""

    def embed(ids):
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), output_attentions=True)
        hidden = out.last_hidden_state[0].double()
        n = len(ids)
        rows = {"mean": [1.0 / n] * n, "cls": [1.0] + [0.0] * (n - 1), "last": [0.0] * (n - 1) + [1.0]}[pooling]
        rows = torch.tensor(rows, dtype=torch.float64)
        return rows @ hidden, rows, [a[0].double() for a in out.attentions]

    pieces = [tokenizer(s, add_special_tokens=False)["input_ids"] for s in segments]
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    alone = [embed([cls] + p + [sep])[0] for p in pieces]
    similarity, mass = {}, torch.zeros(6, len(segments), dtype=torch.float64)
    for sample, order in enumerate(orders):
        ids, spans = [cls], []
        for seg in order:
            spans.append((len(ids), len(ids) + len(pieces[seg])))
            ids += pieces[seg]
        ids.append(sep)
        doc, rows, attentions = embed(ids)
        for p, seg in enumerate(order):
            similarity[(sample, p)] = float(torch.nn.functional.cosine_similarity(alone[seg], doc, dim=0))
        for layer, A in enumerate(attentions):  # A: (H, N, N)
            for p, (a, e) in enumerate(spans):
                mass[layer, p] += (rows @ A[:, :, a:e].sum(-1).T).mean() / len(orders)
    return similarity, mass


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_similarity_and_attention_mass_equal_eager(pooling, minilm, eager_minilm, tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text("\n\n".join(SMALL) + "\n", encoding="utf-8")
    result = run("position-bias", minilm, text=str(text), samples=2, pooling=pooling, seed=5)
    orders = result.meta["permutations"]
    similarity, mass = _eager_reference(eager_minilm, minilm.tokenizer, SMALL, orders, pooling)
    for (sample, p), value in similarity.items():
        assert result.value("similarity", sample=sample, position=p) == pytest.approx(value, abs=1e-5)  # float32 model
    for p in range(len(SMALL)):
        for layer in range(6):
            got = [r["value"] for r in result.select("attention_mass", position=p, layer=layer)]
            assert got == [pytest.approx(float(mass[layer, p]), abs=1e-5)]
        overall = [r["value"] for r in result.select("attention_mass", position=p) if "layer" not in r]
        assert overall == [pytest.approx(float(mass[:, p].mean()), abs=1e-5)]
    assert {f["x"] for f in result.meta["figures"]} == {"position"}


def test_sentences_split():
    text = 'He said "Stop." Then he left! Did she follow? Yes.\n\nA new paragraph here.'
    assert split_segments(text, "sentence") == [
        'He said "Stop."',
        "Then he left!",
        "Did she follow?",
        "Yes.",
        "A new paragraph here.",
    ]
    assert split_segments(text, "paragraph") == ['He said "Stop." Then he left! Did she follow? Yes.', "A new paragraph here."]


def test_causal_models_are_refused(tmp_path):
    tok = build_tokenizer(Symbols(tuple(f"w{i}" for i in range(VOCAB)), {}, "w0"))
    with pytest.raises(ValueError, match="^model: .*encoder"):
        run("position-bias", build("llama"), tok)
    # an arena export: a causal model with a task.json beside it
    build("llama").save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    (tmp_path / "task.json").write_text('{"task": "induction"}')
    with pytest.raises(ValueError, match="^model: .*arena export"):
        run("position-bias", str(tmp_path))


@pytest.mark.parametrize(
    "bad, keyword",
    [
        (dict(pooling="max"), "pooling"),
        (dict(unit="word"), "unit"),
        (dict(samples=0), "samples"),
        (dict(samples=2.0), "samples"),
        (dict(batch_size=0), "batch_size"),
        (dict(seed=1.5), "seed"),
        (dict(text="/no/such/file.txt"), "text"),
        (dict(text=""), "text"),
        (dict(segments=["only one"]), "segments"),
        (dict(segments="not a list"), "segments"),
        (dict(segments=["a b", " "]), "segments"),
    ],
)
def test_bad_input_names_the_keyword(bad, keyword, minilm):
    with pytest.raises(ValueError, match=f"^{keyword}: "):
        run("position-bias", minilm, **bad)


def test_bad_text_files(minilm, tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("A single paragraph with no blank line.\n", encoding="utf-8")
    with pytest.raises(ValueError, match="^text: found 1 paragraph"):
        run("position-bias", minilm, text=str(one))
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00 not utf-8 \x80\n\n\x81")
    with pytest.raises(ValueError, match="^text: "):
        run("position-bias", minilm, text=str(binary))
    long = tmp_path / "long.txt"
    long.write_text("\n\n".join(["word " * 300] * 2), encoding="utf-8")  # > 512 positions
    lines = []
    with pytest.raises(ValueError, match="^text: a prompt of 602 tokens is longer than the 512 positions"):
        run("position-bias", minilm, text=str(long), progress=lines.append)
    assert lines == []
    with pytest.raises(ValueError, match="^text: "):
        run("position-bias", minilm, text=str(one), segments=SMALL)
