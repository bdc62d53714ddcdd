"""attnkit inside diffusers models: ``use`` runs their attention on attnkit (mechanisms,
masks, score mods, heads, observers), ``maps`` measures per-token cross-attention maps
while sampling in O(N_image x N_text) memory; interventions are ``DiffusionEdit``s
(``edits.py``: the protocol, stacking, ``register_edit``). Needs the ``[diffusion]``
extra (diffusers).

    with attnkit.diffusion.use(unet, kind="cross", observers=[TokenMaps()]):
        unet(latents, t, encoder_hidden_states=text)

Modules are found, not listed (as mechanisms are): every module of this package is
imported with it and what its ``__all__`` names is exported here, so a new intervention
is one new file.
"""

import importlib
import pkgutil

from ..extras import require


def _export_all() -> list[str]:
    require("diffusers", "attnkit.diffusion")  # the [diffusion] extra; named in the error when missing
    names: list[str] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for name in getattr(module, "__all__", ()):
            if name not in names:
                globals()[name] = getattr(module, name)
                names.append(name)
    return sorted(names)


__all__ = _export_all()
