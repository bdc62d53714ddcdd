"""attnkit inside diffusers models: ``use`` runs their attention on attnkit (mechanisms,
masks, score mods, heads, observers), ``maps`` measures per-token cross-attention maps
while sampling in O(N_image x N_text) memory. Needs the ``[diffusion]`` extra (diffusers).

    with attnkit.diffusion.use(unet, kind="cross", observers=[TokenMaps()]):
        unet(latents, t, encoder_hidden_states=text)
"""

from .layers import KINDS, AttentionLayer, CallLayout, attention_layers, layer_names
from .maps import DiffusionMaps, maps
from .switch import EDITS, DiffusionSwitch, denoiser, use
from .tokenmaps import TokenMaps

__all__ = [
    "EDITS", "KINDS", "AttentionLayer", "CallLayout", "DiffusionMaps", "DiffusionSwitch", "TokenMaps", "attention_layers",
    "denoiser", "layer_names", "maps", "use",
]
