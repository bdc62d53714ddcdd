"""A new diffusion intervention is one file: this one defines ``HalfLogits`` (a
``DiffusionEdit`` that halves a layer's logits), registers it by name, and runs it with
``attnkit.diffusion.edit``; two of them stack (quartered logits), as every edit does."""

import pytest
import torch

pytest.importorskip("diffusers")

import diffusion_tiny as tiny  # noqa: E402
from diffusion_reference import recorded  # noqa: E402

import attnkit.diffusion as ad  # noqa: E402
from attnkit import temperature  # noqa: E402
from attnkit.diffusion.edits import EDIT_TYPES, DiffusionEdit, register_edit  # noqa: E402
from helpers import assert_close  # noqa: E402


class HalfLogits(DiffusionEdit):
    def __init__(self, layer, previous=None, *, factor: float = 0.5):
        super().__init__(previous)
        self.mod = temperature(1.0 / factor)

    def scores(self, layout, query, key):
        return super().scores(layout, query, key) + [self.mod]


@pytest.fixture
def registered():
    register_edit("toy-half", HalfLogits)
    yield
    EDIT_TYPES.pop("toy-half")


def test_a_registered_edit_runs_by_name_and_stacks(registered):
    model, inputs = tiny.MODELS["unet"]()
    with torch.no_grad():
        ref = tiny.run(model, inputs)
        half, _ = recorded(model, lambda: tiny.run(model, inputs), logits=lambda s: s * 0.5)
        quarter, _ = recorded(model, lambda: tiny.run(model, inputs), logits=lambda s: s * 0.25)
        with ad.edit(model, "toy-half"):
            once = tiny.run(model, inputs)
            with ad.edit(model, "toy-half"):
                twice = tiny.run(model, inputs)
        after = tiny.run(model, inputs)
    assert (half - ref).abs().max() > 1e-4
    assert_close(once, half, torch.float32)
    assert_close(twice, quarter, torch.float32)
    assert torch.equal(after, ref) and not any(m in ad.EDITS for m in model.modules())


def test_unknown_edit_is_refused():
    with pytest.raises(ValueError, match="^name: unknown diffusion edit 'nope'"):
        with ad.edit(tiny.MODELS["unet"]()[0], "nope"):
            pass
