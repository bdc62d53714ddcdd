"""attnkit inside Hugging Face transformers (>= 5): any model that routes attention
through ``AttentionInterface`` runs on attnkit's kernels, mechanisms and observers.

    model, tok = attnkit.hf.load_default_model()
    with attnkit.hf.use(model, mask=attnkit.window(8), observers=[meter]):
        model(**tok(["a sentence"], return_tensors="pt"))
"""

from ..extras import require

require("transformers", "attnkit.hf")  # the [hf] extra; named in the error when missing

from .attention import attnkit_attention_forward  # noqa: E402
from .default_model import default_model_path, load_default_model, mean_pool  # noqa: E402
from .masks import MaskSpec, mask_spec  # noqa: E402
from .switch import NAME, Switch, check_model, register, use  # noqa: E402

__all__ = [
    "NAME",
    "MaskSpec",
    "Switch",
    "attnkit_attention_forward",
    "check_model",
    "default_model_path",
    "load_default_model",
    "mask_spec",
    "mean_pool",
    "register",
    "use",
]
