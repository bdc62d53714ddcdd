"""attnkit inside diffusers denoisers: step time and the memory of per-token maps.

Subjects are random diffusers models built from configs (no download): a small
SD-shaped UNet2DConditionModel (two cross-attention levels, 8 heads of 8, 77 text
tokens of width 64) and a small Flux transformer (1 double- and 2 single-stream blocks).
Weights are random: cost is measured here, not quality.

- step: one denoiser forward of a model held inside ``attnkit.diffusion.use`` (nothing
  changed; entered once, as for a sampling loop) against the same forward of an
  identical copy on its default processors, interleaved medians, target <= 1.1x (what
  entering and leaving ``use`` costs is reported beside it); and the same
  forward feeding ``TokenMaps`` (per-token cross-attention maps), reported without target;
  and a UNet step under perturbed-attention guidance against the same rows unperturbed.
- memory: at a 64 x 64 latent, the bytes ``TokenMaps`` holds for per-token maps of
  every cross-attention layer against the bytes of storing each call's full attention
  maps (B x H x Nq x Nk float32 for every self- and cross-attention call, as an
  attention store that keeps the maps would), counted from the calls the step made.

``quick`` uses a 16 x 16 latent for the step rows, one repeat, and a 32 x 32 latent for
the memory row (seconds).
"""

from __future__ import annotations

import copy
import time

import torch

from .harness import Row, run_steps, time_pair

STEPS = 3
TARGET_STEP = 1.1
TEXT = 77


def unet(latent: int):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    model = UNet2DConditionModel(
        sample_size=latent,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=64,
        attention_head_dim=8,
        norm_num_groups=8,
    ).eval()  # type: ignore[attr-defined]  # diffusers' TYPE_CHECKING exports are its dummy classes
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        sample=torch.randn(1, 4, latent, latent, generator=g),
        timestep=torch.tensor(10),
        encoder_hidden_states=torch.randn(1, TEXT, 64, generator=g),
    )
    return model, inputs


def flux(latent: int):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,
        pooled_projection_dim=16,
        axes_dims_rope=(4, 4, 8),
    ).eval()  # type: ignore[attr-defined]  # diffusers' TYPE_CHECKING exports are its dummy classes
    g = torch.Generator().manual_seed(1)
    side = latent // 2
    ids = torch.zeros(side, side, 3)
    ids[..., 1], ids[..., 2] = torch.arange(side)[:, None], torch.arange(side)[None, :]
    inputs = dict(
        hidden_states=torch.randn(1, side * side, 16, generator=g),
        encoder_hidden_states=torch.randn(1, TEXT, 32, generator=g),
        pooled_projections=torch.randn(1, 16, generator=g),
        timestep=torch.tensor([0.5]),
        img_ids=ids.reshape(-1, 3),
        txt_ids=torch.zeros(TEXT, 3),
    )
    return model, inputs


def step_cases(latent: int, repeats: int) -> list[Row]:
    """A step of a model held inside ``use`` against the same step of an identical copy
    on its default processors, interleaved. ``use`` is entered once, as a sampling loop
    enters it once for all its steps; what entering and leaving costs is timed apart."""
    from ..diffusion.switch import use
    from ..diffusion.tokenmaps import TokenMaps

    rows = []
    for name, build in (("UNet2DConditionModel", unet), ("Flux", flux)):
        model, inputs = build(latent)
        twin = copy.deepcopy(model)

        def step(m):
            with torch.no_grad():
                m(**inputs)

        size = f"latent {latent}x{latent}, {TEXT} text tokens"
        with use(twin):
            a, b = time_pair(lambda: step(twin), lambda: step(model), repeats=repeats)
        switch_ms = _switch_ms(twin, use)
        rows.append(
            Row(
                "diffusion",
                f"{name} step under use()",
                size,
                a,
                "default processors (torch SDPA)",
                b,
                f"<= {TARGET_STEP}x",
                a / b <= TARGET_STEP,
                f"entering and leaving use() once per sampling run: {switch_ms:.2f} ms",
            )
        )
        with use(twin, observers=[TokenMaps()]):
            a, b = time_pair(lambda: step(twin), lambda: step(model), repeats=repeats)
        rows.append(
            Row(
                "diffusion",
                f"{name} step with TokenMaps",
                size,
                a,
                "default processors (torch SDPA)",
                b,
                "",
                None,
                "per-token maps of every text-attending layer",
            )
        )
    rows.append(pag_case(latent, repeats))
    return rows


