"""Every generator: shapes, label placement, determinism, and the source paper's rules,
each checked by an independent reading of the example (plain Python loops over tokens)."""

import math
from dataclasses import replace

import pytest
import torch

from attnkit.arena.tasks import IGNORE, TASKS, make_task
from attnkit.arena.tasks.variable_tracking import ASSIGN, FILL, QUERY, SPECIAL


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("name", list(TASKS))
def test_same_generator_seed_same_examples_other_seed_other_examples(name):
    task = make_task(name)
    a, b, c = task.sample(16, gen(1)), task.sample(16, gen(1)), task.sample(16, gen(2))
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets) and torch.equal(a.mask, b.mask)
    assert not torch.equal(a.inputs, c.inputs)
    h1, h2 = task.held_out(8, gen(3)), task.held_out(8, gen(3))
    assert torch.equal(h1.inputs, h2.inputs) and torch.equal(h1.targets, h2.targets)


@pytest.mark.parametrize("name", list(TASKS))
def test_shapes_and_masks(name):
    task = make_task(name)
    batch = task.sample(5, gen())
    assert batch.inputs.shape[:2] == (5, task.seq_len)
    assert batch.targets.shape == batch.mask.shape and batch.mask.dtype == torch.bool
    assert batch.mask.any(dim=1).all()  # every example asks something
    if batch.targets.dtype == torch.long:
        assert torch.equal(batch.mask, batch.targets != IGNORE)
        assert int(batch.targets[batch.mask].min()) >= 0 and int(batch.targets[batch.mask].max()) < task.vocab_size
    if batch.inputs.dtype == torch.long and task.model_kind == "lm":
        assert int(batch.inputs.min()) >= 0 and int(batch.inputs.max()) < task.vocab_size


@pytest.mark.parametrize("name", list(TASKS))
def test_bad_sizes_raise(name):
    with pytest.raises(ValueError, match="seq_len"):
        make_task(name, seq_len=1)
    with pytest.raises(ValueError, match="n"):
        make_task(name).sample(0, gen())


def test_unknown_task_and_parameter_raise():
    with pytest.raises(ValueError, match="unknown name"):
        make_task("nope")
    with pytest.raises(ValueError, match="has no pairs"):
        make_task("mqar", pairs=3)


# ---------------------------------------------------------------- MQAR (arXiv 2312.04927)


def test_mqar_construction_rules():
    task = make_task("mqar", vocab_size=64, seq_len=48, num_kv_pairs=(2, 6), random_non_queries=False)
    batch = task.sample(200, gen())
    half = task.vocab_size // 2
    for b in range(200):
        x, y = batch.inputs[b].tolist(), batch.targets[b].tolist()
        pairs = 2 + int(batch.group[b])
        keys, values = x[0 : 2 * pairs : 2], x[1 : 2 * pairs : 2]
        assert len(set(keys)) == pairs and len(set(values)) == pairs
        assert all(1 <= k < half for k in keys) and all(half <= v < 64 for v in values)
        queries = [p for p in range(48) if y[p] != IGNORE]
        assert len(queries) == pairs
        for p in queries:
            assert p >= 2 * pairs and (p - 2 * pairs) % 2 == 0  # a query slot
            assert y[p] == values[keys.index(x[p])]  # the value paired with the queried key
        assert sorted(x[p] for p in queries) == sorted(keys)  # each key asked once
        rest = [x[p] for p in range(2 * pairs, 48) if p not in queries]
        assert set(rest) <= {0}  # filler, and the answer is never shown after its query


def test_mqar_random_non_queries_fill_with_the_whole_vocabulary():
    task = make_task("mqar", vocab_size=32, seq_len=64, num_kv_pairs=4)
    batch = task.sample(64, gen())
    filler = batch.inputs[:, 8:][~batch.mask[:, 8:]]
    assert int(filler.min()) == 0 and int(filler.max()) == 31


