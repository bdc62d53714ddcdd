import pytest
import torch

from attnkit.organisms.recipes import Recipe, Stage

#: a recipe of seconds: an induction stage, then a needle curriculum with a warm start
TINY = Recipe(
    name="tiny-needle",
    summary="a test recipe",
    stages=(
        Stage(
            "copy",
            "induction",
            dict(vocab_size=32, seq_len=16, min_segment=4, max_segment=8),
            dict(steps=3, batch_size=4, eval_every=3, eval_examples=4, target_accuracy=None),
        ),
        Stage(
            "grow",
            "needle",
            dict(seq_len=16, num_filler=8, num_keys=8, num_values=8, distractors=1, num_depths=3),
            dict(
                schedule="16:2,32+64:2x4",
                batch_size=4,
                eval_every=2,
                eval_examples=6,
                eval_lengths=[32, 64],
                criterion="cell",
                keep_best=True,
            ),
            max_len=64,
        ),
    ),
    d_model=16,
    layers=1,
    heads=2,
    card_lengths=(16, 64),
    card_examples=9,
    known_failures=("everything: it trained for 7 steps",),
)


@pytest.fixture(autouse=True)
def _one_thread():
    """Organisms are tiny models: one intra-op thread is fastest on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_recipe() -> Recipe:
    return TINY
