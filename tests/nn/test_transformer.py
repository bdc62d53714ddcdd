"""TransformerLM: blocks as written (pre-norm, RMSNorm, SwiGLU), the loss, generation
with and without a cache, per-layer mechanisms from the config, safetensors round trip."""

import math

import pytest
import torch
import torch.nn.functional as F

import attnkit as ak
from attnkit.nn import SwiGLU, TransformerConfig, TransformerLM
from helpers import assert_close

VOCAB = 40


def tiny(**kwargs):
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_len=64, **kwargs)
    return TransformerLM(config).double().eval()


def ids(B=2, N=10, seed=1):
    return torch.randint(0, VOCAB, (B, N), generator=torch.Generator().manual_seed(seed))


def test_forward_is_prenorm_rmsnorm_swiglu_written_out():
    model = tiny()
    idx = ids()

    def rms(x, norm):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight

    x = model.embed.weight[idx]
    for block in model.blocks:
        x = x + block.attn(rms(x, block.attn_norm))
        h = rms(x, block.mlp_norm)
        x = x + F.silu(h @ block.mlp.w1.weight.T) * (h @ block.mlp.w3.weight.T) @ block.mlp.w2.weight.T
    want = rms(x, model.norm) @ model.embed.weight.T  # tied head
    assert_close(model(idx), want)


def test_swiglu_hidden_size_default():
    assert TransformerConfig(vocab_size=2, d_model=96).ff_dim == 256  # 8/3 * 96 = 256
    assert TransformerConfig(vocab_size=2, d_model=100).ff_dim == 288  # 266 rounded up to 32
    assert isinstance(tiny().blocks[0].mlp, SwiGLU)


def test_loss_is_mean_cross_entropy_ignoring_minus_100():
    model = tiny()
    idx = ids()
    targets = ids(seed=2)
    targets[0, :3] = -100
    logits, loss = model(idx, targets)
    logp = torch.log_softmax(logits, -1)
    keep = targets != -100
    want = -logp[keep].gather(-1, targets[keep][:, None]).mean()
    assert math.isclose(loss.item(), want.item(), rel_tol=1e-12)


CONFIGS = {
    "rope gqa": dict(n_kv_heads=2),
    "alibi": dict(positions="alibi"),
    "learned": dict(positions="learned"),
    "nope": dict(positions="nope"),
    "yarn partial": dict(rope_scaling=dict(kind="yarn", factor=2.0, original_max_len=16), rotary_dim=4),
    "mixed mechanisms": dict(mechanism=["softmax", "gla"], window=[4, None]),
    "mla": dict(latent=dict(kv_rank=8, rope_dim=4)),
    "qk_norm gate": dict(qk_norm=True, gate="elementwise"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_logits_and_generation_equal_recomputation(name):
    model = tiny(**CONFIGS[name])
    idx = ids(N=9)
    cache = model.new_cache()
    steps = [model(idx[:, :6], cache=cache)] + [model(idx[:, t : t + 1], cache=cache) for t in range(6, 9)]
    assert_close(torch.cat(steps, 1), model(idx))
    prompt = idx[:1, :4]
    assert torch.equal(model.generate(prompt, 4, temperature=0), model.generate(prompt, 4, temperature=0, use_cache=False))


def test_sampling_respects_top_k():
    model = tiny()
    out = model.generate(ids(B=1, N=3), 20, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, model.generate(ids(B=1, N=3), 20, temperature=0))


def test_per_layer_mechanisms_and_params_come_from_the_config():
    model = tiny(mechanism=["sigmoid", "gated_deltanet"], mechanism_params=[dict(bias=-2.0), {}])
    assert [b.attn.mechanism.name for b in model.blocks] == ["sigmoid", "gated_deltanet"]
    assert model.blocks[0].attn.mechanism.bias == -2.0
    # Mechanism parameters are model parameters: they train and save.
    names = [n for n, _ in model.named_parameters()]
    assert any(n.startswith("blocks.1.attn.mechanism.") for n in names)


def test_save_and_load_round_trip(tmp_path):
    model = tiny(mechanism=["softmax", "gla"], mechanism_params=[{}, {}], sinks=[True, False], gate="headwise")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # not the init: the file must carry them
    path = str(tmp_path / "model.safetensors")
    model.save(path)
    loaded = TransformerLM.load(path).eval()
    assert loaded.embed.weight.dtype == torch.float64
    assert loaded.config == model.config
    idx = ids()
    assert torch.equal(loaded(idx), model(idx))
    assert loaded.lm_head.weight is loaded.embed.weight


def test_load_refuses_other_files(tmp_path):
    from safetensors.torch import save_file

    path = str(tmp_path / "other.safetensors")
    save_file({"w": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match="is not a TransformerLM saved by attnkit"):
        TransformerLM.load(path)
    with pytest.raises(ValueError, match=r"config: unknown fields \['colour'\]"):
        TransformerConfig.from_json('{"vocab_size": 4, "colour": "red"}')


def test_a_few_steps_of_training_lower_the_loss():
    torch.manual_seed(0)
    model = TransformerLM(TransformerConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, mechanism=["softmax", "gla"]))
    data = torch.arange(25).remainder(7)[None].repeat(2, 1)  # a repeating pattern
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        _, loss = model(data[:, :-1], data[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_document_mask_passes_to_every_layer():
    model = tiny()
    a, b = ids(B=1, N=5, seed=3), ids(B=1, N=4, seed=4)
    packed = model(torch.cat((a, b), 1), mask=ak.document(torch.tensor([0] * 5 + [1] * 4)))
    # Positions keep counting across documents; RoPE makes attention relative, so the
    # second document alone gives the same logits.
    assert_close(packed[:, :5], model(a))
    assert_close(packed[:, 5:], model(b))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(positions="sinusoidal"), "positions: expected one of"),
        (dict(mechanism=["softmax"]), "mechanism: a list must have one entry per layer"),
        (dict(n_layers=0), "n_layers: expected a positive int"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TransformerConfig(vocab_size=VOCAB, n_layers=kwargs.pop("n_layers", 2), **kwargs)


def test_bad_calls():
    model = tiny(positions="learned")
    with pytest.raises(ValueError, match="idx: expected integer token ids"):
        model(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="idx: learned positions cover 64 tokens"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature: expected >= 0"):
        model.generate(ids(B=1, N=2), 1, temperature=-1)


def test_mechanisms_get_the_models_context_and_decode_with_its_cache():
    """sigmoid's n and cosFormer's horizon M are the model's max_len, not the length of a
    call: the cached forward equals the full one (decoding_contract.py holds every
    mechanism to this; here through TransformerLM's own cache)."""
    model = tiny(mechanism=["sigmoid", "cosformer"], mechanism_params=[{}, {}])
    sigmoid, cosformer = (b.attn.mechanism for b in model.blocks)
    assert sigmoid.context == 64 and sigmoid.bias == -math.log(64)
    assert cosformer.feature_map.max_len == 64
    idx = ids(N=12)
    with torch.no_grad():
        full = model(idx)
        cache = model.new_cache()
        steps = [model(idx[:, :5], cache=cache)] + [model(idx[:, t : t + 1], cache=cache) for t in range(5, 12)]
    assert_close(torch.cat(steps, dim=1), full)
    # A context given in the parameters wins.
    assert tiny(mechanism="sigmoid", mechanism_params=dict(context=9)).blocks[0].attn.mechanism.bias == -math.log(9)