def test_mqar_query_slots_follow_the_power_law():
    # One pair, so the query slot is one draw from p(g) ∝ a g^(a-1), g = 1..space.
    task = make_task("mqar", vocab_size=16, seq_len=22, num_kv_pairs=1, power_a=0.3, random_non_queries=False)
    n = 20000
    batch = task.sample(n, gen())
    slot = (batch.mask.float().argmax(dim=1) - 2) // 2
    space = (22 - 2) // 2
    p = [0.3 * g ** (0.3 - 1) for g in range(1, space + 1)]
    total = sum(p)
    for g in range(space):
        expected = p[g] / total
        observed = float((slot == g).float().mean())
        assert abs(observed - expected) < 5 * math.sqrt(expected * (1 - expected) / n), (g, observed, expected)


@pytest.mark.parametrize("name, param", [("mqar", "power_a"), ("regression", "tolerance")])
@pytest.mark.parametrize("value", ["steep", None, True])
def test_real_valued_parameters_of_the_wrong_type_are_named(name, param, value):
    with pytest.raises(ValueError, match=param):
        make_task(name, **{param: value})


def test_mqar_pair_counts_are_validated_against_vocabulary_and_length():
    with pytest.raises(ValueError, match="vocab_size"):
        make_task("mqar", vocab_size=16, num_kv_pairs=8)
    with pytest.raises(ValueError, match="seq_len"):
        make_task("mqar", seq_len=24, num_kv_pairs=8)
    with pytest.raises(ValueError, match="num_kv_pairs"):
        make_task("mqar", num_kv_pairs=(8, 4))


# ---------------------------------------------------------------- associative retrieval (arXiv 2102.11174)


@pytest.mark.parametrize("repeated", [True, False])
def test_associative_answer_is_the_last_value_of_the_query_key(repeated):
    task = make_task("associative", seq_len=41, num_keys=40 if not repeated else 10, num_values=40, repeated_keys=repeated)
    batch = task.sample(100, gen())
    assert batch.inputs.shape == (100, 41, 2) and batch.targets.shape == (100, 1)
    saw_update = False
    for b in range(100):
        memory, seen = {}, set()
        for key, value in batch.inputs[b, :40].tolist():
            saw_update |= key in memory and memory[key] != value
            memory[key] = value  # last value wins
            seen.add(key)
        query, marker = batch.inputs[b, 40].tolist()
        assert marker == task.query_marker and query in seen
        assert batch.targets[b, 0] == memory[query]
    assert saw_update == repeated
    if not repeated:
        keys = batch.inputs[:, :40, 0]
        assert all(len(set(row)) == 40 for row in keys.tolist())


def test_associative_without_repeats_needs_enough_keys():
    with pytest.raises(ValueError, match="num_keys"):
        make_task("associative", seq_len=41, num_keys=20, repeated_keys=False)


# ---------------------------------------------------------------- selective copying (arXiv 2312.00752)


def test_selective_copy_targets_are_the_data_tokens_in_order_at_the_markers():
    task = make_task("selective_copy", vocab_size=10, seq_len=40, num_tokens=6)
    batch = task.sample(50, gen())
    for b in range(50):
        x, y = batch.inputs[b].tolist(), batch.targets[b].tolist()
        data = [t for t in x[:34] if t != 0]
        assert len(data) == 6 and all(1 <= t <= 8 for t in data)
        assert x[34:] == [9] * 6
        assert y[:34] == [IGNORE] * 34 and y[34:] == data


# ---------------------------------------------------------------- induction (arXiv 2209.11895)


@pytest.mark.parametrize("repeats", [2, 3])
def test_induction_repeats_a_segment_of_distinct_tokens_and_asks_the_next_one(repeats):
    task = make_task("induction", vocab_size=20, seq_len=12 * repeats, repeats=repeats)
    batch = task.sample(30, gen())
    for b in range(30):
        x, y = batch.inputs[b].tolist(), batch.targets[b].tolist()
        segment = x[:12]
        assert len(set(segment)) == 12 and x == segment * repeats
        for p in range(len(x)):
            # Answerable by looking back: inside a later copy, before the last token.
            expected = x[p + 1] if 12 <= p < len(x) - 1 else IGNORE
            assert y[p] == expected


