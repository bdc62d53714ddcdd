"""Perturbed-attention guidance and SoftPAG (attnkit.diffusion.perturb / pag) against
literal references: projections computed from the modules' own weights in float64, a
float64 SoftPAG formula run in place of the default processors' SDPA, and guidance
recomputed from separate denoiser calls."""

from __future__ import annotations

import diffusion_tiny as tiny
import pytest
import torch
from diffusion_reference import SDPAByModule, call_scale, restored, softmax64

pytest.importorskip("diffusers")

import attnkit.diffusion as ad  # noqa: E402
from attnkit.diffusion import EDITS  # noqa: E402

F32 = dict(atol=2e-5, rtol=2e-5)  # float32 model vs float64 reference: accumulated fp32 rounding over a few layers


def linear64(layer, x):
    """A torch Linear applied literally in float64."""
    y = x.double() @ layer.weight.double().T
    return y if layer.bias is None else y + layer.bias.double()


class Capture:
    """The (args, kwargs, output) of every call of ``module``."""

    def __init__(self, module):
        self.calls = []
        self.handle = module.register_forward_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs, output):
        self.calls.append((args, dict(kwargs), output))

    def close(self):
        self.handle.remove()


def run_capturing(model, inputs, module, ctx=None):
    cap = Capture(module)
    try:
        with torch.no_grad():
            if ctx is None:
                out = tiny.run(model, inputs)
            else:
                with ctx:
                    out = tiny.run(model, inputs)
    finally:
        cap.close()
    return out, cap.calls


def hidden_and_context(args, kwargs):
    hidden = args[0] if args else kwargs["hidden_states"]
    context = args[1] if len(args) > 1 else kwargs.get("encoder_hidden_states")
    return hidden, context


class SoftReference(SDPAByModule):
    """Replaces the SDPA call of each named attention module by SoftPAG's formula in
    float64, literally: (1 - u_h) softmax(q k^T * scale) v + u_h v per head h, on the
    query rows ``rows(name, nq)`` (a slice; all when None); other calls run unchanged."""

    def __init__(self, model, strengths: dict, rows=None):
        super().__init__(model)
        self.strengths, self.rows = strengths, rows

    def sdpa(self, name, call):
        if name not in self.strengths:
            return None
        v = call["value"].double()
        plain = softmax64(call["query"], call["key"], call_scale(call)) @ v
        u = torch.tensor(self.strengths[name], dtype=torch.float64).view(1, -1, 1, 1)
        soft = (1 - u) * plain + u * v
        if self.rows is not None:
            keep = self.rows(name, plain.shape[2])
            soft = torch.cat([plain[:, :, : keep.start], soft[:, :, keep], plain[:, :, keep.stop :]], dim=2)
        return soft.to(call["query"].dtype)


def run_reference(model, inputs, strengths, rows=None):
    with torch.no_grad(), SoftReference(model, strengths, rows):
        return tiny.run(model, inputs)


# -- the identity map: to_out(to_v(x)), from the weights ---------------------------------------


def test_identity_on_unet_self_attention_is_to_out_of_to_v():
    model, inputs = tiny.unet()
    name = "down_blocks.0.attentions.0.transformer_blocks.0.attn1"
    attn = model.get_submodule(name)
    assert attn.residual_connection is False and attn.rescale_output_factor == 1.0 and attn.group_norm is None
    _, calls = run_capturing(model, inputs, attn, ad.perturb(model, name))
    ((args, kwargs, out),) = calls
    x, context = hidden_and_context(args, kwargs)
    assert context is None  # self-attention
    expected = linear64(attn.to_out[0], linear64(attn.to_v, x))
    torch.testing.assert_close(out.double(), expected, **F32)
    assert restored(model)


