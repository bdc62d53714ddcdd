"""Models switched to attnkit equal transformers' eager attention (the literal formula).

Tolerance: float32 end to end through 3 layers; TOL[float32] (2e-5) is ~100x the
differences measured (1e-7 .. 5e-7), and far below what a dropped mask, window, softcap
or sink changes (checked below: each changes outputs by > 1e-2)."""

import pytest
import torch
from tiny_models import CONFIGS, DECODERS, VOCAB, build, outputs

import attnkit.hf as akhf
from helpers import assert_close

N = 14


def batch(name):
    """Two rows of different lengths: left padding for decoders, right padding for BERT."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, N), generator=g)
    am = torch.ones(2, N, dtype=torch.long)
    if name == "bert":
        am[1, 9:] = 0
    else:
        am[1, :4] = 0
    return ids, am


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = build(name)
        return cache[name]

    return get


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_padded_batch_equals_eager(models, name):
    model = models(name)
    ids, am = batch(name)
    real = am.bool()
    with torch.no_grad():
        want = outputs(model, ids, attention_mask=am)
        with akhf.use(model):
            got = outputs(model, ids, attention_mask=am)
        # Without a mask at all, padded tokens leak in: the comparison can fail.
        with akhf.use(model):
            unpadded = outputs(model, ids)
    assert_close(got[real], want[real])
    assert (unpadded[1][real[1]] - want[1][real[1]]).abs().max() > 1e-2


@pytest.mark.parametrize("name", DECODERS)
def test_cached_decoding_equals_eager_full_forward(models, name):
    model = models(name)
    ids, am = batch(name)
    real = am.bool()

    def decode():
        out = model(ids[:, :9], attention_mask=am[:, :9], use_cache=True)
        cache, logits = out.past_key_values, [out.logits]
        for t in range(9, N):
            out = model(ids[:, t : t + 1], attention_mask=am[:, : t + 1], cache=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits)
        return torch.cat(logits, dim=1)

    with torch.no_grad():
        want = outputs(model, ids, attention_mask=am)
        with akhf.use(model):
            got = decode()
    assert_close(got[real], want[real])


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gpt_oss"])
def test_model_specific_behaviour_matters_here(name):
    """The sliding window, softcap and sinks these tests carry over change the outputs,
    so the equality above would catch dropping any of them."""
    ids, am = batch(name)
    with torch.no_grad():
        model = build(name)
        base = outputs(model, ids)
        if name == "gpt_oss":
            for layer in model.model.layers:
                layer.self_attn.sinks.zero_()
        elif name == "gemma2":
            model.config.attn_logit_softcapping = None
            for layer in model.model.layers:
                layer.self_attn.attn_logit_softcapping = None
        else:
            model = build("mistral")
            model.config.sliding_window = None
        changed = outputs(model, ids)
    assert (base - changed).abs().max() > 1e-2


def test_greedy_generation_equals_eager(models):
    model = models("llama")
    prompt = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=8, do_sample=False)
        with akhf.use(model):
            got = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)


def test_attnkit_as_an_attn_implementation_without_use():
    """After registration, "attnkit" also works as a plain attn_implementation string."""
    akhf.register()
    model = build("qwen2")
    ids, am = batch("qwen2")
    with torch.no_grad():
        want = outputs(model, ids, attention_mask=am)
        model.set_attn_implementation("attnkit")
        got = outputs(model, ids, attention_mask=am)
    assert_close(got[am.bool()], want[am.bool()])


class _Module(torch.nn.Module):
    is_causal = True
    layer_idx = 0


def _dense(q, k, v, scale, keep, bias=None, cap=None, sinks=None):
    """softmax over the visible keys of scale q k^T (+ cap, + bias), extra sink column; float64."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = scale * q @ k.transpose(-1, -2)
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    if bias is not None:
        s = s + bias
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        s = torch.cat((s, sinks.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)), -1)
    return (torch.softmax(s, -1)[..., : k.shape[2]] @ v).transpose(1, 2)


def test_the_function_reads_what_transformers_passes_without_a_built_mask():
    from attnkit.hf import attnkit_attention_forward
    from helpers import qkv

    q, k, v = qkv(B=1, Hq=4, Hkv=2, Nq=9, Nk=9, D=8)
    i, j = torch.arange(9).view(-1, 1), torch.arange(9).view(1, -1)
    # is_causal and sliding_window (transformers' convention: kv > q - window)
    out, weights = attnkit_attention_forward(_Module(), q, k, v, None, scaling=0.3, sliding_window=3)
    assert weights is None
    assert_close(out, _dense(q, k, v, 0.3, (j <= i) & (j > i - 3)))
    # packed varlen batch: cu_seq_lens delimit documents
    cu = torch.tensor([0, 4, 9])
    doc = torch.bucketize(torch.arange(9), cu[1:], right=True)
    out, _ = attnkit_attention_forward(_Module(), q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert_close(out, _dense(q, k, v, 0.3, (j <= i) & (doc[:, None] == doc[None, :])))
    # softcap, position bias and sinks together, not causal
    module = _Module()
    module.is_causal = False
    pb = torch.randn(1, 4, 9, 9, dtype=torch.float64)
    sinks = torch.randn(4, dtype=torch.float64)
    out, _ = attnkit_attention_forward(module, q, k, v, None, scaling=0.3, softcap=1.5, position_bias=pb, s_aux=sinks)
    assert_close(out, _dense(q, k, v, 0.3, torch.ones(9, 9, dtype=torch.bool), pb, 1.5, sinks))


def test_the_function_reads_custom_4d_masks():
    from attnkit.hf import attnkit_attention_forward
    from helpers import qkv

    q, k, v = qkv(B=2, Hq=4, Hkv=4, Nq=5, Nk=7, D=8)
    keep = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(0)) > 0.3
    keep[..., 0] = True
    additive = torch.where(keep, torch.randn(2, 1, 5, 7, dtype=torch.float64), torch.finfo(torch.float64).min)
    out, _ = attnkit_attention_forward(_Module(), q, k, v, additive, scaling=0.5)
    assert_close(out, _dense(q, k, v, 0.5, keep, torch.where(keep, additive, 0.0)))
    with pytest.raises(ValueError, match="attention_mask: list from _Module is not a mask attnkit reads"):
        attnkit_attention_forward(_Module(), q, k, v, [1, 2], scaling=0.5)
