"""Effects on models whose behaviour is known.

- emphasize (PASTA) raises the attention mass on the emphasised span monotonically as
  alpha falls, measured with attnkit meters on the bundled all-MiniLM-L6-v2 and on the
  arena's induction export;
- ablating the top heads `attnkit probe heads` finds drops accuracy far more than
  ablating other heads (Wu et al. 2024, arXiv 2404.15574: masking retrieval heads breaks
  needle retrieval, masking random heads does not): induction heads on the induction
  export (in-context copying), retrieval heads on the needle export."""

import json
import os

import pytest
import torch

import attnkit.hf as akhf
from attnkit import probes, steer
from attnkit.probes.meters import RowSpanMass

ALPHAS = [1.0, 0.5, 0.1, 0.01]


def span_mass(model, inputs, span, alpha, q_lo):
    """Mean over layers, heads, rows >= q_lo and batch of the mass on ``span``."""
    batch = inputs["input_ids"].shape[0]
    meter = RowSpanMass({"s": [span] * batch}, q_lo=q_lo)
    with torch.no_grad(), steer.apply(model, steer.emphasize([span], "all", alpha=alpha)), akhf.use(model, observers=[meter]):
        model(**inputs)
    return meter.per_example("s")  # (B, L, H)


def assert_monotone(model, inputs, span, q_lo):
    masses = [span_mass(model, inputs, span, a, q_lo) for a in ALPHAS]
    means = [float(m.mean()) for m in masses]
    assert all(b > a for a, b in zip(means, means[1:])), means
    # layer 0 sees unsteered inputs: there every head's mass rises (PASTA's formula is monotone in alpha)
    for a, b in zip(masses, masses[1:]):
        assert (b[:, 0] >= a[:, 0] - 1e-6).all()
    assert means[-1] - means[0] > 0.2, means


def test_emphasize_raises_span_mass_as_alpha_falls_on_minilm():
    model, tok = akhf.load_default_model()
    text = "The meeting moved to Tuesday. The secret password is swordfish. Lunch will be served at noon."
    enc = tok(text, return_tensors="pt", return_offsets_mapping=True)
    iv = steer.emphasize(["The secret password is swordfish."], "all", text=text, encoding=enc)
    span = iv.token_spans()[0]
    inputs = {k: enc[k] for k in ("input_ids", "attention_mask")}
    assert_monotone(model, inputs, span, q_lo=0)


def arena(path):
    from transformers import AutoModelForCausalLM

    from attnkit.arena import make_task

    task_json = json.load(open(os.path.join(path, "task.json")))
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    return model, make_task(task_json["task"], **task_json["params"])


def test_emphasize_raises_span_mass_as_alpha_falls_on_an_arena_export(induction_export):
    model, task = arena(induction_export)
    batch = task.sample(8, torch.Generator().manual_seed(0))
    # the rows of the second copy, emphasising the first copy's last quarter
    assert_monotone(model, {"input_ids": batch.inputs}, (12, 16), q_lo=16)


def accuracy(model, batch, *interventions):
    with torch.no_grad():
        if interventions:
            with steer.apply(model, *interventions):
                logits = model(input_ids=batch.inputs).logits
        else:
            logits = model(input_ids=batch.inputs).logits
    pred = logits.argmax(-1)
    return float((pred == batch.targets)[batch.mask].float().mean())


@pytest.mark.parametrize("fixture, score", [("induction_export", "induction"), ("needle_export", "retrieval")])
def test_ablating_the_heads_the_probe_finds_removes_the_skill(request, fixture, score, tmp_path):
    """Wu et al.'s ablation (arXiv 2404.15574) on the arena's two-layer models: the heads
    ``probe heads`` scores above 0.5 are the second layer's copying heads, and ablating
    them removes the skill. These models have no spare heads, so ablating as many other
    heads (layer 0's previous-token heads, which the circuit reads) hurts as well, and one
    copying head alone is covered by the others (measured: induction 0.999 -> 0.998 with
    the top head ablated, 0.009 with all four; needle 1.0 -> 1.0 and 0.0)."""
    path = request.getfixturevalue(fixture)
    model, task = arena(path)
    found = probes.run("heads", path, samples=4, scores=[score], top=8)
    head_set = tmp_path / "heads.json"
    from attnkit.probes.heads import save_head_set

    save_head_set(found, head_set, score, k=8)
    ranked = [tuple(h) for h in json.loads(head_set.read_text())["heads"]]
    value = {(r["layer"], r["head"]): r["value"] for r in found.select(score)}
    copying = [h for h in ranked if value[h] > 0.5]
    assert copying and all(layer == 1 for layer, _ in copying), value
    batch = task.sample(128, torch.Generator().manual_seed(1))
    base = accuracy(model, batch)
    assert base > 0.95
    assert accuracy(model, batch, steer.ablate(copying)) < 0.1
    assert accuracy(model, batch, steer.ablate([copying[0]])) > base - 0.1  # the others cover for one