@pytest.mark.parametrize("qk_norm", [None, "rms_norm"])
def test_identity_on_sd3_joint_attention_covers_image_and_text(qk_norm):
    model, inputs = tiny.sd3(qk_norm)
    for layer in ad.attention_layers(model):
        attn = layer.module
        assert (attn.norm_q is not None) == (qk_norm is not None)
        _, calls = run_capturing(model, inputs, attn, ad.perturb(model, layer.name))
        ((args, kwargs, (image, text)),) = calls
        x, c = hidden_and_context(args, kwargs)
        torch.testing.assert_close(image.double(), linear64(attn.to_out[0], linear64(attn.to_v, x)), **F32)
        text_v = linear64(attn.add_v_proj, c)
        expected_text = text_v if attn.context_pre_only else linear64(attn.to_add_out, text_v)
        torch.testing.assert_close(text.double(), expected_text, **F32)
    assert restored(model)


@pytest.mark.parametrize("qk_norm", [None, "rms_norm"])
def test_identity_on_sd3_with_text_kept_perturbs_image_queries_only(qk_norm):
    model, inputs = tiny.sd3(qk_norm)
    name = "transformer_blocks.0.attn"
    attn = model.get_submodule(name)
    _, plain = run_capturing(model, inputs, attn)
    _, calls = run_capturing(model, inputs, attn, ad.perturb(model, name, text="keep"))
    ((args, kwargs, (image, text)),) = calls
    x, _ = hidden_and_context(args, kwargs)
    torch.testing.assert_close(image.double(), linear64(attn.to_out[0], linear64(attn.to_v, x)), **F32)
    # text queries attend as usual over [image; text] (with the q/k norms): the model's own text output
    torch.testing.assert_close(text, plain[0][2][1], **F32)


def test_identity_on_flux_double_and_single_stream_blocks():
    model, inputs = tiny.flux()
    double = model.get_submodule("transformer_blocks.0.attn")
    _, calls = run_capturing(model, inputs, double, ad.perturb(model, "transformer_blocks.0.attn"))
    ((args, kwargs, (image, text)),) = calls
    x, c = hidden_and_context(args, kwargs)
    torch.testing.assert_close(image.double(), linear64(double.to_out[0], linear64(double.to_v, x)), **F32)
    torch.testing.assert_close(text.double(), linear64(double.to_add_out, linear64(double.add_v_proj, c)), **F32)
    single = model.get_submodule("single_transformer_blocks.1.attn")
    _, calls = run_capturing(model, inputs, single, ad.perturb(model, "single_transformer_blocks.1.attn"))
    ((args, kwargs, out),) = calls
    x, c = hidden_and_context(args, kwargs)
    assert c is None  # [text; image] arrive concatenated; the block has no output projection in attention
    torch.testing.assert_close(out.double(), linear64(single.to_v, x), **F32)
    assert restored(model)


# -- SoftPAG: the per-head blend ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["unet", "sd3", "sd3_qknorm", "flux", "pixart"])
def test_softpag_per_head_equals_the_literal_blend(name):
    model, inputs = tiny.MODELS[name]()
    layers = [layer for layer in ad.attention_layers(model) if layer.kind != "cross"]
    g = torch.Generator().manual_seed(3)
    strengths = {layer.name: torch.rand(layer.module.heads, generator=g, dtype=torch.float64).tolist() for layer in layers}
    with torch.no_grad(), ad.perturb(model, strengths):
        got = tiny.run(model, inputs)
    expected = run_reference(model, inputs, strengths)
    torch.testing.assert_close(got.double(), expected.double(), **F32)
    assert restored(model)


@pytest.mark.parametrize("name", ["unet", "sd3_qknorm", "flux"])
def test_softpag_u0_is_the_model_and_u1_is_pag(name):
    model, inputs = tiny.MODELS[name]()
    names = [layer.name for layer in ad.attention_layers(model) if layer.kind != "cross"]
    with torch.no_grad():
        own = tiny.run(model, inputs)
        with ad.perturb(model, names, strength=0.0):
            u0 = tiny.run(model, inputs)
        with ad.perturb(model, {n: [1.0] * model.get_submodule(n).heads for n in names}):
            u1 = tiny.run(model, inputs)
    torch.testing.assert_close(u0, own, **F32)
    identity = run_reference(model, inputs, {n: [1.0] * model.get_submodule(n).heads for n in names})
    torch.testing.assert_close(u1.double(), identity.double(), **F32)
    assert (u1 - own).abs().max() > 1e-3  # the perturbation does change the prediction


