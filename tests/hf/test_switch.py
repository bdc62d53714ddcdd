"""attnkit.hf.use: changes on chosen layers and heads, observers, restore, errors.

The reference for a change is the literal dense formula, registered in transformers as
an attention function of its own (with transformers' eager mask) and applied to the same
model: softmax(scale q k^T, the model's additive mask, the change) v. Float32 models:
TOL[float32] (see test_attention.py)."""

import math

import pytest
import torch
from tiny_models import VOCAB, build, outputs
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

import attnkit as ak
import attnkit.hf as akhf
from attnkit.mechanisms import Mechanism, available
from attnkit.observe import Observer
from helpers import assert_close

N = 14
DENSE = "attnkit_test_dense"
CHANGE = {}  # what the dense reference applies: layers, heads, window, temperature, sinks


def dense_reference(module, query, key, value, attention_mask, scaling, dropout=0.0, softcap=None, **kwargs):
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1).double()
    v = value.repeat_interleave(groups, dim=1).double()
    s = query.double() @ k.transpose(-1, -2) * scaling
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s + attention_mask.double()
    H, nq, nk = s.shape[1], s.shape[2], s.shape[3]
    on = torch.zeros(H, dtype=torch.bool)
    layers = CHANGE.get("layers")
    if layers is None or module.layer_idx in layers:
        on[list(CHANGE.get("heads") or range(H))] = True
    on = on.view(1, H, 1, 1)
    if "temperature" in CHANGE:
        s = torch.where(on, s / CHANGE["temperature"], s)
    if "window" in CHANGE:
        qpos = torch.arange(nk - nq, nk).view(-1, 1)
        far = torch.arange(nk).view(1, -1) < qpos - CHANGE["window"]
        s = torch.where(on & far, torch.tensor(-math.inf, dtype=s.dtype), s)
    if "sinks" in CHANGE:
        sink = torch.where(on.view(H), CHANGE["sinks"].double(), torch.tensor(-math.inf, dtype=s.dtype))
        s = torch.cat([s, sink.view(1, H, 1, 1).expand(s.shape[0], H, nq, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :nk]
    return (p @ v).to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(DENSE, dense_reference)
AttentionMaskInterface.register(DENSE, eager_mask)


def reference(model, ids, **change):
    CHANGE.clear()
    CHANGE.update(change)
    model.set_attn_implementation(DENSE)
    try:
        return outputs(model, ids)
    finally:
        model.set_attn_implementation("eager")


@pytest.fixture(scope="module")
def llama():
    return build("llama")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(1, VOCAB, (2, N), generator=torch.Generator().manual_seed(3))


CHANGES = {
    "window": (dict(mask=ak.window(3)), dict(window=3)),
    "temperature": (dict(score=ak.temperature(0.05)), dict(temperature=0.05)),
    "sinks": (dict(sinks=torch.tensor([1.0, -0.5, 2.0, 0.0])), dict(sinks=torch.tensor([1.0, -0.5, 2.0, 0.0]))),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("where", ["all", "layers", "heads", "layers+heads"])
def test_change_equals_dense_reference_and_changes_outputs(llama, ids, change, where):
    use_kw, ref_kw = CHANGES[change]
    select = {"all": {}, "layers": dict(layers=[1]), "heads": dict(heads=[0, 3]), "layers+heads": dict(layers=[0, 2], heads=[2])}[
        where
    ]
    with torch.no_grad():
        plain = outputs(llama, ids)
        want = reference(llama, ids, **ref_kw, **select)
        with akhf.use(llama, **use_kw, **select):
            got = outputs(llama, ids)
    assert_close(got, want)
    assert (got - plain).abs().max() > 1e-3


def test_learned_sinks_receive_gradients(llama, ids):
    sinks = torch.zeros(4, requires_grad=True)
    with akhf.use(llama, sinks={1: sinks}):
        outputs(llama, ids).square().mean().backward()
    assert sinks.grad is not None and sinks.grad.abs().min() > 0


def test_sinks_join_the_models_own_sinks():
    model = build("gpt_oss")
    x = torch.randint(1, VOCAB, (1, N), generator=torch.Generator().manual_seed(4))
    extra = torch.tensor([0.5, -1.0, 1.5, 0.0])
    with torch.no_grad():
        with akhf.use(model, sinks=extra):
            got = outputs(model, x)
        # Reference: the two sinks as one, logaddexp of both (two zero-valued keys).
        own = [layer.self_attn.sinks.clone() for layer in model.model.layers]
        for layer, s in zip(model.model.layers, own):
            layer.self_attn.sinks.copy_(torch.logaddexp(s, extra))
        want = outputs(model, x)
        for layer, s in zip(model.model.layers, own):
            layer.self_attn.sinks.copy_(s)
    assert_close(got, want)


class Mixed(Mechanism):
    """Softmax with temperature 0.05, as a mechanism object (takes the split-heads path)."""

    name = "mixed_test"

    def forward(self, q, k, v, score=None, **call):
        scores = [ak.temperature(0.05)] if score is None else [score, ak.temperature(0.05)]
        return ak.attention(q, k, v, score=scores, **call)


def test_another_mechanism_on_some_heads_equals_the_reference(llama, ids):
    with torch.no_grad():
        want = reference(llama, ids, temperature=0.05, heads=[1, 2])
        with akhf.use(llama, mechanism=Mixed(), heads=[1, 2]):
            got = outputs(llama, ids)
    assert_close(got, want)


# Parameters a mechanism needs in a causal decoder layer; the rest run with their defaults.
MECHANISM_PARAMS = {
    "sigmoid": dict(bias=-2.0),
    "neighborhood": dict(kernel=5, causal=True, rpb=True),
    "top_theta": dict(thresholds=torch.zeros(4)),
    "topk": dict(k=4),
    "adaptive_span": dict(max_span=8),
    "hyper_attention": dict(min_seq_len=4, block_size=4, sample_size=4),
    "block_sparse": dict(block_size=4, last_q=4, vertical_size=2, slash_size=2, sink_tokens=1, local_tokens=2),
    "nsa": dict(compress_block=4, compress_stride=2, select_block=4, num_selected=3, window=4),
}
# Mechanisms whose learned parts start as the identity compute softmax until they train.
STARTS_AS_SOFTMAX = {"softmax", "talking_heads", "multi_token"}
# Based's Taylor-2 features approximate exp closely at the small logits of a random init.
CLOSE_TO_SOFTMAX = {"based": 1e-6}


@pytest.mark.parametrize("name", available())
def test_every_registered_mechanism_runs_end_to_end_with_the_layers_sizes(llama, ids, name):
    with torch.no_grad():
        plain = outputs(llama, ids)
        with akhf.use(llama, mechanism=name, **MECHANISM_PARAMS.get(name, {})) as switch:
            got = outputs(llama, ids)
    assert sorted(switch.mechanisms) == ([] if name == "softmax" else [0, 1, 2])
    assert bool(torch.isfinite(got).all())
    if name in STARTS_AS_SOFTMAX:
        assert_close(got, plain)
    else:
        assert (got - plain).abs().max() > CLOSE_TO_SOFTMAX.get(name, 1e-3)


def test_gemma2_change_sits_on_top_of_softcap_and_sliding_window():
    model = build("gemma2")
    x = torch.randint(1, VOCAB, (1, N), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = reference(model, x, temperature=0.5, heads=[1])
        with akhf.use(model, score=ak.temperature(0.5), heads=[1]):
            got = outputs(model, x)
    assert_close(got, want)


class Recorder(Observer):
    """Calls seen, and per layer the weight mass of every (row, head, query) and on padded keys."""

    def __init__(self, pad_from=None):
        self.calls, self.mass, self.pad_mass, self.pad_from = [], {}, 0.0, pad_from

    def begin(self, call):
        self.calls.append((call.layer, call.heads, call.q_len, call.k_len))
        self.mass[call.layer] = torch.zeros(call.batch, call.heads, call.q_len, dtype=torch.float64)

    def update(self, tile):
        rows = (tile.q_pos - tile.call.q_start).view(1, 1, -1)
        index = (tile.batch.view(-1, 1, 1), tile.head_index.view(1, -1, 1), rows)
        self.mass[tile.layer].index_put_(index, tile.weights.sum(-1).double(), accumulate=True)
        if self.pad_from is not None:
            padded = (tile.batch.view(-1, 1, 1, 1) == 1) & (tile.k_pos.view(1, 1, 1, -1) >= self.pad_from)
            self.pad_mass += float((tile.weights * padded).sum())


def test_observers_see_every_layer_tagged_and_weights_sum_to_one(llama, ids):
    meter = Recorder()
    with torch.no_grad(), akhf.use(llama, observers=[meter]):
        llama(ids)
    assert [c[0] for c in meter.calls] == [0, 1, 2]
    assert all(c[1:] == (4, N, N) for c in meter.calls)
    for layer in range(3):
        assert_close(meter.mass[layer], torch.ones(2, 4, N, dtype=torch.float64), dtype=torch.float32)

    meter = Recorder()
    with torch.no_grad(), akhf.use(llama, observers=[meter], layers=[2], heads=[1]):
        llama(ids)
    assert [c[0] for c in meter.calls] == [2]


def test_observers_on_bert_put_no_weight_on_padding():
    model = build("bert")
    x = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(6))
    am = torch.ones(2, 10, dtype=torch.long)
    am[1, 6:] = 0
    meter = Recorder(pad_from=6)
    with torch.no_grad(), akhf.use(model, observers=[meter]):
        model(x, attention_mask=am)
    assert [c[0] for c in meter.calls] == [0, 1, 2]
    for layer in range(3):
        assert_close(meter.mass[layer], torch.ones(2, 4, 10, dtype=torch.float64), dtype=torch.float32)
    assert meter.pad_mass == 0.0


def test_restored_after_exit_and_after_an_exception(llama, ids):
    with torch.no_grad():
        plain = outputs(llama, ids)
        with akhf.use(llama, mask=ak.window(2)):
            pass
        assert llama.config._attn_implementation == "eager"
        with pytest.raises(RuntimeError, match="boom"):
            with akhf.use(llama, mask=ak.window(2)):
                assert llama.config._attn_implementation == "attnkit"
                raise RuntimeError("boom")
        assert llama.config._attn_implementation == "eager"
        assert torch.equal(outputs(llama, ids), plain)


def test_nested_switches_restore_the_outer_one(llama, ids):
    with torch.no_grad():
        with akhf.use(llama, mask=ak.window(2)):
            outer = outputs(llama, ids)
            with akhf.use(llama, score=ak.temperature(0.1)):
                inner = outputs(llama, ids)
            again = outputs(llama, ids)
    assert (inner - outer).abs().max() > 1e-3
    assert torch.equal(again, outer)


def test_a_named_mechanism_is_built_once_per_changed_layer(llama, ids, monkeypatch):
    from attnkit.mechanisms import base

    monkeypatch.setitem(base._REGISTRY, "mixed_test", Mixed)
    with torch.no_grad():
        want = reference(llama, ids, temperature=0.05, layers=[0, 2])
        with akhf.use(llama, mechanism="mixed_test", layers=[0, 2]) as switch:
            got = outputs(llama, ids)
    assert_close(got, want)
    assert sorted(switch.mechanisms) == [0, 2]
    assert switch.mechanisms[0] is not switch.mechanisms[2]


def test_model_without_the_interface_gets_a_clear_error():
    import transformers as T

    config = T.MPNetConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    model = T.MPNetModel(config)
    with pytest.raises(ValueError, match="MPNetModel does not route its attention"):
        with akhf.use(model):
            pass
    with pytest.raises(ValueError, match="PreTrainedModel, got Linear"):
        with akhf.use(torch.nn.Linear(2, 2)):
            pass


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(layers=[3]), "layers: expected non-negative ints below 3"),
        (dict(heads=[]), "heads: expected at least one head"),
        (dict(heads=[-1]), "heads: expected non-negative ints"),
        (dict(heads=[7]), "heads: expected non-negative ints below 4, got 7"),
        (dict(mechanism="no_such_mechanism"), "mechanism: unknown name"),
        (dict(mechanism=Mixed(), heads=[0], observers=[Recorder()]), "observers: with heads="),
        (dict(sinks=[0.0]), "sinks: expected a tensor"),
    ],
)
def test_bad_arguments_raise_value_error(llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        with akhf.use(llama, **kwargs):
            pass
    assert llama.config._attn_implementation == "eager"


def test_bad_shapes_raise_at_call_time(llama, ids):
    with pytest.raises(ValueError, match=r"sinks: expected one logit per query head, shape \(4,\)"):
        with torch.no_grad(), akhf.use(llama, sinks=torch.zeros(3)):
            llama(ids)


def test_training_mode_dropout_is_refused_not_ignored():
    model = build("bert").train()
    with pytest.raises(ValueError, match="dropout: attnkit attention has no attention dropout"):
        with akhf.use(model):
            model(torch.randint(1, VOCAB, (1, 5)))
