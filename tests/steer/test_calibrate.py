"""Position calibration: the measured bias equals eager attention's, and on the bundled
all-MiniLM-L6-v2 the calibration shrinks the first-versus-last segment gap of the
position-bias probe (the reflection-bias study's claim that redistributing pooled
attention evenly across positions reduces positional bias). The in-kernel formula is
held to the dense reference in test_interventions.py."""

import pytest
import torch
from tiny_models import VOCAB, build

from attnkit import probes, steer
from attnkit.steer.calibrate import measure_position_ratio
from helpers import assert_close


def eager_ratio(model, texts, bins, causal):
    """(L, H, bins) from output_attentions: pooled rows' mass per bin over its token share."""
    total, share = 0.0, torch.zeros(bins, dtype=torch.float64)
    for ids in texts:
        n = len(ids)
        with torch.no_grad():
            att = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions  # L x (1, H, n, n)
        a = torch.stack(att)[:, 0].double()  # (L, H, n, n)
        rows = a[:, :, -1] if causal else a.mean(2)  # (L, H, n)
        bin_of = [min(j * bins // n, bins - 1) for j in range(n)]
        mass = torch.zeros(a.shape[0], a.shape[1], bins, dtype=torch.float64)
        for j, b in enumerate(bin_of):
            mass[..., b] += rows[..., j]
            share[b] += 1.0 / n
        total = total + mass
    return (total / len(texts)) / (share / len(texts))


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_measured_ratio_equals_eager_attention(name):
    model = build(name)
    g = torch.Generator().manual_seed(0)
    texts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (11, 16)]
    got = measure_position_ratio(model, None, texts, 4, "causal" if name == "llama" else "encoder")
    want = eager_ratio(model, texts, 4, name == "llama")
    assert_close(got, want, dtype=torch.float32)


def test_calibrated_prompt_like_the_references_gets_weights_in_proportion_to_bin_shares():
    """At strength 1 on a prompt equal to the single reference, the pooled rows' mass on
    each bin of layer 0 equals the bin's share of the tokens (the bias divided out)."""
    model = build("bert")
    ids = torch.randint(1, VOCAB, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    cal = steer.calibrate_positions(model, None, [ids], bins=4, strength=1.0)
    with steer.apply(model, cal):
        after = measure_position_ratio(model, None, [ids], 4, "encoder")
    # layer 0 sees the same inputs: mass / share = 1 up to the rows' renormalisation, which
    # a pooled mean of per-row normalised weights does not undo exactly; require a far
    # flatter profile than before
    before = cal.ratio[0]
    assert (after[0] - 1).abs().max() < 0.5 * (before - 1).abs().max()


def test_bad_input():
    model = build("bert")
    with pytest.raises(ValueError, match="texts: expected a non-empty list"):
        steer.calibrate_positions(model, None, [])
    with pytest.raises(ValueError, match="texts: reference 0 has 3 content tokens, fewer than bins=8"):
        steer.calibrate_positions(model, None, [[1, 2, 3]])
    with pytest.raises(ValueError, match="bins: expected an int >= 1"):
        steer.calibrate_positions(model, None, [[1, 2, 3]], bins=0)
    with pytest.raises(ValueError, match="strength: expected a finite number >= 0"):
        steer.calibrate_positions(model, None, [[1, 2, 3, 4]], bins=2, strength=-1)
    with pytest.raises(ValueError, match="tokenizer: text references need the tokenizer"):
        steer.calibrate_positions(model, None, ["some text"], bins=2)


def test_encoder_calibration_shrinks_the_position_bias_gap_on_minilm():
    from attnkit.hf import load_default_model
    from attnkit.probes.haystack import FILLER

    model, tok = load_default_model()
    # reference documents unrelated to the probe's bundled text: rotations of the filler
    texts = [" ".join(FILLER[i:] + FILLER[:i]) for i in range(0, 16, 4)]
    plain = probes.run("position-bias", model, tok, samples=6)
    cal = steer.calibrate_positions(model, tok, texts, bins=8, strength=0.5)
    with steer.apply(model, cal):
        calibrated = probes.run("position-bias", model, tok, samples=6)
    gap, new_gap = plain.value("first_last_gap"), calibrated.value("first_last_gap")
    assert gap > 0.02  # the bias is there: earlier segments better reflected
    assert abs(new_gap) < 0.5 * gap
    # the pooled rows' attention over the reference documents is flatter after calibration
    with steer.apply(model, cal):
        after = measure_position_ratio(model, tok, texts, 8, "encoder")
    assert (after.log().abs().mean()) < (cal.ratio.log().abs().mean())


def test_special_tokens_can_be_left_out_of_the_bins():
    """special="exclude": the tokenizer's [CLS]/[SEP] get no bias and no bin."""
    from wordlevel import word_tokenizer

    from attnkit.steer.calibrate import key_bins, special_edges

    assert special_edges(word_tokenizer()) == (0, 0)
    keep = torch.tensor([[False, True, True, True, True, True, True]])
    assert key_bins(keep, 2, (1, 1)).tolist() == [[-1, -1, 0, 0, 1, 1, -1]]
    assert key_bins(keep, 3).tolist() == [[-1, 0, 0, 1, 1, 2, 2]]
    with pytest.raises(ValueError, match="special: expected 'include' or 'exclude'"):
        steer.calibrate_positions(build("bert"), None, [[1, 2, 3, 4]], bins=2, special="none")
