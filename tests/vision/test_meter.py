"""VisualAttention against its literal definition on the dense reference's weights
(float64, two rows, left padding, three images), prefill and per generated step."""

import math

import numpy as np
import pytest
import tiny_vlms as V
import torch
from dense_reference import run_dense

import attnkit.hf as akhf
from attnkit import vision

TOL = 1e-10  # float64 sums over < 100 keys: rounding ~1e-15 per term


def literal(probs, image, real, top_k):
    """{(layer, head): {metric: value}} from dense weights (B, H, N, N), image (B, N) and
    real (B, N) tokens, written out row by row."""
    out = {}
    for layer, a in probs.items():
        B, H, N, _ = a.shape
        for h in range(H):
            share, unif, ent, ent_norm, top = [], [], [], [], []
            received = torch.zeros(B, N, dtype=torch.float64)
            for b in range(B):
                for i in range(N):
                    if not real[b, i]:
                        continue
                    visible = [j for j in range(i + 1) if real[b, j]]
                    img = [j for j in visible if image[b, j]]
                    w = a[b, h, i]
                    share.append(float(sum(w[j] for j in img)))
                    unif.append(len(img) / len(visible))
                    for j in img:
                        received[b, j] += w[j]
                    s1 = float(sum(w[j] for j in img))
                    if s1 > 0:
                        p = [float(w[j]) / s1 for j in img]
                        hh = -sum(x * math.log(x) for x in p if x > 0)
                        ent.append(hh)
                        if len(img) >= 2:
                            ent_norm.append(hh / math.log(len(img)))
                        top.append(sum(sorted(p, reverse=True)[:top_k]))
            blind = [float(received[b].topk(top_k).values.sum() / received[b].sum()) for b in range(B) if received[b].sum() > 0]
            out[(layer, h)] = {
                "visual.share": np.mean(share),
                "visual.share.uniform": np.mean(unif),
                "visual.entropy": np.mean(ent),
                "visual.entropy.norm": np.mean(ent_norm),
                f"visual.top{top_k}": np.mean(top),
                "visual.blind": np.mean(blind),
                "received": received,
            }
    return out


@pytest.mark.parametrize("family", V.FAMILIES)
def test_prefill_equals_literal_definition(family):
    model = V.build(family)
    inputs, _ = V.batch(family)
    spans = vision.image_spans(model, inputs)
    _, probs = run_dense(model, **inputs)
    meter = spans.meter(top_k=3)
    with torch.no_grad(), akhf.use(model, observers=[meter]):
        model(**inputs)
    want = literal(probs, spans.mask, inputs["attention_mask"].bool(), 3)
    got = {}
    for layer, head, metric, value in meter.rows():
        got.setdefault((layer, head), {})[metric] = value
    assert set(got) == set(want)  # the decoder's layers only: the vision tower is not observed
    for key, metrics in want.items():
        for metric, value in metrics.items():
            if metric == "received":
                assert torch.allclose(meter.arrays()["visual_received"][key].double(), value, atol=1e-6)  # stored float32
            else:
                assert got[key][metric] == pytest.approx(value, abs=TOL), (key, metric)
    # the meter saw something worth checking: shares differ across heads, blind tokens exist
    shares = [m["visual.share"] for m in want.values()]
    assert max(shares) - min(shares) > 0.01


