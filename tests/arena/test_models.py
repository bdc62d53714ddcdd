"""The arena's models and mechanism specs."""

import math

import pytest
import torch

from attnkit.arena import MechanismSpec, RetrievalLayer, VectorTransformer, build_model, make_task, parse_mechanisms
from attnkit.nn import TransformerConfig, TransformerLM


def test_spec_parses_names_parameters_and_the_delta_alias():
    assert MechanismSpec.parse("softmax") == MechanismSpec("softmax", "softmax", {})
    spec = MechanismSpec.parse("linear:rule=delta:feature_map=elu+1:chunk_size=16")
    assert spec.name == "linear" and spec.params == {"rule": "delta", "feature_map": "elu+1", "chunk_size": 16}
    assert spec.label == "linear:rule=delta:feature_map=elu+1:chunk_size=16"
    assert MechanismSpec.parse("sigmoid:bias=-2.5").params == {"bias": -2.5}
    assert MechanismSpec.parse("delta").name == "deltanet"
    assert [s.name for s in parse_mechanisms("softmax, gla,linear_elu")] == ["softmax", "gla", "linear_elu"]
    assert parse_mechanisms(["gla", spec]) == [MechanismSpec.parse("gla"), spec]
    with pytest.raises(ValueError, match="once"):
        parse_mechanisms(["gla", MechanismSpec.parse("gla")])


@pytest.mark.parametrize(
    "text,match",
    [("nope", "unknown mechanism"), ("linear:rule", "key=value"), ("softmax,softmax", "once"), (" , ", "comma-separated")],
)
def test_bad_specs_raise(text, match):
    with pytest.raises(ValueError, match=match):
        parse_mechanisms(text)


@torch.no_grad()
def test_retrieval_layer_is_one_softmax_read_of_all_pairs():
    """Against the literal formula in float64: x_t = E_k[k_t] + E_v[v_t], per head
    softmax(q·k_t / sqrt(d_h)) over every pair, then the read-out."""
    torch.manual_seed(0)
    layer = RetrievalLayer(num_keys=5, num_values=7, d_model=8, n_heads=2, mechanism="softmax").double()
    inputs = torch.tensor([[[0, 3], [4, 1], [0, 6], [2, 2], [4, 7]], [[1, 0], [1, 5], [3, 3], [2, 4], [3, 7]]])
    out = layer(inputs)
    assert out.shape == (2, 1, 7)
    for b in range(2):
        x = [layer.key_embed.weight[k] + layer.value_embed.weight[v] for k, v in inputs[b, :4].tolist()]
        query = layer.key_embed.weight[inputs[b, 4, 0]]
        q = layer.q_proj.weight @ query
        read = []
        for h in range(2):
            sl = slice(4 * h, 4 * h + 4)
            logits = torch.stack([(q[sl] @ (layer.k_proj.weight @ xt)[sl]) / math.sqrt(4) for xt in x])
            weights = torch.softmax(logits, 0)
            read.append(sum(w * (layer.v_proj.weight @ xt)[sl] for w, xt in zip(weights, x)))
        expected = layer.readout.weight @ torch.cat(read)
        assert float((out[b, 0] - expected).abs().max()) < 1e-12


def test_retrieval_layer_reads_in_order_for_the_delta_rule():
    """The delta rule overwrites: swapping two pairs with the same key changes the read;
    the sum rule only adds, so the order of the pairs does not matter to it."""
    torch.manual_seed(0)
    inputs = torch.tensor([[[0, 1], [1, 2], [0, 3], [0, 0]]])
    swapped = inputs[:, [2, 1, 0, 3]]
    delta = RetrievalLayer(2, 4, 8, 1, "fast_weight").double()
    summed = RetrievalLayer(2, 4, 8, 1, "dpfp").double()
    with torch.no_grad():
        assert float((delta(inputs) - delta(swapped)).abs().max()) > 1e-6
        assert float((summed(inputs) - summed(swapped)).abs().max()) < 1e-12


@torch.no_grad()
def test_vector_transformer_on_one_hot_inputs_is_the_language_model():
    """With read-in = the embedding and read-out = the LM head, the vector model on one-hot
    vectors computes exactly TransformerLM on the token ids: same blocks, same positions."""
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=11, d_model=16, n_layers=2, n_heads=2, mechanism=["softmax", "gla"])
    lm = TransformerLM(config).double()
    vec = VectorTransformer(config, input_dim=11, output_dim=11).double()
    vec.blocks.load_state_dict(lm.blocks.state_dict())
    vec.norm.load_state_dict(lm.norm.state_dict())
    vec.read_in.weight.copy_(lm.embed.weight.T)
    vec.read_in.bias.zero_()
    vec.read_out.weight.copy_(lm.lm_head.weight)
    vec.read_out.bias.zero_()
    idx = torch.randint(0, 11, (3, 9))
    one_hot = torch.nn.functional.one_hot(idx, 11).double()
    assert float((vec(one_hot) - lm(idx)).abs().max()) < 1e-12
    with pytest.raises(ValueError, match="x: expected"):
        vec(one_hot[..., :5])


def test_build_model_picks_the_model_the_task_is_read_by():
    spec = MechanismSpec.parse("softmax")
    assert isinstance(build_model(make_task("mqar"), spec, 32, 2, 4), TransformerLM)
    assert isinstance(build_model(make_task("regression"), spec, 32, 2, 4), VectorTransformer)
    assert isinstance(build_model(make_task("associative"), spec, 32, 1, 1), RetrievalLayer)
    needle = build_model(make_task("needle", seq_len=32), spec, 32, 2, 4)
    assert needle.config.max_len == 128  # evaluated at 4x the training length
    with pytest.raises(ValueError, match="1-layer probe"):
        build_model(make_task("associative"), spec, 32, 2, 1)
    with pytest.raises(ValueError, match="heads"):
        build_model(make_task("associative"), spec, 30, 1, 4)
