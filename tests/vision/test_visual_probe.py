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
    means = [
        result.value("visual_share_mean", kind="presence", group=f"absent, share {b}", alpha=1.0) for b in ("low", "mid", "high")
    ]
    assert means == sorted(means)
    ordered = sorted(float(share[i].mean()) for i in absent)
    assert means[0] == pytest.approx(sum(ordered[: counts[0]]) / counts[0], abs=1e-5)


def test_the_standard_error_is_the_binomial_one(result):
    for group in ("present", "absent"):
        p = result.value("yes_rate", kind="presence", group=group, alpha=1.0)
        n = result.value("counted", kind="presence", group=group, alpha=1.0)
        assert result.value("yes_rate_se", kind="presence", group=group, alpha=1.0) == pytest.approx(math.sqrt(p * (1 - p) / n))


def test_the_cli_runs_the_probe_on_the_organism_by_name(shipped, tmp_path, capsys):
    out = tmp_path / "probe"
    assert (
        main(
            [
                "probe",
                "visual",
                "--model",
                NAME,
                "--samples",
                "4",
                "--kinds",
                "presence,colour",
                "--no-share",
                "--out",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
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
        with pytest.raises(ValueError, match="^model: the visual probe needs a vision-language model"):
            run("visual", "needle-32", samples=2)


def test_answers_of_a_natural_language_vlm_are_read_from_its_words():
    assert probe._read_answer(" Yes, there is.", "presence") == "yes"
    assert probe._read_answer("It is top-left.", "position") == "top-left"
    assert probe._read_answer("RED", "colour") == "red"
    e = shapes.examples(3, 4)
    assert probe._english(e[0]).startswith("Is there a ") and probe._english(e[1]).startswith("What color is the ")


@pytest.fixture(scope="module")
def english_vlm(tmp_path_factory):
    """A random tiny LLaVA directory with a hub-free processor whose tokenizer reads English
    (word-level, punctuation split off, unknown words to <unk>): a VLM that is not the organism."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    words = sorted(
        {
            w
            for e in shapes.examples(30, 0)
            for w in probe._english(e).replace("?", " ? ").replace(".", " . ").replace(",", " , ").replace(":", " : ").split()
        }
        | {"yes", "no", *shapes.COLOURS, *shapes.POSITIONS}
    )
    vocab = {t: i for i, t in enumerate(["<pad>", "<unk>", "<image>", *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.add_special_tokens([AddedToken("<pad>", special=True), AddedToken("<image>", special=True, normalized=False)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", padding_side="left")
    size = {"height": 24, "width": 24}
    images = CLIPImageProcessorPil(
        size=size, crop_size=size, do_resize=False, do_center_crop=False, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
    )
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=24, patch_size=8
        ),
        text_config=LlamaConfig(
            vocab_size=len(vocab),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            pad_token_id=0,
            bos_token_id=None,
            eos_token_id=None,
        ),
        image_token_index=vocab["<image>"],
        image_seq_length=9,
        vision_feature_layer=-1,
    )
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("english-vlm")
    LlavaForConditionalGeneration(config).save_pretrained(directory)
    processor.save_pretrained(directory)
    return str(directory)


def test_another_vlm_is_asked_in_english_and_its_share_is_its_eager_attention(english_vlm):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    result = run("visual", english_vlm, samples=4, max_new_tokens=2, batch_size=12)
    assert result.meta["prompts"] == "english"
    processor = AutoProcessor.from_pretrained(english_vlm)
    model = LlavaForConditionalGeneration.from_pretrained(english_vlm, dtype=torch.float64, attn_implementation="eager").eval()
    examples = shapes.examples(12, [shapes.stream("probe"), 0])
    inputs = processor(
        images=[e.image for e in examples],
        text=[f"<image>\n{probe._english(e)}" for e in examples],
        return_tensors="pt",
        padding=True,
    )
    plain = LlavaForConditionalGeneration.from_pretrained(english_vlm, dtype=torch.float32).eval()  # as the probe loads it
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    shares = []
    with torch.no_grad():
        generated = plain.generate(**inputs, max_new_tokens=2, do_sample=False)
        for e in examples:  # one prompt at a time: the reference sees no padding (the probe's batch is left-padded)
            one = processor(images=[e.image], text=[f"<image>\n{probe._english(e)}"], return_tensors="pt")
            out = model(**one, output_attentions=True)
            image = one["input_ids"][0] == image_id
            shares.append(torch.stack([a[0, :, -1, image].sum(-1) for a in out.attentions]))
    share = torch.stack(shares)  # (n, L, H)
    texts = processor.batch_decode(generated[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert result.meta["answers"]["1"] == [probe._read_answer(t, e.kind) for t, e in zip(texts, examples)]
    for kind in shapes.KINDS:
        rows = share[[i for i, e in enumerate(examples) if e.kind == kind]].mean(0)
        for layer in range(rows.shape[0]):
            for head in range(rows.shape[1]):
                got = result.value("visual_share", kind=kind, group="all", alpha=1.0, layer=layer, head=head)
                assert got == pytest.approx(float(rows[layer, head]), abs=1e-5)
