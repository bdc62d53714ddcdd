import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # for `import helpers`


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# Trained models exported as transformers models (tests/trained_models.py): each trains
# at most once per session, on first use, into the session's temporary directory.


@pytest.fixture(scope="session")
def induction_export(tmp_path_factory) -> str:
    """Directory of a 2-layer softmax LlamaForCausalLM trained on the arena's induction task."""
    from trained_models import induction_export as build

    return build(tmp_path_factory.getbasetemp() / "trained-models")


@pytest.fixture(scope="session")
def needle_export(tmp_path_factory) -> str:
    """Directory of a 2-layer softmax LlamaForCausalLM trained on the arena's needle task."""
    from trained_models import needle_export as build

    return build(tmp_path_factory.getbasetemp() / "trained-models")
