"""attnkit.diffusion.use on tiny diffusers models of every routing: UNet (Attention +
AttnProcessor2_0, self and cross), DiT, PixArt, SD3 (joint processor, with and without
QK norm) and Flux (AttentionModuleMixin + dispatcher, RoPE, single-stream blocks)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

import diffusion_tiny as tiny  # noqa: E402
from diffusion_reference import recorded, restored  # noqa: E402

import attnkit.diffusion as ad  # noqa: E402
from helpers import assert_close  # noqa: E402

HALF = lambda s, b, h, q, kv: s * 0.5  # noqa: E731  a score mod that changes every row


@pytest.fixture(scope="module", params=list(tiny.MODELS))
def built(request):
    model, inputs = tiny.MODELS[request.param]()
    with torch.no_grad():
        ref = tiny.run(model, inputs)
    return request.param, model, inputs, ref


def test_no_change_equals_default(built):
    name, model, inputs, ref = built
    with torch.no_grad(), ad.use(model) as switch:
        out = tiny.run(model, inputs)
    assert len(switch.layers) == len(ad.attention_layers(model)) > 0
    assert_close(out, ref, torch.float32)
    assert restored(model)


def test_changed_score_equals_dense_reference(built):
    """Halved logits on every layer equal the model run with a literal float64 softmax
    of halved logits in place of each SDPA call."""
    name, model, inputs, ref = built
    with torch.no_grad():
        expected, _ = recorded(model, lambda: tiny.run(model, inputs), logits=lambda s: s * 0.5)
    with torch.no_grad(), ad.use(model, score=HALF):
        out = tiny.run(model, inputs)
    assert (expected - ref).abs().max() > 1e-4  # the change is visible
    assert_close(out, expected, torch.float32)


def test_heads_gate_the_change(built):
    name, model, inputs, ref = built

    def head0(s):
        s = s.clone()
        s[:, 0] = s[:, 0] * 0.5
        return s

    with torch.no_grad():
        expected, _ = recorded(model, lambda: tiny.run(model, inputs), logits=head0)
    with torch.no_grad(), ad.use(model, score=HALF, heads=[0]):
        out = tiny.run(model, inputs)
    assert_close(out, expected, torch.float32)


CHANGES = {"score": dict(score=HALF), "mask": dict(mask=lambda b, h, q, kv: kv % 2 == 0), "mechanism": dict(mechanism="sigmoid")}


@pytest.mark.parametrize("change", list(CHANGES))
def test_change_reaches_only_selected_layers(built, change):
    """Every attention module is recomputed on the inputs it got inside ``use``: the
    selected one differs from the module's own attention, every other one equals it."""
    name, model, inputs, ref = built
    layers = ad.attention_layers(model)
    chosen = layers[len(layers) // 2].name
    seen = {}

    def keeper(name):
        def hook(module, args, kwargs, out):
            seen.setdefault(name, (args, kwargs, out))  # the first call; returns None: output unchanged

        return hook

    hooks = [layer.module.register_forward_hook(keeper(layer.name), with_kwargs=True) for layer in layers]
    try:
        with torch.no_grad(), ad.use(model, layers=[chosen], **CHANGES[change]):
            tiny.run(model, inputs)
    finally:
        for h in hooks:
            h.remove()
    assert set(seen) == {layer.name for layer in layers}
    for layer in layers:
        args, kwargs, out = seen[layer.name]
        with torch.no_grad():
            own = layer.module(*args, **kwargs)
        own, out = (own[0], out[0]) if isinstance(own, tuple) else (own, out)
        if layer.name == chosen:
            assert (own - out).abs().max() > 1e-5, layer.name
        else:
            assert_close(out, own, torch.float32, msg=layer.name)


def test_gradients_reach_latents(built):
    name, model, inputs, ref = built
    key = "sample" if "sample" in inputs else "hidden_states"

    def grad(ctx):
        x = inputs[key].clone().requires_grad_()
        with ctx:
            out = tiny.run(model, {**inputs, key: x})
        out.square().sum().backward()
        return x.grad

    from contextlib import nullcontext

    own = grad(nullcontext())
    assert_close(grad(ad.use(model)), own, torch.float32)
    changed = grad(ad.use(model, score=HALF))
    assert torch.isfinite(changed).all() and (changed - own).abs().max() > 0
    model.zero_grad(set_to_none=True)


def test_restored_after_errors(built):
    name, model, inputs, ref = built
    with pytest.raises(RuntimeError, match="boom"):
        with ad.use(model, score=HALF):
            raise RuntimeError("boom")
    assert restored(model)
    with pytest.raises(ValueError, match="heads"):
        with torch.no_grad(), ad.use(model, score=HALF, heads=[7]):
            tiny.run(model, inputs)  # fails inside the first attention call
    assert restored(model)
    with torch.no_grad():
        assert_close(tiny.run(model, inputs), ref, torch.float32)


def test_layers_are_selected_by_exact_path():
    model, inputs = tiny.dit(num_layers=11)
    with ad.use(model, layers=["transformer_blocks.1.attn1"]) as switch:
        assert [layer.name for layer in switch.layers] == ["transformer_blocks.1.attn1"]
        wrapped = [layer.name for layer in ad.attention_layers(model) if "forward" in layer.module.__dict__]
        assert wrapped == ["transformer_blocks.1.attn1"]
    for bad in ("transformer_blocks.1", "blocks.1.attn1", "attn1"):
        with pytest.raises(ValueError, match="layers"):
            with ad.use(model, layers=[bad]):
                pass
    assert restored(model)


def test_self_and_cross_are_told_apart():
    model, _ = tiny.unet()
    cross = ad.layer_names(model, kind="cross")
    self_ = ad.layer_names(model, kind="self")
    assert cross and self_ and all(n.endswith("attn2") for n in cross) and all(n.endswith("attn1") for n in self_)
    with ad.use(model, kind="cross") as switch:
        assert [layer.name for layer in switch.layers] == cross
    with pytest.raises(ValueError, match="cross"):
        with ad.use(model, layers=[self_[0]], kind="cross"):
            pass
    flux, _ = tiny.flux()
    assert ad.layer_names(flux, kind="joint") == [
        "transformer_blocks.0.attn",
        "single_transformer_blocks.0.attn",
        "single_transformer_blocks.1.attn",
    ]


def test_bad_arguments():
    model, _ = tiny.dit()
    for kwargs, word in [
        ({"kind": "both"}, "kind"),
        ({"heads": [-1]}, "heads"),
        ({"layers": [3]}, "layers"),
        ({"mechanism": "no_such_mechanism"}, "mechanism"),
    ]:
        with pytest.raises(ValueError, match=word):
            with ad.use(model, **kwargs):
                pass
    with pytest.raises(ValueError, match="model_or_pipeline"):
        with ad.use(object()):
            pass
    assert restored(model)


def test_other_mechanism_runs_on_selected_layers():
    model, inputs = tiny.sd3()
    with torch.no_grad():
        ref = tiny.run(model, inputs)
        with ad.use(model, mechanism="sigmoid", layers=["transformer_blocks.1.attn"]) as switch:
            out = tiny.run(model, inputs)
    assert list(switch.mechanisms) == [1]
    assert torch.isfinite(out).all() and (out - ref).abs().max() > 1e-4


def test_edits_hook_for_interventions():
    """An intervention object in EDITS sees each call's layout and can add score mods and
    transform outputs (the path PAG / attend-and-excite will take)."""
    model, inputs = tiny.pixart()
    layer = ad.attention_layers(model)[1]
    assert layer.kind == "cross"
    seen = []

    class Edit:
        def scores(self, layout, query, key):
            seen.append(layout)
            return [HALF]

        def output(self, layout, out):
            return out

    ad.EDITS[layer.module] = Edit()
    try:
        with torch.no_grad(), ad.use(model, layers=[layer.name]):
            edited = tiny.run(model, inputs)
    finally:
        del ad.EDITS[layer.module]
    with torch.no_grad(), ad.use(model, layers=[layer.name], score=HALF):
        expected = tiny.run(model, inputs)
    assert_close(edited, expected, torch.float32)
    assert seen[0].kind == "cross" and seen[0].text_keys == (0, tiny.TEXT) and seen[0].grid == (4, 4)


def test_text_padding_mask_is_carried_over():
    """UNet's encoder_attention_mask (diffusers turns it into an additive SDPA mask):
    the switched model equals its own, and masked text tokens get no map mass."""
    model, inputs = tiny.unet()
    keep = torch.ones(2, tiny.TEXT, dtype=torch.bool)
    keep[0, -2:] = False
    masked = {**inputs, "encoder_attention_mask": keep}
    with torch.no_grad():
        own = tiny.run(model, masked)
        assert (own - tiny.run(model, inputs)).abs().max() > 1e-5  # the mask matters
        meter = ad.TokenMaps()
        with ad.use(model, observers=[meter]):
            out = tiny.run(model, masked)
    assert_close(out, own, torch.float32)
    maps = meter.maps()
    assert maps[0, -2:].abs().max() == 0 and maps[0, :-2].sum() > 0 and maps[1, -2:].sum() > 0


def test_inner_use_takes_over_its_layers_and_gives_them_back():
    model, inputs = tiny.flux()
    with torch.no_grad():
        ref = tiny.run(model, inputs)
        with ad.use(model, score=HALF):
            halved = tiny.run(model, inputs)
        outer_maps = ad.TokenMaps()
        with ad.use(model, observers=[outer_maps]):
            with ad.use(model, score=HALF):
                inner = tiny.run(model, inputs)
            assert not outer_maps.grids  # the inner switch ran every layer
            back = tiny.run(model, inputs)
            assert outer_maps.grids == [(4, 6)]
    assert_close(inner, halved, torch.float32)
    assert_close(back, ref, torch.float32)
    assert restored(model)