def _switch_ms(model, use, times: int = 20) -> float:
    start = time.perf_counter()
    for _ in range(times):
        with use(model):
            pass
    return (time.perf_counter() - start) / times * 1e3


def pag_case(latent: int, repeats: int) -> Row:
    """A UNet step under perturbed-attention guidance (every self-attention layer
    perturbed, no CFG: the conditional row runs twice, once perturbed) against the
    default processors on the same two rows."""
    from ..diffusion.guidance import pag
    from ..diffusion.layers import layer_names

    model, inputs = unet(latent)
    doubled = {k: (torch.cat([v, v]) if k != "timestep" else v) for k, v in inputs.items()}

    def guided():
        with torch.no_grad(), pag(model, layer_names(model, kind="self"), 3.0, cfg=False):
            model(**inputs)

    def default():
        with torch.no_grad():
            model(**doubled)

    a, b = time_pair(guided, default, repeats=repeats)
    return Row(
        "diffusion",
        "UNet2DConditionModel step with PAG",
        f"latent {latent}x{latent}, {TEXT} text tokens",
        a,
        "default processors, the same 2 rows",
        b,
        "",
        None,
        "all self-attention layers perturbed, no CFG",
    )


def memory_case(latent: int) -> list[Row]:
    """TokenMaps' state against the full maps of the same step, counted from its calls."""
    from ..diffusion.switch import use
    from ..diffusion.tokenmaps import TokenMaps
    from ..observe import Observer, Selection

    class Shapes(Observer):
        def __init__(self):
            self.full = 0

        def wants(self, call):
            return Selection(heads=())  # no tiles: only the call's sizes are counted

        def begin(self, call):
            self.full += call.batch * call.heads * call.q_len * call.k_len * 4

    model, inputs = unet(latent)
    maps, shapes = TokenMaps(), Shapes()
    with torch.no_grad(), use(model, observers=[maps, shapes]):
        model(**inputs)
    ours, full = maps.state_bytes(), shapes.full
    return [
        Row(
            "diffusion",
            "memory: per-token maps, one step, all layers",
            f"latent {latent}x{latent}, {TEXT} tokens",
            None,
            "full attention maps of the same calls",
            None,
            "",
            None,
            f"TokenMaps {ours / 2**20:.2f} MiB vs full maps {full / 2**20:.1f} MiB ({full / ours:.0f}x)",
            extra={"tokenmaps_bytes": ours, "full_maps_bytes": full},
        )
    ]


def run(quick: bool = False, progress=None) -> list[Row]:
    import importlib.util

    if importlib.util.find_spec("diffusers") is None:
        return run_steps(
            [
                (
                    "diffusers not installed",
                    lambda: [
                        Row("diffusion", "all cases", "-", None, "-", None, "", None, "skipped: pip install 'attnkit[diffusion]'")
                    ],
                ),
                ("done", lambda: []),
                ("done", lambda: []),
            ],
            progress,
        )
    latent, repeats, memory_latent = (16, 1, 32) if quick else (64, 9, 64)
    steps = [
        (f"step latent {latent}", lambda: step_cases(latent, repeats)),
        (f"memory latent {memory_latent}", lambda: memory_case(memory_latent)),
        ("done", lambda: []),
    ]
    return run_steps(steps, progress)
