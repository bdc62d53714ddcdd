"""Loading a local transformers model directory, offline and in float32: the one loader
behind ``attnkit inspect`` (``inspection.loading``) and the probes (``probes.model``).

``name`` is what errors are prefixed with (``"model"`` for a Python argument, ``"--model"``
where the command line asked). Callers check for transformers first (``extras.require``)
so that a missing extra is named as theirs."""

from __future__ import annotations

import os


def model_directory(path, name: str = "model") -> str:
    """``path`` (or a model organism's name, see ``attnkit.organisms``) as a checked
    transformers model directory: it exists, is a directory and has a config.json."""
    from ..organisms.store import resolve_model_path

    path = resolve_model_path(str(path), name)  # an organism's name -> its shipped, verified export
    if not os.path.exists(path):
        raise FileNotFoundError(f"{name}: no such directory: {path}")
    if not os.path.isdir(path):
        raise ValueError(f"{name}: {path} is a file; expected a transformers model directory (config.json and weights)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{name}: {path} is not a transformers model directory (it has no config.json)")
    return path


def load_pretrained(loader, path: str, name: str = "model", what: str = "a transformers model"):
    """``loader.from_pretrained(path)`` offline in float32, transformers' load report
    silenced (a bare class leaves a saved LM head unused: expected, not news)."""
    import torch
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return loader.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{name}: could not load {what} from {path}: {e}") from e
    finally:
        hf_logging.set_verbosity(verbosity)


def load_tokenizer(path: str, name: str = "model", hint: str = ""):
    """The directory's tokenizer; ``hint`` ends the error when there is none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{name}: {path} has no usable tokenizer ({e}){hint}") from e
