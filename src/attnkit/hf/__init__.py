"""attnkit inside Hugging Face transformers (>= 5): any model that routes attention
through ``AttentionInterface`` runs on attnkit's kernels, mechanisms and observers.

    model, tok = attnkit.hf.load_default_model()
    with attnkit.hf.use(model, mask=attnkit.window(8), observers=[meter]):
        model(**tok(["a sentence"], return_tensors="pt"))
"""

from .attention import attnkit_attention_forward
from .default_model import default_model_path, load_default_model, mean_pool
from .masks import MaskSpec, mask_spec
from .switch import NAME, Switch, register, use

__all__ = [
    "NAME", "MaskSpec", "Switch", "attnkit_attention_forward", "default_model_path", "load_default_model",
    "mask_spec", "mean_pool", "register", "use",
]
