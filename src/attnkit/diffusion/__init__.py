"""attnkit inside diffusers models: ``use`` runs their attention on attnkit (mechanisms,
masks, score mods, heads, observers), ``maps`` measures per-token cross-attention maps
while sampling in O(N_image x N_text) memory. Needs the ``[diffusion]`` extra (diffusers).

    with attnkit.diffusion.use(unet, kind="cross", observers=[TokenMaps()]):
        unet(latents, t, encoder_hidden_states=text)
"""

from ..extras import require

require("diffusers", "attnkit.diffusion")  # the [diffusion] extra; named in the error when missing

from .layers import KINDS, AttentionLayer, CallLayout, attention_layers, layer_names
from .maps import DiffusionMaps, maps
from .switch import EDITS, DiffusionSwitch, denoiser, use
from .tokenmaps import TokenMaps

__all__ = [
    "EDITS", "KINDS", "AttentionLayer", "CallLayout", "DiffusionMaps", "DiffusionSwitch", "TokenMaps", "attention_layers",
    "denoiser", "layer_names", "maps", "use",
]

from .style import StyleInjection, adain  # noqa: E402  style injection (StyleID, arXiv 2312.09008)

__all__ += ["StyleInjection", "adain"]

from .guidance import pag  # noqa: E402  perturbed-attention guidance (arXiv 2403.17377)
from .perturb import PerturbState, perturb  # noqa: E402  PAG's identity / SoftPAG's blend (arXiv 2506.10978)

__all__ += ["PerturbState", "pag", "perturb"]

from .headhunter import HuntResult, HuntStep, greedy, head_candidates, hunt, print_progress  # noqa: E402  HeadHunter (arXiv 2506.10978)

__all__ += ["HuntResult", "HuntStep", "greedy", "head_candidates", "hunt", "print_progress"]

from .entropy_scale import EntropyConcentration, LayerEntropy, measure_entropy  # noqa: E402  (UltraImage-style concentration)

__all__ += ["EntropyConcentration", "LayerEntropy", "measure_entropy"]

from .attend_excite import AttendAndExcite, attend_and_excite_loss, attend_and_excite_step, excite_loss  # noqa: E402  (arXiv 2301.13826)
from .gradmaps import MapRecorder, record_maps  # noqa: E402  differentiable per-token maps
from .initno import initno, initno_scores  # noqa: E402  InitNO (arXiv 2404.04650)
from .regulation import AttentionRegulation, TokenBias, regulate  # noqa: E402  attention regulation (arXiv 2403.06381)

__all__ += ["AttendAndExcite", "AttentionRegulation", "MapRecorder", "TokenBias", "attend_and_excite_loss",
            "attend_and_excite_step", "excite_loss", "initno", "initno_scores", "record_maps", "regulate"]