def test_head_pairs_perturb_those_heads_only():
    model, inputs = tiny.sd3("rms_norm")
    pairs = [("transformer_blocks.0.attn", 1), ("transformer_blocks.1.attn", 0)]
    with torch.no_grad(), ad.perturb(model, pairs, strength=0.75):
        got = tiny.run(model, inputs)
    expected = run_reference(model, inputs, {"transformer_blocks.0.attn": [0.0, 0.75], "transformer_blocks.1.attn": [0.75, 0.0]})
    torch.testing.assert_close(got.double(), expected.double(), **F32)


@pytest.mark.parametrize("name", ["sd3_qknorm", "flux"])
def test_text_kept_equals_the_blend_on_image_rows_only(name):
    model, inputs = tiny.MODELS[name]()
    # SD3 puts [image; text] (8x8 latent, patch 2: 16 image tokens); Flux [text; image],
    # in its double-stream block and in the single-stream blocks' concatenated sequence
    image_rows = (lambda n, nq: slice(0, 16)) if name == "sd3_qknorm" else (lambda n, nq: slice(tiny.TEXT, nq))
    g = torch.Generator().manual_seed(5)
    strengths = {
        layer.name: (0.3 + 0.7 * torch.rand(layer.module.heads, generator=g, dtype=torch.float64)).tolist()
        for layer in ad.attention_layers(model)
    }
    with torch.no_grad(), ad.perturb(model, strengths, text="keep"):
        got = tiny.run(model, inputs)
    expected = run_reference(model, inputs, strengths, rows=image_rows)
    torch.testing.assert_close(got.double(), expected.double(), **F32)


def test_rows_flag_perturbs_only_those_batch_rows():
    model, inputs = tiny.unet()
    name = "mid_block.attentions.0.transformer_blocks.0.attn1"
    with torch.no_grad():
        own = tiny.run(model, inputs)
        with ad.perturb(model, name) as state:
            state.rows = torch.tensor([False, True])
            got = tiny.run(model, inputs)
    expected = run_reference(model, inputs, {name: [1.0] * model.get_submodule(name).heads})
    torch.testing.assert_close(got[0], own[0], **F32)
    torch.testing.assert_close(got[1].double(), expected[1].double(), **F32)


# -- selection, errors, restoring -----------------------------------------------------------------


def test_layer_selection_is_exact():
    model, inputs = tiny.dit(num_layers=11)
    target = model.get_submodule("transformer_blocks.1.attn1")
    with ad.perturb(model, "transformer_blocks.1.attn1"):
        edited = [m for m in model.modules() if m in EDITS]
        routed = [m for m in model.modules() if "forward" in m.__dict__]
    assert edited == [target] and routed == [target]  # never transformer_blocks.10.attn1
    with ad.pag(model, [("transformer_blocks.1.attn1", 1)], cfg=False) as state:
        assert [m for m in model.modules() if m in EDITS] == [target]
        assert state.strengths["transformer_blocks.1.attn1"].tolist() == [0.0, 1.0]
    for bad in ("transformer_blocks.1", "blocks.1.attn1", "transformer_blocks.1.attn1 "):
        with pytest.raises(ValueError, match="layers"):
            ad.perturb(model, bad).__enter__()
    assert restored(model)


