"""``attnkit inspect --model DIR`` on a diffusers pipeline directory: a tiny Stable
Diffusion pipeline (tiny UNet, VAE, CLIP text encoder, a word-level tokenizer whose
vocabulary holds a ``<script>`` token) saved with save_pretrained as safetensors; the
report has one heatmap per prompt token and step range, escapes every token, and the
saved maps are the prompt's row of ``attnkit.diffusion.maps``."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from attnkit.cli import main  # noqa: E402

EVIL = "<script>alert(1)</script>"
WORDS = ["<pad>", "<unk>", "<s>", "</s>", "a", "cat", "on", "mat", EVIL]
PROMPT = f"a {EVIL} cat"
TOKENS = ["<s>", "a", EVIL, "cat", "</s>"]
CALL = ["--steps", "2", "--guidance", "3", "--size", "16x16", "--seed", "1"]


def _tiny_pipeline():
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # keeps "<script>...</script>" one token
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 2), ("</s>", 3)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>", model_max_length=8
    )
    torch.manual_seed(0)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(WORDS),
            hidden_size=12,
            intermediate_size=24,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=8,
            projection_dim=12,
            bos_token_id=2,
            eos_token_id=3,
            pad_token_id=0,
        )
    ).eval()
    unet = UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=12,
        attention_head_dim=4,
        norm_num_groups=4,
    ).eval()
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 8),
        latent_channels=4,
        norm_num_groups=4,
        layers_per_block=1,
        sample_size=16,
    ).eval()
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=DDIMScheduler(clip_sample=False, steps_offset=1),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-sd")
    _tiny_pipeline().save_pretrained(str(path), safe_serialization=True)
    assert not list(path.rglob("*.bin"))  # safetensors only
    return str(path)


def _run(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured


def test_report_has_one_escaped_heatmap_per_token_and_range(pipeline_dir, tmp_path, capsys):
    out = tmp_path / "report"
    code, captured = _run(["inspect", "--model", pipeline_dir, "--prompt", PROMPT, *CALL, "--out", str(out), "--json"], capsys)
    assert code == 0, captured.err
    summary = json.loads(captured.out)
    assert summary["tokens"] == TOKENS
    assert summary["sections"] == ["all steps", "step 0", "step 1"]
    html = (out / "report.html").read_text(encoding="utf-8")
    figures = re.findall(r'<figure class="token-map" data-token="(\d+)">', html)
    assert figures == [str(i) for i in range(len(TOKENS))] * 3  # one per token, per section
    assert EVIL not in html and "<script" not in html  # the page runs no script, the token's included
    assert html.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 3
    assert summary["grid"] == [8, 8] and summary["layers"] > 0

    from safetensors.torch import load_file

    maps = load_file(str(out / "maps.safetensors"))
    overall, first, second = maps["maps.0"], maps["maps.1"], maps["maps.2"]
    assert overall.shape == (len(TOKENS), 8, 8)
    # every step runs the same layers and heads: the whole run's mean is the ranges' mean
    torch.testing.assert_close(overall, (first + second) / 2, atol=1e-6, rtol=1e-5)
    assert (first - second).abs().max() > 0  # the steps differ


def test_saved_maps_are_the_prompts_row_of_diffusion_maps(pipeline_dir, tmp_path, capsys):
    from safetensors.torch import load_file

    import attnkit.diffusion as ad
    from attnkit.inspection.diffusion_run import load_local_pipeline

    out = tmp_path / "report"
    code, captured = _run(["inspect", "--model", pipeline_dir, "--prompt", PROMPT, *CALL, "--out", str(out), "--quiet"], capsys)
    assert code == 0, captured.err
    assert "report:" in captured.out and str(out / "report.html") in captured.out
    pipe = load_local_pipeline(pipeline_dir)
    expected = ad.maps(
        pipe,
        PROMPT,
        num_inference_steps=2,
        guidance_scale=3.0,
        height=16,
        width=16,
        output_type="latent",
        generator=torch.Generator().manual_seed(1),
    )
    assert expected.maps.shape[0] == 2  # guided: unconditional row first, then the prompt's
    saved = load_file(str(out / "maps.safetensors"))["maps.0"]
    torch.testing.assert_close(saved.double(), expected.maps[1, : len(TOKENS)], atol=1e-6, rtol=1e-5)


def test_prompt_embeds_file_names_tokens_by_position(pipeline_dir, tmp_path, capsys):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    embeds = tmp_path / "embeds.safetensors"
    save_file(
        {"prompt_embeds": torch.randn(1, 6, 12, generator=g), "negative_prompt_embeds": torch.randn(1, 6, 12, generator=g)},
        str(embeds),
    )
    out = tmp_path / "report"
    code, captured = _run(
        ["inspect", "--model", pipeline_dir, "--prompt-embeds", str(embeds), *CALL, "--ranges", "1", "--out", str(out), "--json"],
        capsys,
    )
    assert code == 0, captured.err
    summary = json.loads(captured.out)
    assert summary["tokens"] == [f"token {i}" for i in range(6)]
    html = (out / "report.html").read_text(encoding="utf-8")
    assert html.count('<figure class="token-map"') == 6 * 2


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--size", "16by16"], "--size: expected HEIGHTxWIDTH"),
        (["--ranges", "3"], "--ranges: 3 step ranges need at least as many --steps, got 2"),
        (["--top-k", "3"], "--top-k: not available for a diffusers pipeline"),
        (["--layers", "down_blocks.0"], "--layers: 'down_blocks.0' is not an attention module"),
    ],
)
def test_option_errors(pipeline_dir, tmp_path, capsys, extra, message):
    argv = [
        "inspect",
        "--model",
        pipeline_dir,
        "--prompt",
        "a cat",
        "--steps",
        "2",
        "--size",
        "16x16",
        "--out",
        str(tmp_path / "r"),
        "--quiet",
    ]
    code, captured = _run(argv + extra, capsys)
    assert code == 2 and captured.err.startswith(f"attnkit inspect: error: {message}"), captured.err


def test_pipeline_options_refused_for_a_transformers_model(tmp_path, capsys):
    code, captured = _run(["inspect", "--steps", "3", "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and captured.err.startswith("attnkit inspect: error: --steps: only for a diffusers pipeline directory")


def test_broken_pipeline_directory(tmp_path, capsys):
    (tmp_path / "model_index.json").write_text(
        '{"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"]}'
    )
    code, captured = _run(["inspect", "--model", str(tmp_path), "--out", str(tmp_path / "r"), "--quiet"], capsys)
    assert code == 2 and captured.err.startswith("attnkit inspect: error: --model: could not load a diffusers pipeline"), (
        captured.err
    )


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--seed", "-1"], "--seed: expected an integer >= 0, got '-1'"),
        (["--guidance", "nan"], "--guidance: expected a finite number >= 0, got 'nan'"),
        (["--steps", "0"], "--steps: expected a positive integer, got '0'"),
    ],
)
def test_value_errors_before_loading(tmp_path, capsys, extra, message):
    code, captured = _run(["inspect", "--model", str(tmp_path), *extra], capsys)
    assert code == 2 and captured.err.startswith(f"attnkit inspect: error: {message}"), captured.err
