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

#: Induction with copies at random distances (shipped as induction-32, the tests' induction_export).
INDUCTION_32 = Stage(
    "induction-32",
    "induction",
    dict(vocab_size=32, seq_len=32, min_segment=8, max_segment=14),
    dict(steps=1500, batch_size=32, lr=3e-3, eval_every=50, eval_examples=256, target_accuracy=0.999),
)

#: The needle task of the organisms: 3 distractor pairs, 8 fillers, 8 keys, 8 values (25 symbols).
NEEDLE = dict(num_filler=8, num_keys=8, num_values=8, distractors=3)

NEEDLE_32 = Stage(
    "needle-32",
    "needle",
    dict(seq_len=32, **NEEDLE),
    dict(steps=600, batch_size=64, lr=1e-3, eval_every=50, eval_examples=256, target_accuracy=0.99),
)

RECIPES: dict[str, Recipe] = {}


def kept_best(
    eval_lengths: list[int],
    eval_every: int = 25,
    eval_examples: int = 200,
    criterion: str = "cell",
    target: float = 0.98,
    **train,
) -> dict:
    """The training settings of a long stage: batches of 32 at lr 1e-3, evaluated every
    ``eval_every`` steps on ``eval_examples`` held-out prompts at ``eval_lengths``, the
    checkpoint of the best ``criterion`` score kept, stopping at ``target`` (plus ``train``:
    a schedule, a step count)."""
    return dict(
        batch_size=32,
        lr=1e-3,
        eval_every=eval_every,
        eval_examples=eval_examples,
        eval_lengths=eval_lengths,
        criterion=criterion,
        keep_best=True,
        target_accuracy=target,
        **train,
    )


def register(recipe: Recipe) -> Recipe:
    RECIPES[recipe.name] = recipe
    return recipe


register(
    Recipe(
        name="induction-32",
        summary="an induction circuit at 32 tokens: a repeated segment of 8-14 distinct tokens among filler, copied by "
        "content (the start of every needle organism)",
        stages=(INDUCTION_32,),
        card_lengths=(32, 64, 128),
        card_examples=500,
        known_failures=("positions past 32 were never trained: accuracy at 64 and 128 tokens is on the card",),
    )
)

register(
    Recipe(
        name="needle-32",
        summary="needle retrieval (3 distractors) at 32 tokens; an induction model taught the needle task",
        stages=(INDUCTION_32, NEEDLE_32),
        card_lengths=(32, 64, 128),
        card_examples=500,
        known_failures=("positions past 32 were never trained: accuracy at 64 and 128 tokens is on the card",),
    )
)

#: needle-32's stages, then the length curriculum to 1024 (the last stage alternates 512 and 1024)
NEEDLE_1K = Stage(
    "needle-1k",
    "needle",
    dict(seq_len=128, **NEEDLE),
    kept_best([512, 1024], schedule="128:125x32,512:50x16,1024:100x8,512+1024:300x16"),
    max_len=1024,
)

register(
    Recipe(
        name="needle-1k",
        summary="needle retrieval (3 distractors) at every depth up to 1024 tokens",
        stages=(INDUCTION_32, NEEDLE_32, NEEDLE_1K),
        card_lengths=(128, 512, 1024, 2048),
        card_examples=500,
        known_failures=("2048 tokens (twice its context) were never trained: accuracy there is on the card",),
    )
)

register(
    Recipe(
        name="needle-2k",
        summary="needle retrieval (3 distractors) at every depth up to 2048 tokens",
        stages=(
            INDUCTION_32,
            NEEDLE_32,
            NEEDLE_1K,
            Stage(
                "needle-2k",
                "needle",
                dict(seq_len=128, **NEEDLE),
                kept_best([512, 1024, 2048], eval_every=50, schedule="512+1024+2048:600x16"),
                max_len=2048,
            ),
        ),
        card_lengths=(128, 512, 1024, 2048, 4096),
        card_examples=500,
        known_failures=("4096 tokens (twice its context) were never trained: accuracy there is on the card",),
    )
)

#: 8 key-value pairs (7 distractors: every key and value of an example distinct), the gold pair at one of 9 depths.
#: The vocabulary is needle-1k's, so every embedding row keeps its role: a first try with 16 keys and 16 values
#: (needle-1k's value rows landing on new keys, the new values fresh) stayed at chance, 0.06, for 150 steps.
KV_PAIRS = dict(num_filler=8, num_keys=8, num_values=8, distractors=7, num_depths=9)

