"""Tiny random diffusers models built from configs, with inputs for one denoiser call.

Each builder returns (model, kwargs of one forward call, the name of the output tensor
field). Sizes are chosen so that a forward takes milliseconds on CPU."""

from __future__ import annotations

import torch

TEXT = 5  # text tokens


def unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    model = UNet2DConditionModel(
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
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        sample=torch.randn(2, 4, 8, 6, generator=g),
        timestep=torch.tensor(3),
        encoder_hidden_states=torch.randn(2, TEXT, 12, generator=g),
    )
    return model, inputs


def dit(num_layers: int = 2):
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(0)
    model = DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        num_layers=num_layers,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=10,
        norm_num_groups=4,
    ).eval()
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(2, 4, 8, 8, generator=g), timestep=torch.tensor([3, 5]), class_labels=torch.tensor([1, 2])
    )
    return model, inputs


def pixart():
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(0)
    model = PixArtTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=8,
        num_layers=2,
        cross_attention_dim=16,
        sample_size=8,
        patch_size=2,
        caption_channels=12,
        norm_num_groups=4,
    ).eval()
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(2, 4, 8, 8, generator=g),
        encoder_hidden_states=torch.randn(2, TEXT, 12, generator=g),
        timestep=torch.tensor([3, 5]),
        added_cond_kwargs={"resolution": None, "aspect_ratio": None},
    )
    return model, inputs


def sd3(qk_norm=None):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=12,
        caption_projection_dim=16,
        pooled_projection_dim=6,
        out_channels=4,
        pos_embed_max_size=8,
        qk_norm=qk_norm,
    ).eval()
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(2, 4, 8, 8, generator=g),
        encoder_hidden_states=torch.randn(2, TEXT, 12, generator=g),
        pooled_projections=torch.randn(2, 6, generator=g),
        timestep=torch.tensor([3, 5]),
    )
    return model, inputs


def flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=8,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=12,
        pooled_projection_dim=6,
        axes_dims_rope=(2, 2, 4),
    ).eval()
    g = torch.Generator().manual_seed(1)
    h, w = 4, 6
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    inputs = dict(
        hidden_states=torch.randn(2, h * w, 8, generator=g),
        encoder_hidden_states=torch.randn(2, TEXT, 12, generator=g),
        pooled_projections=torch.randn(2, 6, generator=g),
        timestep=torch.tensor([0.3, 0.5]),
        img_ids=img_ids.reshape(h * w, 3),
        txt_ids=torch.zeros(TEXT, 3),
    )
    return model, inputs


#: name -> builder
MODELS = {
    "unet": unet,
    "dit": dit,
    "pixart": pixart,
    "sd3": sd3,
    "sd3_qknorm": lambda: sd3("rms_norm"),
    "flux": flux,
}


def cross_only(grids):
    """The map layout of a model whose text arrives by cross-attention (``attn2``
    modules): every query row is an image token, every key a text token; ``grids`` maps
    a call's number of image tokens to its (h, w)."""

    def layout(name, nq, nk):
        return (slice(None), slice(None), grids[nq]) if name.endswith("attn2") else None

    return layout


def sd3_layout(name, nq, nk):
    n_img = nq - TEXT  # [image; text], 16 image tokens (8x8 latent, patch 2)
    return slice(0, n_img), slice(n_img, n_img + TEXT), (4, 4)


def flux_layout(name, nq, nk):
    return slice(TEXT, None), slice(0, TEXT), (4, 6)  # [text; image], double- and single-stream blocks


#: name -> (layout, grid): where image queries and text keys sit in each attention call
#: of the model (``layout(module path, Nq, Nk)`` -> (image rows, text columns, (h, w)) or
#: None for a call without text keys; see ``diffusion_reference.dense_maps``) and the
#: latent grid of its image tokens at full resolution. DiT has no text.
MAP_LAYOUTS = {
    "unet": (cross_only({48: (8, 6), 12: (4, 3)}), (8, 6)),
    "pixart": (cross_only({16: (4, 4)}), (4, 4)),
    "sd3": (sd3_layout, (4, 4)),
    "sd3_qknorm": (sd3_layout, (4, 4)),
    "flux": (flux_layout, (4, 6)),
}


def run(model, inputs) -> torch.Tensor:
    out = model(**inputs, return_dict=False)
    return out[0]


def pipeline():
    """A tiny StableDiffusionPipeline: the tiny UNet, a small AutoencoderKL (16x16 pixels
    <-> 8x8 latents), DDIM, no tokenizer/text encoder/safety checker. Returns (pipeline,
    kwargs of one call): ``prompt_embeds`` and ``negative_prompt_embeds`` (1, TEXT, 12),
    2 steps, guidance_scale 3, 16x16, ``output_type="latent"`` (pass a generator for
    reproducible noise). A call runs in well under a second on CPU."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline

    model, _ = unet()
    torch.manual_seed(0)
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
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        unet=model,
        scheduler=DDIMScheduler(clip_sample=False, steps_offset=1),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(2)
    call = dict(
        prompt_embeds=torch.randn(1, TEXT, 12, generator=g),
        negative_prompt_embeds=torch.randn(1, TEXT, 12, generator=g),
        num_inference_steps=2,
        guidance_scale=3.0,
        height=16,
        width=16,
        output_type="latent",
    )
    return pipe, call