def test_induction_needs_a_vocabulary_as_large_as_the_segment():
    with pytest.raises(ValueError, match="vocab_size"):
        make_task("induction", vocab_size=10, seq_len=32)


@pytest.mark.parametrize("repeats", [2, 3])
def test_induction_min_segment_varies_the_copies_length_and_place_among_filler(repeats):
    task = make_task("induction", vocab_size=20, seq_len=10 * repeats, repeats=repeats, min_segment=3, max_segment=8)
    N = task.seq_len
    batch = task.sample(400, gen())
    lengths, offsets, tails = set(), set(), set()
    for b in range(400):
        x, y = batch.inputs[b].tolist(), batch.targets[b].tolist()
        asked = [p for p in range(N) if y[p] != IGNORE]
        # The scored positions run from the second copy's start to the last copy's second-to-last token.
        assert asked == list(range(asked[0], asked[-1] + 1))
        length = (len(asked) + 1) // (repeats - 1)
        start = asked[0] - length
        assert 3 <= length <= 8 and (len(asked) + 1) % (repeats - 1) == 0 and start >= 0
        segment = x[start : start + length]
        assert len(set(segment)) == length and x[start : start + repeats * length] == segment * repeats
        outside = x[:start] + x[start + repeats * length :]
        assert not set(outside) & set(segment)  # filler never holds a segment token
        for p in asked:
            # The induction rule, read off the tokens: every earlier occurrence of x[p] is
            # followed by the answer.
            earlier = [j for j in range(p) if x[j] == x[p]]
            assert earlier and all(x[j + 1] == y[p] for j in earlier)
        lengths.add(length)
        offsets.add(start)
        tails.add(N - start - repeats * length)
    assert lengths == set(range(3, 9))  # every length of [min_segment, max_segment] comes up
    assert len(offsets) > 5 and len(tails) > 5  # filler before and after the copies, in varying amounts
    assert task.segment == 10


def test_induction_min_segment_filler_is_drawn_with_replacement():
    # 14 or more filler tokens from the 17 or 18 symbols outside the segment: drawn with
    # replacement, nearly every example repeats one (without, none could).
    task = make_task("induction", vocab_size=20, seq_len=20, min_segment=2, max_segment=3)
    batch = task.sample(200, gen())
    repeats_a_filler = 0
    for x, y in zip(batch.inputs.tolist(), batch.targets.tolist()):
        segment = {x[p] for p in range(20) if y[p] != IGNORE} | {t for t in y if t != IGNORE}
        filler = [t for t in x if t not in segment]
        repeats_a_filler += len(filler) > len(set(filler))
    assert repeats_a_filler > 180


