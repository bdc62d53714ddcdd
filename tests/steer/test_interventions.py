"""Each intervention against its literal dense float64 formula (steer_reference.py) on
tiny Llama (GQA), GPT-2 and BERT models, with padding and KV-cache decoding, and the
interventions' own ``reference`` methods against the same formulas on random logits.

Models run in float64: attnkit's kernels and the dense formula then agree to TOL[float64]."""

import inspect

import pytest
import torch
from steer_reference import outputs, run_dense
from tiny_models import VOCAB, build

import attnkit.hf as akhf
from attnkit import steer
from helpers import assert_close

N = 12
HEADS = {0: [1, 2], 2: [3]}


@pytest.fixture(scope="module")
def models():
    return {name: build(name).double() for name in ("llama", "gpt2", "bert")}


def batch(name):
    """A batch with padding: left padding for decoders, right for BERT; (inputs, keep)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, VOCAB, (2, N), generator=g)
    mask = torch.ones(2, N, dtype=torch.long)
    if name == "bert":
        mask[1, N - 4 :] = 0
    else:
        mask[1, :3] = 0
    ids = ids.masked_fill(mask == 0, 0)
    inputs = {"input_ids": ids, "attention_mask": mask}
    if name != "bert":
        inputs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return inputs, mask.bool()


SPANS = [[(4, 7), (9, 11)], [(3, 5)]]


def inside_table(spans, k_len=N):
    inside = torch.zeros(len(spans), k_len, dtype=torch.bool)
    for b, ranges in enumerate(spans):
        for a, e in ranges:
            inside[b, a:e] = True
    return inside


def cases(keep):
    """(intervention, the dense reference's change) pairs."""
    ratio = 0.5 + torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return {
        "emphasize": (steer.emphasize(SPANS, HEADS, alpha=0.05), dict(emphasize=(inside_table(SPANS), 0.05))),
        "temperature": (steer.temperature(HEADS, 0.3), dict(temperature=0.3)),
        "disperse": (steer.disperse(HEADS, 0.7), dict(disperse=0.7)),
        "disperse-uniform": (steer.disperse(HEADS, 1.0), dict(disperse=1.0)),
        "scale": (steer.scale(HEADS, -1.7), dict(scale=-1.7)),
        "ablate": (steer.ablate(HEADS), dict(ablate=None)),
        "calibrate": (steer.PositionCalibration(ratio, HEADS, strength=0.8), dict(calibrate=(ratio, 0.8))),
    }


def real(t, keep):
    return t[keep]


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
@pytest.mark.parametrize("case", ["emphasize", "temperature", "disperse", "disperse-uniform", "scale", "ablate", "calibrate"])
def test_intervention_equals_dense_formula(models, name, case):
    model = models[name]
    inputs, keep = batch(name)
    iv, change = cases(keep)[case]
    want = outputs(run_dense(model, dict(change, heads=HEADS, keep=keep), **inputs))
    plain = outputs(run_dense(model, dict(keep=keep), **inputs))
    with torch.no_grad(), steer.apply(model, iv):
        got = outputs(model(**inputs))
    assert_close(real(got, keep), real(want, keep))
    assert (real(got, keep) - real(plain, keep)).abs().max() > 1e-6  # the intervention did something


def test_mean_ablation_uses_the_reference_batch_mean(models):
    model = models["llama"]
    ref_inputs, ref_keep = batch("llama")
    run_dense(model, dict(record=True, keep=ref_keep), **ref_inputs)
    from steer_reference import RECORD

    means = {layer: total / count for layer, (total, count) in RECORD.items()}
    RECORD.clear()
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(1, VOCAB, (1, 9), generator=g)
    want = outputs(run_dense(model, dict(ablate=means, heads=HEADS), input_ids=ids))
    with torch.no_grad(), steer.apply(model, steer.ablate(HEADS, mode="mean", reference=ref_inputs)):
        got = outputs(model(input_ids=ids))
    assert_close(got, want)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("case", ["emphasize", "temperature", "scale", "ablate"])
def test_kv_cache_decoding_equals_the_full_sequence(models, name, case):
    """Prefill 8 tokens then decode 4 one at a time with the cache: each step's logits
    equal the dense formula on the whole sequence."""
    model = models[name]
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, VOCAB, (2, N), generator=g)
    spans = [[(1, 3), (5, 6)], [(2, 7)]]
    iv, change = {
        "emphasize": (steer.emphasize(spans, HEADS, alpha=0.02), dict(emphasize=(inside_table(spans), 0.02))),
        "temperature": (steer.temperature(HEADS, 2.5), dict(temperature=2.5)),
        "scale": (steer.scale(HEADS, 0.4), dict(scale=0.4)),
        "ablate": (steer.ablate(HEADS), dict(ablate=None)),
    }[case]
    want = outputs(run_dense(model, dict(change, heads=HEADS), input_ids=ids))
    from transformers import DynamicCache

    cache = DynamicCache()
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    steps = []
    with torch.no_grad(), steer.apply(model, iv):
        out = model(input_ids=ids[:, :8], **{arg: cache}, use_cache=True)
        steps.append(out.logits)
        for t in range(8, N):
            steps.append(model(input_ids=ids[:, t : t + 1], **{arg: cache}, use_cache=True).logits)
    assert_close(torch.cat(steps, dim=1), want)


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_identity_settings_leave_outputs_bitwise_unchanged(models, name):
    model = models[name]
    inputs, keep = batch(name)
    with torch.no_grad():
        with akhf.use(model):
            plain = outputs(model(**inputs))
        idle = [
            steer.emphasize(SPANS, HEADS, alpha=1.0),
            steer.scale(HEADS, 1.0),
            steer.temperature(HEADS, 1.0),
            steer.disperse(HEADS, 0.0),
        ]
        with steer.apply(model, *idle):
            got = outputs(model(**inputs))
    assert torch.equal(got, plain)