def test_bad_arguments_raise_clear_errors_and_change_nothing():
    model, inputs = tiny.pixart()
    with pytest.raises(ValueError, match="cross-attention"):
        ad.perturb(model, "transformer_blocks.0.attn2").__enter__()
    with pytest.raises(ValueError, match="strength"):
        ad.perturb(model, "transformer_blocks.0.attn1", strength=1.5).__enter__()
    with pytest.raises(ValueError, match=r"layers\['transformer_blocks.0.attn1'\]"):
        ad.perturb(model, {"transformer_blocks.0.attn1": [0.5, 0.5, 0.5]}).__enter__()
    with pytest.raises(ValueError, match=r"layers\['transformer_blocks.0.attn1'\]"):
        ad.perturb(model, {"transformer_blocks.0.attn1": [0.5, float("nan")]}).__enter__()
    with pytest.raises(ValueError, match="head 2"):
        ad.perturb(model, [("transformer_blocks.0.attn1", 2)]).__enter__()
    with pytest.raises(ValueError, match="text"):
        ad.perturb(model, "transformer_blocks.0.attn1", text="drop").__enter__()
    with pytest.raises(ValueError, match="scale"):
        ad.pag(model, "transformer_blocks.0.attn1", float("inf"), cfg=False).__enter__()
    with pytest.raises(ValueError, match="cfg"):
        ad.pag(model, "transformer_blocks.0.attn1").__enter__()  # a bare model must say how it is batched
    assert restored(model)


def test_model_and_other_edits_restored_after_an_exception(tiny_pipeline):
    pipe, call = tiny_pipeline
    unet = pipe.unet
    name = "mid_block.attentions.0.transformer_blocks.0.attn1"
    module = unet.get_submodule(name)

    class Marker:  # another intervention's edit already on the module
        def scores(self, layout, query, key):
            return []

        def output(self, layout, out):
            return out

    marker = Marker()
    EDITS[module] = marker
    try:

        def fail(pipeline, step, timestep, kwargs):
            raise RuntimeError("stop")

        with pytest.raises(RuntimeError, match="stop"), torch.no_grad(), ad.pag(pipe, name, 2.0):
            pipe(**call, generator=torch.Generator().manual_seed(0), callback_on_step_end=fail)
        assert EDITS.get(module) is marker
    finally:
        EDITS.pop(module, None)
    assert restored(unet)


# -- guidance -------------------------------------------------------------------------------------


def test_pag_scale_zero_equals_the_base_pipeline(tiny_pipeline):
    pipe, call = tiny_pipeline
    with torch.no_grad():
        base = pipe(**call, generator=torch.Generator().manual_seed(0)).images
        with ad.pag(pipe, ad.layer_names(pipe, kind="self"), 0.0):
            guided = pipe(**call, generator=torch.Generator().manual_seed(0)).images
    torch.testing.assert_close(guided, base, **F32)
    assert restored(pipe.unet)


def _literal_sampling(pipe, call, layers, scale, seed):
    """The pipeline's DDIM loop written out, with eps from separate denoiser calls:
    eps_u + g (eps_c - eps_u) + s (eps_c - eps_ptb) (without CFG: eps_c + s (eps_c - eps_ptb))."""
    from diffusers import DDIMScheduler

    unet, g = pipe.unet, call["guidance_scale"]
    scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    scheduler.set_timesteps(call["num_inference_steps"])
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(seed)) * scheduler.init_noise_sigma
    with torch.no_grad():
        for t in scheduler.timesteps:
            x = scheduler.scale_model_input(latents, t)
            eps_c = unet(x, t, encoder_hidden_states=call["prompt_embeds"], return_dict=False)[0]
            with ad.perturb(unet, layers):
                eps_p = unet(x, t, encoder_hidden_states=call["prompt_embeds"], return_dict=False)[0]
            if g > 1:
                eps_u = unet(x, t, encoder_hidden_states=call["negative_prompt_embeds"], return_dict=False)[0]
                eps = eps_u + g * (eps_c - eps_u) + scale * (eps_c - eps_p)
            else:
                eps = eps_c + scale * (eps_c - eps_p)
            latents = scheduler.step(eps, t, latents, return_dict=False)[0]
    return latents