@pytest.mark.parametrize(
    "family, rows", [("llava", 2), ("qwen2_vl", 2), ("llava", 1)], ids=["llava", "qwen2_vl", "llava one row, no padding"]
)
@pytest.mark.parametrize("pending", [256, 1], ids=["calls folded in at the end", "each call folded in at once"])
def test_share_per_generated_step_and_drift(family, rows, pending, monkeypatch):
    """Two generations with one meter: each step's share is kept once (the second's rows
    replace the first's, equal here), however the calls are batched into the sums. With
    padding a step's keys are masked; without, every key is visible (the meter's two ways
    of keeping a step's weights)."""
    from attnkit.observe import visual

    monkeypatch.setattr(visual, "_PENDING_CALLS", pending)
    model = V.build(family)
    inputs, _ = V.batch(family)
    if rows == 1:  # llava's first row: two images, no padding
        inputs = {k: v[:2] if k == "pixel_values" else v[:1] for k, v in inputs.items()}
    spans = vision.image_spans(model, inputs)
    meter = spans.meter()
    steps = 4
    with torch.no_grad(), akhf.use(model, observers=[meter]):
        for _ in range(2):
            seq = model.generate(**inputs, max_new_tokens=steps, do_sample=False)
    n0 = inputs["input_ids"].shape[1]
    full = dict(
        inputs,
        input_ids=seq,
        attention_mask=torch.cat([inputs["attention_mask"], torch.ones(rows, steps, dtype=torch.long)], 1)[:, : seq.shape[1]],
    )
    if "mm_token_type_ids" in inputs:
        full["mm_token_type_ids"] = torch.cat(
            [inputs["mm_token_type_ids"], torch.zeros(rows, seq.shape[1] - n0, dtype=torch.int)], 1
        )
    else:  # generate's positions for left padding (RoPE is relative, but not bitwise so)
        full["position_ids"] = (full["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    _, probs = run_dense(model, **full)
    image = torch.cat([spans.mask, torch.zeros(rows, seq.shape[1] - n0, dtype=torch.bool)], 1)
    got_rows = {(r[0], r[1], r[2]): r[3] for r in meter.rows()}
    for layer, a in probs.items():
        for h in range(a.shape[1]):
            got = meter.arrays()["visual_share"][(layer, h)]
            assert got["step_start"] == n0 - 1
            values = got["values"].double()
            assert values.shape == (rows, steps)
            want = torch.stack([(a[:, h, n0 - 1 + t] * image).sum(-1) for t in range(steps)], 1)
            assert torch.allclose(values, want, atol=1e-6)  # stored float32
            slopes = [np.polyfit(np.arange(steps), want[b].numpy(), 1)[0] for b in range(rows)]
            assert got_rows[(layer, h, "visual.drift")] == pytest.approx(np.mean(slopes), abs=1e-9)
    # every other metric over the rows the generations computed (all but the last token's):
    # the prompt's and the steps', each seen twice, which leaves every mean as it is
    seen = {layer: a[:, :, :-1, :-1] for layer, a in probs.items()}
    want = literal(seen, image[:, :-1], full["attention_mask"][:, :-1].bool(), 4)
    for (layer, h), metrics in want.items():
        for metric, value in metrics.items():
            if metric != "received":
                assert got_rows[(layer, h, metric)] == pytest.approx(value, abs=1e-9), (layer, h, metric)


def test_meter_refuses_a_batch_it_was_not_built_for():
    model = V.build("llava")
    inputs, _ = V.batch("llava")
    meter = vision.image_spans(model, inputs).meter()
    one = {k: (v[:1] if k != "pixel_values" else v[:2]) for k, v in inputs.items()}
    with (
        pytest.raises(ValueError, match="^keys: a mask for 2 batch rows") as err,
        torch.no_grad(),
        akhf.use(model, observers=[meter]),
    ):
        model(**one)
    assert "\n" not in str(err.value)


def test_prefill_with_image_keys_hidden_by_a_score_mod():
    """A steering mod that hides half the image keys (their logits -inf, which no mask
    marks) while the meter observes: the meter equals the literal definition over the
    steered weights. Row 0 of the LLaVA batch alone (23 tokens: the observing pass)."""
    from attnkit import steer

    model = V.build("llava")
    batch, _ = V.batch("llava")
    inputs = {
        "input_ids": batch["input_ids"][:1],
        "attention_mask": batch["attention_mask"][:1],
        "pixel_values": batch["pixel_values"][:2],
    }
    spans = vision.image_spans(model, inputs)
    hidden = spans.mask & (torch.arange(spans.length) % 2 == 0)
    heads = {0: [1, 3], 1: [0]}
    _, probs = run_dense(model, {"image": hidden, "heads": heads, "ablate": True}, **inputs)
    meter = spans.meter(top_k=3)
    with torch.no_grad(), steer.apply(model, steer.ablate_visual(hidden, heads)), akhf.use(model, observers=[meter]):
        model(**inputs)
    want = literal(probs, spans.mask, inputs["attention_mask"].bool(), 3)
    for layer, head, metric, value in meter.rows():
        assert math.isfinite(value) and value == pytest.approx(want[(layer, head)][metric], abs=TOL), (layer, head, metric)
