"""The visual probe on the shipped visual organism: its answers are the model's own
(a plain forward pass, no attnkit in the way), its visual attention share equals the
eager attention weights on the image tokens, amplification does what its formula says
on the first layer, and bad input is named."""

import math

import pytest
import torch

from attnkit import organisms
from attnkit.cli import main
from attnkit.probes import available, run
from attnkit.probes import visual as probe
from attnkit.vision import organism as vo
from attnkit.vision import shapes

NAME = "shapes-vlm"
SAMPLES = 20  # per kind (6 of the presence questions ask about absent objects)


@pytest.fixture(scope="module")
def shipped():
    if NAME not in organisms.shipped():
        pytest.skip(f"{NAME} is not shipped in this install")
    return organisms.path(NAME)


@pytest.fixture(scope="module")
def result(shipped):
    return run("visual", shipped, samples=SAMPLES, amplify=[2.0], batch_size=16)


@pytest.fixture(scope="module")
def reference(shipped, result):
    """Per question: the answer of a plain forward pass and the eager attention share of
    the last position on the image tokens, (L, H), float64 sums of transformers' weights."""
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(shipped, dtype=torch.float64, attn_implementation="eager").eval()
    examples = shapes.examples(SAMPLES * 3, [shapes.stream("probe"), 0])
    assert [e.question for e in examples] == [q["question"] for q in result.meta["questions"]]
    ids = vo.token_ids([e.question for e in examples])
    with torch.no_grad():
        out = model(input_ids=ids, pixel_values=vo.pixels([e.image for e in examples]).double(), output_attentions=True)
    image = ids[0] == vo.VOCAB.index(vo.IMAGE)
    share = torch.stack([a[:, :, -1, :][:, :, image].sum(-1) for a in out.attentions], 1)  # (n, L, H)
    said = [vo.VOCAB[j] for j in out.logits[:, -1].argmax(-1).tolist()]
    return examples, said, share


def test_the_probe_is_registered():
    assert "visual" in available()


def test_answers_and_accuracy_are_the_models_own(result, reference):
    examples, said, _ = reference
    assert result.meta["answers"]["1"] == said
    for kind in shapes.KINDS:
        right = [s == e.answer for e, s in zip(examples, said) if e.kind == kind]
        assert result.value("accuracy", kind=kind, group="all", alpha=1.0) == pytest.approx(sum(right) / len(right))
        assert result.value("counted", kind=kind, group="all", alpha=1.0) == SAMPLES
    presence = [(e, s) for e, s in zip(examples, said) if e.kind == "presence"]
    absent = [s == "yes" for e, s in presence if e.absent]
    assert result.value("yes_rate", kind="presence", group="absent", alpha=1.0) == pytest.approx(sum(absent) / len(absent))


def test_visual_share_equals_the_eager_attention_on_image_tokens(result, reference):
    examples, _, share = reference
    layers, heads = share.shape[1], share.shape[2]
    for kind in shapes.KINDS:
        rows = share[[i for i, e in enumerate(examples) if e.kind == kind]].mean(0)
        for layer in range(layers):
            for head in range(heads):
                got = result.value("visual_share", kind=kind, group="all", alpha=1.0, layer=layer, head=head)
                assert got == pytest.approx(float(rows[layer, head]), abs=1e-5), (kind, layer, head)


def test_amplification_multiplies_first_layer_image_weights_and_renormalises(result, reference):
    examples, _, share = reference
    # layer 0 sees the same inputs either way: its amplified share is 2s / (2s + 1 - s) per question
    for kind in shapes.KINDS:
        s = share[[i for i, e in enumerate(examples) if e.kind == kind], 0]  # (n, H)
        expected = (2 * s / (1 + s)).mean(0)
        for head in range(s.shape[1]):
            got = result.value("visual_share", kind=kind, group="all", alpha=2.0, layer=0, head=head)
            assert got == pytest.approx(float(expected[head]), abs=1e-5)
            assert got > result.value("visual_share", kind=kind, group="all", alpha=1.0, layer=0, head=head)


def test_share_bins_split_the_absent_questions_in_thirds_by_their_plain_share(result, reference):
    examples, _, share = reference
    absent = [i for i, e in enumerate(examples) if e.kind == "presence" and e.absent]
    assert len(absent) >= 3
    counts = [result.value("counted", kind="presence", group=f"absent, share {b}", alpha=1.0) for b in ("low", "mid", "high")]
    assert sum(counts) == len(absent) and max(counts) - min(counts) <= 1
    means = [result.value("visual_share_mean", kind="presence", group=f"absent, share {b}", alpha=1.0) for b in ("low", "mid", "high")]
    assert means == sorted(means)
    ordered = sorted(float(share[i].mean()) for i in absent)
    assert means[0] == pytest.approx(sum(ordered[:counts[0]]) / counts[0], abs=1e-5)


def test_the_standard_error_is_the_binomial_one(result):
    for group in ("present", "absent"):
        p = result.value("yes_rate", kind="presence", group=group, alpha=1.0)
        n = result.value("counted", kind="presence", group=group, alpha=1.0)
        assert result.value("yes_rate_se", kind="presence", group=group, alpha=1.0) == pytest.approx(math.sqrt(p * (1 - p) / n))


def test_the_cli_runs_the_probe_on_the_organism_by_name(shipped, tmp_path, capsys):
    out = tmp_path / "probe"
    assert main(["probe", "visual", "--model", NAME, "--samples", "4", "--kinds", "presence,colour", "--no-share",
                 "--out", str(out), "--quiet"]) == 0
    assert (out / "results.csv").is_file() and (out / "report.html").is_file()
    assert "accuracy" in capsys.readouterr().out


def test_bad_input_is_named(shipped):
    with pytest.raises(ValueError, match="^samples: "):
        run("visual", shipped, samples=0)
    with pytest.raises(ValueError, match="^kinds: "):
        run("visual", shipped, kinds=["size"])
    with pytest.raises(ValueError, match="^amplify: "):
        run("visual", shipped, amplify=[0.0])
    if "needle-32" in organisms.shipped():
        with pytest.raises(ValueError, match="^--model: the visual probe needs a vision-language model"):
            run("visual", "needle-32", samples=2)


def test_answers_of_a_natural_language_vlm_are_read_from_its_words():
    assert probe._read_answer(" Yes, there is.", "presence") == "yes"
    assert probe._read_answer("It is top-left.", "position") == "top-left"
    assert probe._read_answer("RED", "colour") == "red"
    e = shapes.examples(3, 4)
    assert probe._english(e[0]).startswith("Is there a ") and probe._english(e[1]).startswith("What color is the ")
