"""The organisms attnkit knows, as recipes (data only: nothing here trains or loads).

Why these stages: a needle-retrieval circuit does not form from scratch even at 128
tokens (0.26 after 800 steps, chance 0.25), but it is an induction circuit reading the
value after the queried key (Olsson et al., arXiv 2209.11895), so the needle models start
from an induction model; and RoPE models read lengths they were trained on, so the
length grows in stages, the last of them alternating lengths (training on the longest
alone made shorter ones worse).
"""

from __future__ import annotations

from .recipes import Recipe, Stage

#: Induction with copies at random distances (the tests' recipe, tests/trained_models.py).
INDUCTION_32 = Stage("induction-32", "induction", dict(vocab_size=32, seq_len=32, min_segment=8, max_segment=14),
                     dict(steps=1500, batch_size=32, lr=3e-3, eval_every=50, eval_examples=256, target_accuracy=0.999))

#: The needle task of the organisms: 3 distractor pairs, 8 fillers, 8 keys, 8 values (25 symbols).
NEEDLE = dict(num_filler=8, num_keys=8, num_values=8, distractors=3)

NEEDLE_32 = Stage("needle-32", "needle", dict(seq_len=32, **NEEDLE),
                  dict(steps=600, batch_size=64, lr=1e-3, eval_every=50, eval_examples=256, target_accuracy=0.99))

RECIPES: dict[str, Recipe] = {}


def register(recipe: Recipe) -> Recipe:
    RECIPES[recipe.name] = recipe
    return recipe


register(Recipe(
    name="needle-32",
    summary="needle retrieval (3 distractors) at 32 tokens; an induction model taught the needle task",
    stages=(INDUCTION_32, NEEDLE_32),
    card_lengths=(32, 64, 128),
    card_examples=500,
    known_failures=("positions past 32 were never trained: accuracy at 64 and 128 tokens is on the card",),
))

#: needle-32's stages, then the length curriculum to 1024 (the last stage alternates 512 and 1024)
NEEDLE_1K = Stage("needle-1k", "needle", dict(seq_len=128, **NEEDLE),
                  dict(schedule="128:125x32,512:50x16,1024:100x8,512+1024:300x16", batch_size=32, lr=1e-3, eval_every=25,
                       eval_examples=200, eval_lengths=[512, 1024], criterion="cell", keep_best=True,
                       target_accuracy=0.98),
                  max_len=1024)

register(Recipe(
    name="needle-1k",
    summary="needle retrieval (3 distractors) at every depth up to 1024 tokens",
    stages=(INDUCTION_32, NEEDLE_32, NEEDLE_1K),
    card_lengths=(128, 512, 1024, 2048),
    card_examples=500,
    known_failures=("2048 tokens (twice its context) were never trained: accuracy there is on the card",),
))

register(Recipe(
    name="needle-2k",
    summary="needle retrieval (3 distractors) at every depth up to 2048 tokens",
    stages=(INDUCTION_32, NEEDLE_32, NEEDLE_1K,
            Stage("needle-2k", "needle", dict(seq_len=128, **NEEDLE),
                  dict(schedule="512+1024+2048:600x16", batch_size=32, lr=1e-3, eval_every=50, eval_examples=200,
                       eval_lengths=[512, 1024, 2048], criterion="cell", keep_best=True, target_accuracy=0.98),
                  max_len=2048)),
    card_lengths=(128, 512, 1024, 2048, 4096),
    card_examples=500,
    known_failures=("4096 tokens (twice its context) were never trained: accuracy there is on the card",),
))

#: 8 key-value pairs (7 distractors: every key and value of an example distinct), the gold pair at one of 9 depths.
#: The vocabulary is needle-1k's, so every embedding row keeps its role: a first try with 16 keys and 16 values
#: (needle-1k's value rows landing on new keys, the new values fresh) stayed at chance, 0.06, for 150 steps.
KV_PAIRS = dict(num_filler=8, num_keys=8, num_values=8, distractors=7, num_depths=9)

register(Recipe(
    name="kv-retrieval-1k",
    summary="key-value retrieval among 8 pairs at up to 1024 tokens, the gold pair at any of 9 depths "
            "(the subject for lost-in-the-middle curves)",
    stages=(INDUCTION_32, NEEDLE_32, NEEDLE_1K,
            Stage("kv-retrieval-1k", "needle", dict(seq_len=128, **KV_PAIRS),
                  dict(schedule="512+1024:400x16", batch_size=32, lr=1e-3, eval_every=50, eval_examples=270,
                       eval_lengths=[512, 1024], criterion="accuracy", keep_best=True, target_accuracy=0.98),
                  max_len=1024)),
    card_lengths=(256, 512, 1024, 2048),
    card_examples=540,
    known_failures=("accuracy by the gold pair's depth is on the card, whatever its shape (the curve it is a subject for)",
                    "2048 tokens (twice its context) were never trained: accuracy there is on the card"),
))


def names() -> list[str]:
    return sorted(RECIPES)


def recipe(name: str) -> Recipe:
    """The recipe registered as ``name``; an unknown name lists the known ones."""
    if name not in RECIPES:
        raise ValueError(f"name: no organism {name!r}; known: {', '.join(names())}")
    return RECIPES[name]


__all__ = ["RECIPES", "names", "recipe", "register"]
