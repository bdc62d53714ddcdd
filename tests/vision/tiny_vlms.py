"""Tiny random-init vision-language models built from configs (nothing is downloaded),
with batches of several images and left padding, one builder per family."""

import torch
import transformers as T

VOCAB = 120
IMAGE, PAD, BOS = 100, 0, 1
_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=2,
)


def llava():
    vc = T.CLIPVisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=12, patch_size=4
    )
    return T.LlavaConfig(
        vision_config=vc,
        text_config=dict(model_type="llama", **_TEXT),
        image_token_id=IMAGE,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )


def qwen2_vl():
    text = dict(_TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    vc = dict(
        depth=2,
        embed_dim=32,
        hidden_size=64,
        num_heads=2,
        mlp_ratio=2,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        in_channels=3,
    )
    return T.Qwen2VLConfig(
        text_config=text,
        vision_config=vc,
        image_token_id=IMAGE,
        video_token_id=101,
        vision_start_token_id=103,
        vision_end_token_id=104,
    )


def idefics3():
    vc = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=4)
    return T.Idefics3Config(text_config=dict(model_type="llama", **_TEXT), vision_config=vc, image_token_id=IMAGE, scale_factor=2)


CONFIGS = {"llava": llava, "qwen2_vl": qwen2_vl, "idefics3": idefics3}
CLASSES = {
    "llava": T.LlavaForConditionalGeneration,
    "qwen2_vl": T.Qwen2VLForConditionalGeneration,
    "idefics3": T.Idefics3ForConditionalGeneration,
}
FAMILIES = list(CONFIGS)


def build(name: str, dtype=torch.float64, attn_implementation: str = "eager"):
    torch.manual_seed(0)
    config = CONFIGS[name]()
    model = CLASSES[name]._from_config(config, attn_implementation=attn_implementation)
    model = model.to(dtype).eval()
    with torch.no_grad():  # random-init logits are tiny: sharpen the decoder's queries so attention is not uniform
        decoder = getattr(model.model, "language_model", None) or model.model.text_model
        for layer in decoder.layers:
            layer.self_attn.q_proj.weight.mul_(20.0)
    return model


def _row(prefix, images, suffix, n):
    out = list(prefix)
    for i, k in enumerate(images):
        out += [IMAGE] * k + ([7 + i] if i < len(images) - 1 else [])
    return out + list(suffix)


def batch(name: str, dtype=torch.float64, seed: int = 1):
    """Two rows, left-padded: row 0 with two images, row 1 with one. Returns the model
    inputs (the processor's fields for the family) and the image token count per image."""
    g = torch.Generator().manual_seed(seed)
    if name == "qwen2_vl":
        thw = torch.tensor([[1, 4, 4], [1, 4, 6], [1, 4, 4]])
        sizes = (thw.prod(-1) // 4).tolist()
        rows = [
            [BOS, 103] + [IMAGE] * sizes[0] + [104, 5, 103] + [IMAGE] * sizes[1] + [104, 6, 8],
            [BOS, 9, 103] + [IMAGE] * sizes[2] + [104, 11],
        ]
        extra = {
            "pixel_values": torch.randn(int(thw.prod(-1).sum()), 3 * 2 * 4 * 4, generator=g, dtype=dtype),
            "image_grid_thw": thw,
        }
    elif name == "llava":
        sizes = [9, 9, 9]
        rows = [[BOS, 3] + [IMAGE] * 9 + [5] + [IMAGE] * 9 + [6, 8], [BOS, 9] + [IMAGE] * 9 + [10, 11]]
        extra = {"pixel_values": torch.randn(3, 3, 12, 12, generator=g, dtype=dtype)}
    else:
        sizes = [4, 4, 4]
        rows = [[BOS, 3] + [IMAGE] * 4 + [5] + [IMAGE] * 4 + [6, 8], [BOS, 9, 12] + [IMAGE] * 4 + [10, 11]]
        px = torch.randn(2, 2, 3, 16, 16, generator=g, dtype=dtype)
        px[1, 1] = 0  # row 1 has one image: the second slot is padding
        extra = {"pixel_values": px}
    n = max(map(len, rows))
    ids = torch.tensor([[PAD] * (n - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (n - len(r)) + [1] * len(r) for r in rows])
    inputs = {"input_ids": ids, "attention_mask": mask, **extra}
    if name == "qwen2_vl":
        inputs["mm_token_type_ids"] = (ids == IMAGE).int()
    return inputs, sizes


WORDS = (
    ["<pad>", "<s>", "</s>", "<unk>"]
    + [f"w{i}" for i in range(96)]
    + ["<image>"]
    + ["is", "there", "a", "red", "circle", "?", "what", "color", "yes", "no"]
)


def save_llava(directory: str) -> None:
    """A float32 tiny LLaVA with its processor (a word-level tokenizer, a CLIP image
    processor resizing to 12 x 12: 9 image tokens) saved as a model directory."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import LlavaProcessor, PreTrainedTokenizerFast
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    assert WORDS.index("<image>") == IMAGE and len(WORDS) <= VOCAB
    model = build("llava", dtype=torch.float32, attn_implementation="sdpa")
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.add_special_tokens(
        [AddedToken("<pad>", special=True, normalized=False), AddedToken("<image>", special=True, normalized=False)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )
    size = {"height": 12, "width": 12}
    images = CLIPImageProcessorPil(
        size=size,
        crop_size=size,
        do_resize=True,
        do_center_crop=False,
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        do_convert_rgb=True,
    )
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=4,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
    )
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