@pytest.mark.parametrize("guidance_scale", [3.0, 1.0])
def test_pag_in_a_pipeline_equals_three_separate_denoiser_calls(tiny_pipeline, guidance_scale):
    pipe, call = tiny_pipeline
    call = dict(call, guidance_scale=guidance_scale)
    layers = ["mid_block.attentions.0.transformer_blocks.0.attn1", "up_blocks.1.attentions.0.transformer_blocks.0.attn1"]
    with torch.no_grad(), ad.pag(pipe, layers, 2.5):
        got = pipe(**call, generator=torch.Generator().manual_seed(4)).images
    expected = _literal_sampling(pipe, call, layers, 2.5, 4)
    torch.testing.assert_close(got, expected, **F32)
    base = _literal_sampling(pipe, call, layers, 0.0, 4)
    assert (got - base).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["sd3_qknorm", "flux"])
def test_pag_on_a_joint_attention_model_with_cfg_halves(name):
    model, inputs = tiny.MODELS[name]()
    layers = [layer.name for layer in ad.attention_layers(model)][:2]
    with torch.no_grad():
        with ad.pag(model, layers, 1.5, cfg=True):
            got = tiny.run(model, inputs)
        eps = tiny.run(model, inputs)  # row 0 plays the unconditional, row 1 the conditional half
        cond = {
            k: (v[1:] if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == 2 and k not in ("img_ids", "txt_ids") else v)
            for k, v in inputs.items()
        }
        with ad.perturb(model, layers):
            eps_p = tiny.run(model, cond)
    delta = 1.5 * (eps[1:] - eps_p)
    torch.testing.assert_close(got, eps + torch.cat([delta, delta]), **F32)
    g = 4.0  # whatever the pipeline's g, its combination of the halves is the PAG formula
    combined = got[:1] + g * (got[1:] - got[:1])
    torch.testing.assert_close(combined, eps[:1] + g * (eps[1:] - eps[:1]) + delta, **F32)
    assert restored(model)


def test_pag_with_the_conditional_half_first():
    model, inputs = tiny.dit()  # DiTPipeline batches [conditional; unconditional]
    name = "transformer_blocks.1.attn1"
    with torch.no_grad():
        with ad.pag(model, name, 2.0, cfg=True, conditional="first"):
            got = tiny.run(model, inputs)
        eps = tiny.run(model, inputs)
        with ad.perturb(model, name):
            eps_p = tiny.run(model, {k: (v[:1] if torch.is_tensor(v) and v.dim() >= 1 else v) for k, v in inputs.items()})
    delta = 2.0 * (eps[:1] - eps_p)
    torch.testing.assert_close(got, eps + torch.cat([delta, delta]), **F32)
    with pytest.raises(ValueError, match="conditional"):
        ad.pag(model, name, cfg=True, conditional="last").__enter__()
    assert restored(model)


def test_perturb_inside_use_keeps_the_outer_switch_and_its_observers():
    from attnkit.observe import Entropy

    model, inputs = tiny.unet()
    name = "up_blocks.1.attentions.0.transformer_blocks.0.attn1"
    with torch.no_grad():
        with ad.perturb(model, name):
            alone = tiny.run(model, inputs)
        entropy = Entropy()
        with ad.use(model, observers=[entropy]) as switch:
            routed = model.get_submodule(name).__dict__["forward"]
            with ad.perturb(model, name):
                assert model.get_submodule(name).__dict__["forward"] is routed  # not switched a second time
                inside = tiny.run(model, inputs)
        seen = {switch.names[layer] for layer, *_ in entropy.rows()}
    torch.testing.assert_close(inside, alone, **F32)
    assert name in seen
    assert restored(model)


def test_pag_without_cfg_returns_the_models_output_type():
    model, inputs = tiny.unet()
    name = "down_blocks.0.attentions.0.transformer_blocks.0.attn1"
    with torch.no_grad():
        own = model(**inputs)  # a UNet2DConditionOutput (return_dict=True)
        with ad.perturb(model, name):
            eps_p = model(**inputs).sample
        with ad.pag(model, name, 0.5, cfg=False):
            got = model(**inputs)
    assert type(got) is type(own)
    torch.testing.assert_close(got.sample, own.sample + 0.5 * (own.sample - eps_p), **F32)
    assert restored(model)