register(
    Recipe(
        name="kv-retrieval-1k",
        summary="key-value retrieval among 8 pairs at up to 1024 tokens, the gold pair at any of 9 depths "
        "(the subject for lost-in-the-middle curves)",
        stages=(
            INDUCTION_32,
            NEEDLE_32,
            NEEDLE_1K,
            Stage(
                "kv-retrieval-1k",
                "needle",
                dict(seq_len=128, **KV_PAIRS),
                kept_best([512, 1024], eval_every=50, eval_examples=270, criterion="accuracy", schedule="512+1024:400x16"),
                max_len=1024,
            ),
        ),
        card_lengths=(256, 512, 1024, 2048),
        card_examples=540,
        known_failures=(
            "accuracy by the gold pair's depth is on the card, whatever its shape (the curve it is a subject for)",
            "2048 tokens (twice its context) were never trained: accuracy there is on the card",
        ),
    )
)


#: Induction with the copy up to a thousand tokens after the segment it repeats: induction-32's model, then the
#: spread task (a random gap of filler between the copies) grown from 128 to 1024 tokens.
INDUCTION_SPREAD = dict(vocab_size=32, min_segment=8, max_segment=14, spread=True)

register(
    Recipe(
        name="induction-1k",
        summary="induction heads that copy a repeated segment up to ~1000 tokens after it, at every gap up to 1024 tokens",
        stages=(
            INDUCTION_32,
            Stage(
                "induction-1k",
                "induction",
                dict(seq_len=128, **INDUCTION_SPREAD),
                kept_best([512, 1024], target=0.995, schedule="128:200x32,512:100x16,1024:100x8,512+1024:200x16"),
                max_len=1024,
            ),
        ),
        card_lengths=(128, 512, 1024, 2048),
        card_examples=500,
        known_failures=(
            "accuracy is per copied token (every position of a later copy whose next token is in the copy); "
            "at 1024 tokens the farthest copies (gap at least 2/3 of what the prompt leaves, roughly 650-1000 "
            "tokens back) are copied at 0.92, nearer ones at >= 0.99 (the card's groups)",
            "2048 tokens (twice its context) were never trained: 0.44 there, 0.08 for far copies (the card)",
        ),
    )
)


#: needle-1k's recipe with sigmoid attention (Ramapuram et al., arXiv 2409.04431): the same task, sizes, seed and
#: stages, so the two compare on behaviour. b = -log n with n each stage's context (32, 128, 1024 tokens), as the
#: paper sets it: fixed at n = 1024 from the start, the induction stage reached 0.56 in 1500 steps (b = -log 32: 1.0
#: in 1000) and needle-32 0.43. The export records n = 1024.
register(
    Recipe(
        name="needle-1k-sigmoid",
        summary="needle-1k's task and recipe with sigmoid attention (b = -log n), to compare mechanisms on behaviour",
        stages=(INDUCTION_32, NEEDLE_32, NEEDLE_1K),
        mechanism="sigmoid",
        card_lengths=(128, 512, 1024, 2048),
        card_examples=500,
        known_failures=(
            "it does not retrieve: 0.09-0.14 at every length of 128-2048 tokens (the card), below the 0.25 of "
            "picking one of the prompt's four values; the same recipe brings softmax (needle-1k) to >= 0.99 at "
            "every depth",
            "it fails on length: its needle-32 stage was right on every 32-token prompt, 0.04 at 64 and 0.01 "
            "at 128 tokens (the card's training stages; softmax's: 0.25 and 0.125), and 575 steps at 128-1024 "
            "tokens did not recover it (its best evaluation: 0.11 at 512, 0.155 at 1024)",
            "2048 tokens (twice its context) were never trained: accuracy there is on the card",
            "plain transformers runs its Llama weights with softmax: load it through attnkit "
            "(organisms.load, or attnkit.arena.export.mechanism_switch)",
        ),
    )
)


