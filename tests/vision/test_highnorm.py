"""High-norm tokens of ViT towers against the models' own hidden states and eager
attention weights (float64), register neurons against their definition, and test-time
registers' activation move, shapes and restoration."""

import pytest
import torch
import transformers as T

from attnkit import vision

FACTOR = 1.3  # random-init towers have mild outliers; the definition is what is tested


def tower(name):
    torch.manual_seed(0)
    common = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, image_size=16, patch_size=4)
    config, cls = {
        "vit": (T.ViTConfig(intermediate_size=64, **common), T.ViTModel),
        "dinov2": (T.Dinov2Config(mlp_ratio=2, **common), T.Dinov2Model),
        "siglip": (T.SiglipVisionConfig(intermediate_size=64, **common), T.SiglipVisionModel),
        "clip": (T.CLIPVisionConfig(intermediate_size=64, **common), T.CLIPVisionModel),
    }[name]
    return cls._from_config(config, attn_implementation="eager").double().eval()


PIXELS = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


@pytest.mark.parametrize("name", ["vit", "dinov2", "siglip", "clip"])
def test_high_norm_equals_hidden_states_and_eager_weights(name):
    model = tower(name)
    with torch.no_grad():
        ref = model(pixel_values=PIXELS, output_hidden_states=True, output_attentions=True)
    got = vision.high_norm(model, PIXELS, factor=FACTOR)
    rows = {(layer, head, metric): v for layer, head, metric, v in got.rows}
    for layer in range(3):
        norms = ref.hidden_states[layer].norm(dim=-1)  # the hidden state entering layer `layer`
        assert torch.allclose(got.norms[layer], norms, atol=1e-12)
        out = norms > FACTOR * norms.median(dim=-1, keepdim=True).values
        assert torch.equal(got.outliers[layer], out)
        assert rows[(layer, -1, "highnorm.count")] == pytest.approx(float(out.sum()) / 2)
        a = ref.attentions[layer]  # (B, H, N, N)
        for h in range(a.shape[1]):
            want = float((a[:, h] * out[:, None, :]).sum() / a[:, h].sum())
            assert rows[(layer, h, "highnorm.mass")] == pytest.approx(want, abs=1e-6)  # received mass is stored float32
            assert rows[(layer, h, "highnorm.uniform")] == pytest.approx(float(out.double().mean()))
    if name != "clip":  # CLIP's pre-layernorm levels the norms entering layer 0
        assert any(bool(o.any()) for o in got.outliers)


def _mlp_inputs(model, pixel_values):
    _, _, outs = vision.vit_parts(model)
    acts = {}
    handles = [
        o.register_forward_pre_hook(lambda mod, args, i=i: acts.__setitem__(i, args[0].clone())) for i, o in enumerate(outs)
    ]
    try:
        with torch.no_grad():
            model(pixel_values=pixel_values)
    finally:
        for h in handles:
            h.remove()
    return acts


def test_register_neurons_by_definition():
    model = tower("vit")
    neurons = vision.register_neurons(model, PIXELS, top=2, factor=FACTOR)
    measured = vision.high_norm(model, PIXELS, factor=FACTOR)
    acts = _mlp_inputs(model, PIXELS)
    assert neurons
    for layer, units in neurons.items():
        out = measured.outliers[layer + 1]
        a = acts[layer]
        gap = a[out].mean(0) - a[~out].mean(0)
        assert units == gap.topk(2).indices.tolist()


def test_test_time_registers_move_the_activations():
    model = tower("dinov2")
    with torch.no_grad():
        plain = model(pixel_values=PIXELS, output_hidden_states=True)
    neurons = {1: [3, 7]}
    _, _, outs = vision.vit_parts(model)
    before, after = {}, {}
    h1 = outs[1].register_forward_pre_hook(lambda mod, args: before.__setitem__("a", args[0].clone()))  # runs first
    h2 = outs[1].register_forward_hook(lambda mod, args, out: after.__setitem__("a", args[0].clone()))
    try:
        with torch.no_grad(), vision.test_time_registers(model, neurons, count=2):
            regs = model(pixel_values=PIXELS, output_hidden_states=True)
    finally:
        h1.remove()
        h2.remove()
    n = plain.last_hidden_state.shape[1]
    a, b = before["a"], after["a"]
    assert a.shape[1] == n + 2
    for u in neurons[1]:
        assert torch.equal(b[:, :n, u], torch.zeros_like(b[:, :n, u]))
        assert torch.equal(b[:, n:, u], a[:, :n, u].amax(1, keepdim=True).expand(-1, 2))
    others = [u for u in range(a.shape[2]) if u not in neurons[1]]
    assert torch.equal(b[..., others], a[..., others])
    assert regs.last_hidden_state.shape == plain.last_hidden_state.shape
    assert all(x.shape == y.shape for x, y in zip(regs.hidden_states, plain.hidden_states))
    assert not torch.allclose(regs.last_hidden_state, plain.last_hidden_state)
    with torch.no_grad(), pytest.raises(RuntimeError, match="boom"), vision.test_time_registers(model, neurons):
        raise RuntimeError("boom")
    with torch.no_grad():
        again = model(pixel_values=PIXELS, output_hidden_states=True)
    assert torch.equal(again.last_hidden_state, plain.last_hidden_state)


def test_bad_input():
    import tiny_vlms as V

    vlm = V.build("llava")
    with pytest.raises(ValueError, match="^model: LlavaForConditionalGeneration is not a vision transformer tower") as err:
        vision.high_norm(vlm, PIXELS)
    assert "\n" not in str(err.value)
    model = tower("vit")
    with pytest.raises(ValueError, match="^neurons: layer 5 is not one of the tower's 3 layers"):
        with vision.test_time_registers(model, {5: [0]}):
            pass
    with pytest.raises(ValueError, match="^neurons: layer 0 names \\[64\\]"):
        with vision.test_time_registers(model, {0: [64]}):
            pass
    with pytest.raises(ValueError, match="^factor: expected a number > 1"):
        vision.high_norm(model, PIXELS, factor=1.0)