def test_gqa_heads_sharing_a_kv_head_are_steered_apart(models):
    """Llama has 4 query heads on 2 kv heads: steering query head 0 alone differs from
    steering 0 and 1 (its kv-group partner)."""
    model = models["llama"]
    ids = torch.randint(1, VOCAB, (1, N), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        with steer.apply(model, steer.temperature({1: [0]}, 0.2)):
            one = outputs(model(input_ids=ids))
        with steer.apply(model, steer.temperature({1: [0, 1]}, 0.2)):
            two = outputs(model(input_ids=ids))
        want = outputs(run_dense(model, dict(temperature=0.2, heads={1: [0]}), input_ids=ids))
    assert_close(one, want)
    assert (one - two).abs().max() > 1e-6


@pytest.mark.parametrize("case", ["emphasize", "temperature", "disperse", "scale", "ablate", "calibrate"])
def test_reference_methods_equal_the_formulas(models, case):
    """Each intervention's own ``reference`` (on dense logits) equals the test's formula."""
    model = models["llama"]
    keep = torch.ones(2, N, dtype=torch.bool)
    iv, change = cases(keep)[case]
    bound = iv.bind(model)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 4, N, N, generator=g, dtype=torch.float64)
    logits = logits.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    values = torch.randn(2, 4, N, 5, generator=g, dtype=torch.float64)
    layer = 0
    # the formula, written out once more on these logits
    s = logits.clone()
    heads = HEADS[layer]
    for h in heads:
        if case == "temperature":
            s[:, h] = s[:, h] / 0.3
        if case == "disperse":
            s[:, h] = s[:, h] * 0.3
    a = torch.softmax(s, -1)
    for h in heads:
        if case == "emphasize":
            w = a[:, h] * torch.where(
                inside_table(SPANS), torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.05, dtype=torch.float64)
            ).view(2, 1, N)
            a[:, h] = w / w.sum(-1, keepdim=True)
        if case == "calibrate":
            ratio, strength = change["calibrate"]
            bins = torch.arange(N) * 4 // N
            w = a[:, h] / ratio[layer, h][bins].view(1, 1, N) ** strength
            a[:, h] = w / w.sum(-1, keepdim=True)
    o = a @ values
    for h in heads:
        if case == "scale":
            o[:, h] = o[:, h] * -1.7
        if case == "ablate":
            o[:, h] = 0.0
    assert_close(bound.reference(logits, values, layer), o)


ALL_LAYER_HEADS = {0: [0, 2], 1: [0, 2], 2: [0, 2]}


