"""The smallest recipe rebuilt from scratch lands on its shipped card.

``needle-32`` (induction at 32 tokens, then the needle task; about a minute on one core)
is retrained and measured on the card's own prompts, so only the weights can differ: on
the machine that built the shipped files they are the same bit for bit; elsewhere float
reductions may order differently and training drift a little. Stated tolerance: within
the model's context (32 tokens) the rebuilt accuracy, overall and at every depth, is
within 0.03 of the card's (the card says 1.0 there; 0.03 is 15 of the 500 prompts).
Longer lengths are not held to the card: what a model does on positions it
never trained is not stable across rebuilds.
"""

import pytest
import torch

from attnkit import organisms
from attnkit.organisms.builder import compare

TOLERANCE = 0.03


@pytest.mark.slow
def test_needle_32_rebuilds_within_tolerance_of_its_card(tmp_path):
    if "needle-32" not in organisms.shipped():
        pytest.skip("needle-32 is not shipped in this install")
    shipped = organisms.card("needle-32")
    rebuilt = organisms.build("needle-32", str(tmp_path / "needle-32"))
    distance = compare(rebuilt, shipped)
    if shipped["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability():
        # the same kernels, the same evaluations: each stage stops at the card's step
        assert rebuilt["training"]["steps"] == shipped["training"]["steps"]
    else:
        # AVX2 against AVX-512 orders float reductions otherwise, so a stage may reach its
        # target accuracy an evaluation or two apart; each must still reach it
        assert all(stage["stopped_early"] for stage in rebuilt["training"]["stages"]), rebuilt["training"]["stages"]
    for length, cells in distance["differences"].items():
        if int(length) <= shipped["model"]["trained_up_to"]:
            assert max(abs(d) for d in cells.values()) <= TOLERANCE, (length, cells)
