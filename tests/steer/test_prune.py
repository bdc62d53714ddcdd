"""Gate-Norm layer pruning: the coupling score from the weights, written out here per
head as the Frobenius norm of the dense bilinear form, and skipping equal to a model
whose pruned attention sublayers add nothing to the residual stream."""

import pytest
import torch
from tiny_models import VOCAB, build

import attnkit.hf as akhf
from attnkit import steer
from helpers import assert_close


def dense_coupling(wq, wk, norm, hq, hkv):
    d = wq.shape[1]
    dh = wq.shape[0] // hq
    g = torch.diag(norm.double())
    per_head = []
    for h in range(hq):
        a = wq[h * dh : (h + 1) * dh].double() @ g
        b = wk[(h // (hq // hkv)) * dh : (h // (hq // hkv) + 1) * dh].double() @ g
        m = a.T @ b  # (d, d): x^T m y is the head's logit (before scaling)
        assert m.shape == (d, d)
        per_head.append(torch.linalg.matrix_norm(m))
    return float(torch.stack(per_head).mean())


def test_llama_coupling_is_the_bilinear_forms_norm():
    model = build("llama")
    with torch.no_grad():  # make layers differ clearly
        model.model.layers[1].self_attn.k_proj.weight.mul_(0.1)
        model.model.layers[2].input_layernorm.weight.mul_(1.5)
    want = [
        dense_coupling(l.self_attn.q_proj.weight, l.self_attn.k_proj.weight, l.input_layernorm.weight, 4, 2)
        for l in model.model.layers
    ]
    got = steer.coupling_scores(model)
    assert_close(torch.tensor(got), torch.tensor(want), dtype=torch.float64)
    pruning = steer.prune_layers(model, 1)
    assert pruning.layers == [1]
    assert [layer for layer, _ in pruning.ranking] == sorted(range(3), key=lambda i: want[i])


def test_gpt2_coupling_reads_the_fused_projection():
    model = build("gpt2")
    want = []
    for block in model.transformer.h:
        w = block.attn.c_attn.weight  # (d, 3d) Conv1D
        want.append(dense_coupling(w[:, :64].T, w[:, 64:128].T, block.ln_1.weight, 4, 4))
    assert_close(torch.tensor(steer.coupling_scores(model)), torch.tensor(want), dtype=torch.float64)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_skipped_layers_add_nothing(name):
    """Pruned model == the same model with the pruned sublayers' output projections zeroed
    (their bias too), which is what skipping a pre-norm sublayer means."""
    model = build(name).double()
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    pruning = steer.prune_layers(model, 2)
    with torch.no_grad():
        with steer.apply(model, pruning):
            got = model(input_ids=ids).logits
        reference = build(name).double()
        for layer in pruning.layers:
            proj = (
                reference.model.layers[layer].self_attn.o_proj if name == "llama" else reference.transformer.h[layer].attn.c_proj
            )
            proj.weight.zero_()
            if getattr(proj, "bias", None) is not None:
                proj.bias.zero_()
        with akhf.use(reference):  # attnkit on both sides (eager's float32 softmax differs by 1e-8)
            want = reference(input_ids=ids).logits
        plain = model(input_ids=ids).logits
    assert_close(got, want)
    assert (got - plain).abs().max() > 1e-4


def test_bert_and_bad_k_are_refused():
    with pytest.raises(ValueError, match="model: prune_layers reads W_Q and W_K of pre-norm decoder attention"):
        steer.prune_layers(build("bert"), 1)
    with pytest.raises(ValueError, match=r"k: expected an int in \[0, 3\]"):
        steer.prune_layers(build("llama"), -1)
    model = build("llama")
    with torch.no_grad(), steer.apply(model, steer.prune_layers(model, 0)):
        pass