@pytest.mark.parametrize(
    "params, name",
    [
        (dict(min_segment=1), "min_segment"),
        (dict(min_segment=17), "min_segment"),
        (dict(min_segment=2.5), "min_segment"),
        (dict(max_segment=8), "max_segment"),
        (dict(min_segment=4, max_segment=17), "max_segment"),
        (dict(min_segment=9, max_segment=8), "min_segment"),
        (dict(min_segment=4, max_segment="8"), "max_segment"),
    ],
)
def test_induction_bad_segment_range_raises(params, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        make_task("induction", vocab_size=32, seq_len=32, **params)


# ---------------------------------------------------------------- regression (arXiv 2208.01066)


def test_regression_labels_are_one_linear_function_of_the_points():
    task = make_task("regression", dim=3, seq_len=16)
    batch = task.sample(20, gen())
    x = batch.inputs[:, 0::2].double()  # (B, 8, 3)
    y = batch.inputs[:, 1::2, 0].double()
    assert torch.all(batch.inputs[:, 1::2, 1:] == 0)
    assert torch.equal(batch.targets[:, 0::2], batch.inputs[:, 1::2, 0]) and torch.all(batch.targets[:, 1::2] == 0)
    assert batch.mask[:, 0::2].all() and not batch.mask[:, 1::2].any()
    # The 8 labels are one linear function of the 8 points: the least-squares fit leaves
    # no residual beyond float32 rounding of labels of magnitude ~3 (a few 1e-7).
    w = torch.linalg.lstsq(x, y[..., None]).solution
    assert float(((x @ w)[..., 0] - y).abs().max()) < 1e-5
    # ... and differs between examples (one task w per example).
    assert float((w[0] - w[1]).abs().max()) > 0.1


def test_regression_scores_normalised_error_after_dim_examples():
    task = make_task("regression", dim=2, seq_len=12, tolerance=0.5)
    batch = task.sample(4, gen())
    outputs = batch.targets[..., None].clone()
    outputs[:, 8] += 2.0  # point 4: error² / d = 2 > tolerance
    outputs[:, 2] += 2.0  # point 1: before dim examples, not counted
    correct, counted = task.scored(outputs, batch)
    assert counted.sum(dim=1).tolist() == [4] * 4  # points 2..5
    assert correct.sum(dim=1).tolist() == [3] * 4
    expected_loss = 4 * 2 * (2.0**2 / 2) / (4 * 6)  # 8 errors of 2 among 24 scored points
    assert abs(float(task.loss(outputs, batch)) - expected_loss) < 1e-6


# ---------------------------------------------------------------- variable tracking (arXiv 2404.06654)


def resolve_ruler(tokens, context_len):
    """Execute the assignments in order (RULER's VAR X = ... statements) and return
    {variable: value} plus the variables in order of assignment."""
    env, order, p = {}, [], 0
    while p < context_len:
        if tokens[p] == FILL:
            p += 1
            continue
        name, op, rhs = tokens[p : p + 3]
        assert op == ASSIGN and name >= SPECIAL
        env[name] = env[rhs] if rhs in env else rhs
        order.append(name)
        p += 3
    return env, order


@pytest.mark.parametrize("chains,hops", [(1, 4), (3, 2)])
def test_variable_tracking_answer_lists_every_variable_holding_the_value(chains, hops):
    task = make_task("variable_tracking", seq_len=64, num_chains=chains, hops=hops)
    batch = task.sample(40, gen())
    ctx = task.context_len()
    for b in range(40):
        x, y = batch.inputs[b].tolist(), batch.targets[b].tolist()
        env, order = resolve_ruler(x, ctx)
        assert len(order) == chains * (hops + 1)
        assert x[ctx] == QUERY
        value = x[ctx + 1]
        answer = [v for v in order if env[v] == value]
        assert len(answer) == hops + 1
        assert y[ctx + 1 :] == answer and y[: ctx + 1] == [IGNORE] * (ctx + 1)
        assert x[ctx + 2 :] == answer[:-1]  # teacher forcing: earlier answers are inputs
        assert len(set(env.values())) == chains  # distinct values per chain


def test_variable_tracking_needs_room_for_its_statements():
    with pytest.raises(ValueError, match="seq_len"):
        make_task("variable_tracking", seq_len=20, hops=4)


# ---------------------------------------------------------------- needle (arXiv 2404.06654)


def test_needle_held_out_depths_place_the_needle_where_asked():
    task = make_task("needle", seq_len=40, num_depths=5, distractors=2)
    batch = task.held_out(10, gen())
    cells = (40 - 2) // 2
    for b in range(10):
        x = batch.inputs[b].tolist()
        depth = [0.0, 0.25, 0.5, 0.75, 1.0][b % 5]
        assert int(batch.group[b]) == b % 5
        key = x[-1]
        assert x[-2] == task.query_token
        where = [p for p in range(38) if x[p] == key]
        assert where == [2 * round(depth * (cells - 1))]
        assert batch.targets[b, -1] == x[where[0] + 1]
        keys = [t for t in x[:38] if task.num_filler < t <= task.num_filler + task.num_keys]
        assert len(keys) == 3 and len(set(keys)) == 3  # needle + 2 distractors, distinct
        assert batch.targets[b, :-1].eq(IGNORE).all()


@pytest.mark.parametrize("value_len, lead", [(2, 0), (3, 0), (2, 2), (3, 1)])
def test_needle_multi_token_values_are_asked_token_by_token(value_len, lead):
    cell = 1 + value_len
    N = 24 * cell + lead  # cells that do not fill the context leave `lead` filler tokens first
    task = make_task(
        "needle", seq_len=N, num_filler=4, num_keys=20, num_values=5, distractors=16, num_depths=5, value_len=value_len
    )
    batch = task.held_out(10, gen())
    cells = (N - cell) // cell
    tail = N - cell
    for b in range(10):
        x, t = batch.inputs[b].tolist(), batch.targets[b].tolist()
        depth = [0.0, 0.25, 0.5, 0.75, 1.0][b % 5]
        assert x[tail] == task.query_token
        key = x[tail + 1]
        where = [p for p in range(tail) if x[p] == key]
        assert where == [lead + cell * round(depth * (cells - 1))]
        value = x[where[0] + 1 : where[0] + cell]
        assert all(task.num_filler + 1 + task.num_keys <= v < task.vocab_size for v in value)
        assert t[tail + 1 :] == value and all(v == IGNORE for v in t[: tail + 1])  # v1 at the key, then each next
        assert x[tail + 2 :] == value[:-1]  # the answer so far is fed back, as decoding would
        assert all(x[p] < task.num_filler for p in range(lead))
        keys = [x[p] for p in range(lead, tail, cell)]
        pairs = [k for k in keys if task.num_filler < k <= task.num_filler + task.num_keys]
        assert len(pairs) == 17 and len(set(pairs)) == 17  # needle + 16 decoys, distinct keys, one per cell start
        assert all(
            x[p] < task.num_filler for p in range(lead, tail) if (p - lead) % cell and x[p - (p - lead) % cell] not in pairs
        )


def test_needle_multi_token_answers_score_by_exact_match():
    task = make_task("needle", seq_len=24, num_filler=4, num_keys=6, num_values=4, distractors=2, value_len=2)
    batch = task.held_out(4, gen())
    right = torch.nn.functional.one_hot(batch.targets.clamp(min=0), task.vocab_size).float()
    correct, counted = task.scored(right, batch)
    assert counted.sum() == 4 and counted[:, -1].all() and correct.sum() == 4  # one count per example
    wrong_first = right.clone()
    wrong_first[0, -2] = torch.roll(wrong_first[0, -2], 1)  # the first answer token of example 0 wrong
    correct, _ = task.scored(wrong_first, batch)
    assert correct.sum() == 3 and not correct[0].any()
    with pytest.raises(ValueError, match=r"seq_len: expected an int >= 15"):  # 3 pairs and the tail, 3 tokens each
        make_task("needle", seq_len=14, num_keys=4, num_values=4, distractors=3, value_len=2)


def test_needle_one_token_values_are_the_original_task():
    old = make_task("needle", seq_len=32)
    assert old.value_len == 1 and old == make_task("needle", seq_len=32, value_len=1)
    batch = old.held_out(5, gen())
    assert batch.mask.sum() == 5 and batch.mask[:, -1].all()


def test_needle_evaluates_at_longer_lengths():
    task = make_task("needle", seq_len=32)
    assert task.eval_lengths() == (32, 64, 128)
    longer = replace(task, seq_len=128)
    assert longer.sample(2, gen()).inputs.shape == (2, 128)
    with pytest.raises(ValueError, match="even"):
        make_task("needle", seq_len=33)
    with pytest.raises(ValueError, match="test_factors"):
        make_task("needle", test_factors=(1, 0))
