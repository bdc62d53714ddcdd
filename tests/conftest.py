import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # for `import helpers`


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# Trained test subjects: the shipped organisms (attnkit.organisms; their cards say what they
# do), copied once per session into its temporary directory so that no test can write into
# the installed package.


def _organism_copy(tmp_path_factory, name: str) -> str:
    import shutil

    from attnkit import organisms

    target = tmp_path_factory.getbasetemp() / "organisms" / name
    if not target.is_dir():
        shutil.copytree(organisms.path(name), target)  # path() checks every file's hash first
    return str(target)


@pytest.fixture(scope="session")
def induction_export(tmp_path_factory) -> str:
    """A 2-layer softmax LlamaForCausalLM trained on the arena's induction task: the
    induction-32 organism (segments of 8-14 tokens among filler, 0.999 at 32 tokens)."""
    return _organism_copy(tmp_path_factory, "induction-32")


@pytest.fixture(scope="session")
def needle_export(tmp_path_factory) -> str:
    """A 2-layer softmax LlamaForCausalLM trained on the arena's needle task (3
    distractors, 32 tokens): the needle-32 organism."""
    return _organism_copy(tmp_path_factory, "needle-32")
