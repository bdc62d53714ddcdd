"""attnkit.inspect on tiny random models: every meter against the model's dense
attention (transformers' eager formula, float64), restrictions, bad input."""

import warnings

import pytest
import torch
from dense_meters import record_dense
from inspect_models import bert, llama, saved, tokenizer
from test_meters_dense import all_meters, check_all

import attnkit as ak
from attnkit.inspection import load_local_model
from helpers import TOL


def test_inspect_is_the_function_even_after_submodule_imports():
    import attnkit.inspection.compare  # noqa: F401
    import attnkit.inspection.profile  # noqa: F401

    assert callable(ak.inspect) and ak.inspect.__module__ == "attnkit.inspection.run"


@pytest.mark.parametrize("build", [llama, bert], ids=["llama-causal-gqa", "bert-padded-batch"])
def test_every_meter_matches_the_models_dense_attention(build):
    model = build()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 40, (2, 150), generator=g)
    mask = torch.ones_like(ids)
    if build is bert:
        mask[1, 120:] = 0  # a padded row: padding keys are invisible
    profile = ak.inspect(model, {"input_ids": ids, "attention_mask": mask}, meters=all_meters())
    got = {(layer, h, m): v for layer, h, m, v in profile.rows}
    dense = record_dense(model.base_model, input_ids=ids, attention_mask=mask)
    assert sorted(dense) == [0, 1] and profile.layers == [0, 1]
    for layer, (p, vis, s) in dense.items():
        check_all(got, layer, TOL[torch.float32], p, vis, s, torch.arange(150))


def test_default_meters_tokens_and_arrays(tmp_path):
    tok = tokenizer(tmp_path)
    text = "the keeper wrote about fog and the bell every night"
    profile = ak.inspect(llama(), text, tokenizer=tok)
    n = len(tok(text)["input_ids"])
    assert profile.tokens == tok.convert_ids_to_tokens(tok(text)["input_ids"]) and profile.meta["tokens"] == n
    assert {"sink.score", "sink.pos-1", "entropy.norm", "distance.1", "logit.max", "topkeys.top8"} <= set(profile.metrics)
    assert set(profile.arrays["top_keys"]) == {(layer, h) for layer in range(2) for h in range(4)}
    top = profile.arrays["top_keys"][(1, 2)]
    assert top["index"].shape == (1, n, 8)
    # causal: a query's top keys are at or before it, and row i has min(i + 1, 8) of them
    for i in range(n):
        found = top["index"][0, i][top["index"][0, i] >= 0]
        assert len(found) == min(i + 1, 8) and int(found.max()) <= i
    assert profile.arrays["entropy"][(0, 0)]["values"].shape == (1, n)


def test_restrictions_reach_the_meters():
    ids = torch.randint(5, 40, (1, 60), generator=torch.Generator().manual_seed(0))
    profile = ak.inspect(llama(layers=3), ids, layers=[1], heads=[0, 3], queries=(-10, None), meters=["sink", "distance"])
    assert profile.heads == [(1, 0), (1, 3)]
    full = ak.inspect(llama(layers=3), ids, meters=["sink"], queries=(-10, None))
    assert profile.value(1, 3, "sink.score") == pytest.approx(full.value(1, 3, "sink.score"), rel=1e-6)


def test_a_weight_edit_shows_as_drift_in_the_edited_layer_only():
    ids = torch.randint(5, 40, (1, 80), generator=torch.Generator().manual_seed(1))
    model = llama()
    before = ak.inspect(model, ids)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight.mul_(3.0)
    after = ak.inspect(model, ids)
    cmp = before.compare(after)
    assert max(cmp.drift[(0, h)] for h in range(4)) == 0.0  # layer 0 is upstream of the edit: same numbers
    assert min(cmp.drift[(1, h)] for h in range(4)) > 1e-5  # sharper keys move every head of layer 1


def test_bad_inputs_raise_clear_errors(tmp_path):
    tok = tokenizer(tmp_path)
    model = bert(positions=64)
    with pytest.raises(ValueError, match="empty"):
        ak.inspect(model, "   ", tokenizer=tok)
    with pytest.raises(ValueError, match="tokenizer"):
        ak.inspect(model, "the sea")
    long_text = " ".join(["the sea"] * 50)
    with pytest.raises(ValueError, match="at most 64 positions.*max_tokens=64"):
        ak.inspect(model, long_text, tokenizer=tok)
    with pytest.warns(UserWarning, match="102 tokens truncated to the first 64"):
        profile = ak.inspect(model, long_text, tokenizer=tok, max_tokens=64)
    assert profile.meta["tokens"] == 64 and profile.meta["truncated_from"] == 102 and profile.tokens[-1] == "[SEP]"
    with pytest.raises(ValueError, match="meters: unknown"):
        ak.inspect(model, "the sea", tokenizer=tok, meters=["sinks"])
    with pytest.raises(ValueError, match="layers.*2 layers"):
        ak.inspect(model, "the sea", tokenizer=tok, layers=[2])
    with pytest.raises(ValueError, match="spans"):
        ak.inspect(model, "the sea", tokenizer=tok, meters=["spans"])
    with pytest.raises(ValueError, match="max_tokens"):
        ak.inspect(model, "the sea", tokenizer=tok, max_tokens=0)


def test_load_local_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_local_model(str(tmp_path / "missing"))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="is a file"):
        load_local_model(str(tmp_path / "notes.txt"))
    with pytest.raises(ValueError, match="no config.json"):
        load_local_model(str(tmp_path))
    path = saved(llama(), tokenizer(tmp_path), tmp_path / "model")
    model, tok = load_local_model(path)
    assert type(model).__name__ == "LlamaModel" and model.dtype == torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ak.inspect(model, "the lamp", tokenizer=tok).meta["model_type"] == "llama"