@pytest.mark.parametrize("mechanism", ["sigmoid", "softmax"])
@pytest.mark.parametrize("case", ["temperature", "emphasize", "scale", "ablate"])
def test_steering_inside_another_mechanism_equals_that_mechanism_with_the_change(models, mechanism, case):
    """A switch to another mechanism opened inside steer.apply keeps the steering. The
    reference reaches the same change by other means: the switch's own score mods (a
    per-head temperature, a dense bias tensor of log alpha), or the output projection's
    columns of the chosen heads scaled or zeroed."""
    import attnkit as ak

    model = models["llama"]
    ids = torch.randint(1, VOCAB, (2, N), generator=torch.Generator().manual_seed(6))
    chosen = torch.tensor([True, False, True, False])
    score, ref_model = None, model
    if case == "temperature":
        iv = steer.temperature(ALL_LAYER_HEADS, 0.4)
        score = ak.temperature(
            torch.where(chosen, torch.tensor(0.4, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
        )
    elif case == "emphasize":
        iv = steer.emphasize([(2, 6)], ALL_LAYER_HEADS, alpha=0.1)
        inside = torch.zeros(N, dtype=torch.bool)
        inside[2:6] = True
        table = torch.where(
            chosen.view(1, 4, 1, 1) & ~inside.view(1, 1, 1, N),
            torch.tensor(0.1, dtype=torch.float64).log(),
            torch.tensor(0.0, dtype=torch.float64),
        )
        score = ak.bias(table.expand(1, 4, N, N).contiguous())
    else:
        factor = 0.0 if case == "ablate" else 2.5
        iv = steer.ablate(ALL_LAYER_HEADS) if case == "ablate" else steer.scale(ALL_LAYER_HEADS, factor)
        ref_model = build("llama").double()
        with torch.no_grad():
            for layer in ref_model.model.layers:
                w = layer.self_attn.o_proj.weight  # (d, Hq * dh): columns of head h are h*dh:(h+1)*dh
                dh = w.shape[1] // 4
                for h in (0, 2):
                    w[:, h * dh : (h + 1) * dh] *= factor
    with torch.no_grad():
        with steer.apply(model, iv), akhf.use(model, mechanism=mechanism):
            got = outputs(model(input_ids=ids))
        with akhf.use(ref_model, mechanism=mechanism, score=score):
            want = outputs(ref_model(input_ids=ids))
        with akhf.use(model, mechanism=mechanism):
            plain = outputs(model(input_ids=ids))
    assert_close(got, want)
    assert (got - plain).abs().max() > 1e-6


@pytest.mark.parametrize("case", ["emphasize", "temperature", "disperse", "calibrate"])
def test_left_padded_kv_cache_decoding_equals_the_full_sequence(models, case):
    """A left-padded batch: prefill 8 columns, then decode one column at a time with the
    cache and the growing padding mask; real rows equal the dense formula on the whole
    padded sequence. (calibrate: each call bins the keys it sees, so only the prefill is
    compared for it.)"""
    from transformers import DynamicCache

    model = models["llama"]
    inputs, keep = batch("llama")
    ids, mask, pos = inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"]
    spans = [[(2, 4), (6, 8)], [(4, 6)]]
    ratio = 0.5 + torch.rand(3, 4, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    iv, change = {
        "emphasize": (steer.emphasize(spans, HEADS, alpha=0.03), dict(emphasize=(inside_table(spans), 0.03))),
        "temperature": (steer.temperature(HEADS, 0.5), dict(temperature=0.5)),
        "disperse": (steer.disperse(HEADS, 0.8), dict(disperse=0.8)),
        "calibrate": (steer.PositionCalibration(ratio, HEADS), dict(calibrate=(ratio, 1.0))),
    }[case]
    prefill = 8 if case != "calibrate" else N
    want = outputs(
        run_dense(
            model,
            dict(change, heads=HEADS, keep=keep[:, :prefill]),
            input_ids=ids[:, :prefill],
            attention_mask=mask[:, :prefill],
            position_ids=pos[:, :prefill],
        )
    )
    if case != "calibrate":
        want = outputs(run_dense(model, dict(change, heads=HEADS, keep=keep), **inputs))
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = DynamicCache()
    steps = []
    with torch.no_grad(), steer.apply(model, iv):
        steps.append(
            model(
                input_ids=ids[:, :prefill],
                attention_mask=mask[:, :prefill],
                position_ids=pos[:, :prefill],
                use_cache=True,
                **{arg: cache},
            ).logits
        )
        for t in range(prefill, N):
            steps.append(
                model(
                    input_ids=ids[:, t : t + 1],
                    attention_mask=mask[:, : t + 1],
                    position_ids=pos[:, t : t + 1],
                    use_cache=True,
                    **{arg: cache},
                ).logits
            )
    got = torch.cat(steps, dim=1)
    k = keep[:, : got.shape[1]]
    assert_close(got[k], want[:, : got.shape[1]][k])