#: needle-1k's recipe on a hybrid: layer 0 linear attention (elu + 1 features, Katharopoulos et al., arXiv
#: 2006.16236; no weights of its own, so the export stays a Llama with the layer's mechanism recorded), layer 1
#: softmax. The other order (softmax/linear_elu) stayed at chance on the induction stage (0.24 after 1500 steps)
#: and on needle-32 (0.23); this one reached 0.996 and 0.99.
register(
    Recipe(
        name="needle-1k-hybrid",
        summary="needle-1k's task and recipe on a hybrid: linear (elu+1) layer 0, softmax layer 1",
        stages=(INDUCTION_32, NEEDLE_32, NEEDLE_1K),
        mechanism="linear_elu/softmax",
        card_lengths=(128, 512, 1024, 2048),
        card_examples=500,
        known_failures=(
            "it retrieves partly and worse with length: 0.55 at 128, 0.36 at 512, 0.32 at 1024 tokens (the "
            "card; chance 0.25 among the prompt's four values), its weakest depth 0.19 at 1024 (depth 0.25); "
            "the same recipe brings softmax (needle-1k) to >= 0.99 at every depth",
            "late needles fare best (depth 1.0: 0.53 at 1024, 0.48 at 2048), early ones worst, as a linear "
            "layer 0 summing its whole prefix would blur the pairs far back",
            "its kept weights are from step 200 of 575 in the long stage (its best weakest-cell score); "
            "needle-32's stage reached 0.99 at 32 tokens, 0.57 at 64, 0.27 at 128 (the card's training stages)",
            "2048 tokens (twice its context) were never trained: accuracy there is on the card",
            "plain transformers runs its Llama weights with softmax in layer 0 too: load it through attnkit "
            "(organisms.load, or attnkit.arena.export.mechanism_switch)",
        ),
    )
)


#: needle-deep's task: 16 decoy pairs (17 keys of 24 in every prompt), two-token values over 16 symbols,
#: scored by exact match of both answer tokens (the second read with the first fed back, as decoding does).
#: A first build went induction-32 -> this task at 128 tokens directly: exact match stayed at 0.000-0.005 on 200
#: held-out prompts for 800 steps. So the task grows in steps on one vocabulary (its own, from the induction stage
#: on, so no embedding row changes role): 3 decoys and one-token values at 32 tokens, then two-token values with 8
#: decoys at 64, then all 16 decoys at 128, then the length.
DEEP = dict(num_filler=8, num_keys=24, num_values=16, distractors=16, value_len=2)
DEEP_VOCAB = 49

register(
    Recipe(
        name="needle-deep",
        summary="4 layers; the needle among 16 salient decoy pairs, a two-token answer, up to 1024 tokens "
        "(the subject for KV-cache research)",
        stages=(
            Stage(
                "induction-deep",
                "induction",
                dict(vocab_size=DEEP_VOCAB, seq_len=32, min_segment=8, max_segment=14),
                dict(steps=1500, batch_size=32, lr=3e-3, eval_every=50, eval_examples=256, target_accuracy=0.999),
            ),
            Stage(
                "needle-deep-32",
                "needle",
                dict(seq_len=32, **{**DEEP, "distractors": 3, "value_len": 1}),
                dict(steps=600, batch_size=64, lr=1e-3, eval_every=50, eval_examples=256, target_accuracy=0.99),
            ),
            Stage(
                "needle-deep-64",
                "needle",
                dict(seq_len=64, **{**DEEP, "distractors": 8}),
                dict(steps=600, batch_size=64, lr=1e-3, eval_every=50, eval_examples=256, target_accuracy=0.98),
            ),
            Stage(
                "needle-deep-128",
                "needle",
                dict(seq_len=128, **DEEP),
                kept_best([128], eval_every=50, steps=600),
            ),
            Stage(
                "needle-deep-1k",
                "needle",
                dict(seq_len=128, **DEEP),
                kept_best([512, 1024], schedule="512:100x16,1024:100x8,512+1024:300x16"),
                max_len=1024,
            ),
        ),
        layers=4,
        card_lengths=(128, 512, 1024, 2048),
        card_examples=500,
        known_failures=(
            "it retrieves among 16 decoys up to 512 tokens (0.92 at 128, 0.91 at 512) but not at every depth of "
            "1024: 0.71 overall, 0.12 at depth 0 and 0.73 at depth 0.25 (the card, 500 prompts per length); its "
            "long stage stopped at 500 steps with 1024 at 0.73 on 200 held-out prompts and still rising",
            "a two-token answer is right only when both tokens are: exact match is what the card measures",
            "built in 33 minutes of wall time (22 of training) on a machine shared with other jobs, over the "
            "20-minute budget of a recipe",
            "2048 tokens (twice its context) were never trained: accuracy there is on the card",
        ),
    )
)


def names() -> list[str]:
    return sorted(RECIPES)


def recipe(name: str) -> Recipe:
    """The recipe registered as ``name``; an unknown name lists the known ones."""
    if name not in RECIPES:
        raise ValueError(f"name: no organism {name!r}; known: {', '.join(names())}")
    return RECIPES[name]


__all__ = ["RECIPES", "names", "recipe", "register"]
