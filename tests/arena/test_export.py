"""``attnkit.arena.export``: a TransformerLM as a transformers LlamaForCausalLM.

Equal logits and generations against the attnkit model, the word-level tokenizer, the
refused settings, the CLI, offline loading, and the trained test subjects (induction
heads measured in eager attention weights, needle retrieval).

Tolerance: the two models run the same operations in float32 in a different order
(attnkit's kernels vs transformers' sdpa/eager attention, fused vs unfused RMSNorm)
and RoPE's inverse frequencies are rounded to float32 from float64 (attnkit) or
computed in float32 (transformers): a few ulps per operation through two layers, so
the float32 tolerance of tests/helpers.py (2e-5, about 300 ulps at 1) holds with room.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from attnkit.arena import export, make_task, read_task, task_symbols  # noqa: E402
from attnkit.arena.trainer import generator  # noqa: E402
from attnkit.cli import main  # noqa: E402
from attnkit.nn import TransformerConfig, TransformerLM  # noqa: E402
from helpers import TOL  # noqa: E402

NEEDLE = dict(seq_len=16, num_filler=4, num_keys=4, num_values=4, distractors=1)


def random_model(task, dtype=torch.float32, **overrides) -> TransformerLM:
    """A TransformerLM with weights far from their initialisation (std 0.02 makes every
    logit nearly equal, which would hide a wrong mapping)."""
    settings = dict(vocab_size=task.vocab_size, d_model=32, n_layers=2, n_heads=4, max_len=64)
    model = TransformerLM(TransformerConfig(**{**settings, **overrides}))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.to(dtype).eval()


def load(directory, **kwargs):
    return AutoModelForCausalLM.from_pretrained(directory, **kwargs).eval()


# ---------------------------------------------------------------- equal logits


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(n_kv_heads=2),  # GQA
        dict(n_kv_heads=1, head_dim=16, d_ff=40),  # MQA, head_dim != d_model / heads
        dict(tie_embeddings=False, bias=True, norm_eps=1e-5),
        dict(rope_base=500.0, rope_scaling={"kind": "linear", "factor": 2.0}),
        dict(rope_scaling={"kind": "ntk", "factor": 4.0}),
        dict(rope_scaling={"kind": "yarn", "factor": 4.0, "original_max_len": 16}),
    ],
    ids=["mha", "gqa", "mqa", "untied-bias", "linear", "ntk", "yarn"],
)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_exported_logits_equal_the_trained_models(tmp_path, overrides, attn):
    task = make_task("needle", **NEEDLE)
    model = random_model(task, **overrides)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    export(model, task, str(tmp_path))
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's random stream is left alone
    llama = load(tmp_path, attn_implementation=attn)
    assert type(llama).__name__ == "LlamaForCausalLM"
    ids = task.sample(3, torch.Generator().manual_seed(2)).inputs
    ids = torch.cat([ids, ids.flip(1)], dim=1)  # 32 positions: past yarn's original 16
    with torch.no_grad():
        expected = model(ids)
        actual = llama(ids).logits
    assert expected.std() > 1  # the logits are far apart: a wrong weight would show
    torch.testing.assert_close(actual, expected, **TOL[torch.float32])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model is untouched


def test_float64_model_exports_in_float64(tmp_path):
    task = make_task("needle", **NEEDLE)
    model = random_model(task, dtype=torch.float64)
    export(model, task, str(tmp_path))
    llama = load(tmp_path)
    assert llama.dtype == torch.float64
    ids = task.sample(2, torch.Generator().manual_seed(3)).inputs
    with torch.no_grad():
        # transformers computes RoPE's cos/sin in float32 even for a float64 model.
        torch.testing.assert_close(llama(ids).logits, model(ids), **TOL[torch.float32])


def test_greedy_generation_equals_transformer_lm_generate(tmp_path):
    task = make_task("induction", vocab_size=16, seq_len=16)
    model = random_model(task, n_kv_heads=2)
    export(model, task, str(tmp_path))
    llama = load(tmp_path)
    prompt = task.sample(2, torch.Generator().manual_seed(4)).inputs[:, :10]
    ours = model.generate(prompt, max_new_tokens=12, temperature=0)
    theirs = llama.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    assert torch.equal(theirs, ours)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "overrides",
    [
        dict(mechanism="sigmoid"),
        dict(mechanism="sigmoid", mechanism_params={"context": 256}),
        dict(mechanism=["linear_elu", "softmax"]),
        dict(mechanism=["softmax", "linear_elu"]),
        dict(mechanism="linear_elu"),
    ],
    ids=["sigmoid", "sigmoid-context", "linear-softmax", "softmax-linear", "linear"],
)
def test_mechanisms_without_weights_export_and_run_through_the_switch(tmp_path, overrides):
    """Sigmoid and parameter-free linear layers: Llama's weights, config.json naming the
    layers' mechanism; run inside mechanism_switch, the export computes what was trained
    (sigmoid's b fixed to the context it trained with); plain transformers does not."""
    from attnkit.arena.export import export_mechanisms, mechanism_switch

    task = make_task("needle", **NEEDLE)
    model = random_model(task, **overrides)
    export(model, task, str(tmp_path))
    llama = load(tmp_path)
    layers = export_mechanisms(llama.config)
    mechanisms = overrides["mechanism"] if isinstance(overrides["mechanism"], list) else [overrides["mechanism"]] * 2
    assert [entry["layer"] for entry in layers] == [i for i, m in enumerate(mechanisms) if m != "softmax"]
    if mechanisms[0] == "sigmoid":
        assert layers[0]["params"]["context"] == overrides.get("mechanism_params", {}).get("context", 64)
    ids = task.sample(3, torch.Generator().manual_seed(2)).inputs
    with torch.no_grad():
        expected = model(ids)
        with mechanism_switch(llama):
            actual = llama(ids).logits
        plain = llama(ids).logits
    torch.testing.assert_close(actual, expected, **TOL[torch.float32])
    assert (plain - expected).abs().max() > 1e-2  # transformers alone runs softmax


def test_a_hybrid_spec_names_one_mechanism_per_layer():
    from attnkit.arena import MechanismSpec, build_model

    spec = MechanismSpec.parse("linear_elu/sigmoid:context=32")
    assert spec.per_layer == (("linear_elu", {}), ("sigmoid", {"context": 32}))
    model = build_model(make_task("needle", **NEEDLE), spec, 16, 2, 2)
    assert [type(b.attn.mechanism).__name__ for b in model.blocks] == ["LinearElu", "Sigmoid"]
    with pytest.raises(ValueError, match="names 2 layers' mechanisms, the model has 3 layers"):
        build_model(make_task("needle", **NEEDLE), spec, 16, 3, 2)
    with pytest.raises(ValueError, match="unknown mechanism 'nope'"):
        MechanismSpec.parse("softmax/nope")


@pytest.mark.parametrize(
    "overrides, setting",
    [
        (dict(mechanism="gla"), "mechanism"),
        (dict(mechanism=["softmax", "deltanet"]), "mechanism"),
        (dict(positions="alibi"), "positions"),
        (dict(positions="nope"), "positions"),
        (dict(positions="learned"), "positions"),
        (dict(qk_norm=True), "qk_norm"),
        (dict(gate="headwise"), "gate"),
        (dict(sinks=True), "sinks"),
        (dict(sinks=[False, True]), "sinks"),
        (dict(latent={"kv_rank": 16, "rope_dim": 4}), "latent"),
        (dict(window=4), "window"),
        (dict(window=[None, 8]), "window"),
        (dict(rotary_dim=4), "rotary_dim"),
    ],
)
def test_settings_llama_cannot_express_are_refused_by_name(tmp_path, overrides, setting):
    task = make_task("needle", **NEEDLE)
    model = random_model(task, **overrides)
    target = tmp_path / "out"
    with pytest.raises(ValueError, match=rf"^{setting}: "):
        export(model, task, str(target))
    assert not target.exists()  # refused before anything is written


def test_models_and_tasks_without_token_vocabularies_are_refused(tmp_path):
    from attnkit.arena import MechanismSpec, build_model

    regression = make_task("regression")
    with pytest.raises(ValueError, match="^model: expected an attnkit TransformerLM"):
        export(build_model(regression, MechanismSpec.parse("softmax"), 8, 1, 2), regression, str(tmp_path / "a"))
    needle = make_task("needle", **NEEDLE)
    with pytest.raises(ValueError, match="^task: regression feeds its model vectors inputs"):
        export(random_model(needle), regression, str(tmp_path / "b"))
    other = make_task("needle", **{**NEEDLE, "num_keys": 5})
    with pytest.raises(ValueError, match="^model: vocab_size 13 does not match the needle task's 14 symbols"):
        export(random_model(needle), other, str(tmp_path / "c"))
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------- tokenizer and task.json


def test_needle_symbols_are_readable_and_in_the_tasks_id_order():
    task = make_task("needle", **NEEDLE)  # ids: filler 0-3, query 4, keys 5-8, values 9-12
    symbols = task_symbols(task)
    assert symbols.tokens == ("f0", "f1", "f2", "f3", "Q", "k0", "k1", "k2", "k3", "v0", "v1", "v2", "v3")
    assert symbols.roles["query"] == "Q" and symbols.roles["keys"] == ["k0", "k1", "k2", "k3"]
    assert symbols.tokens[task.query_token] == "Q"


@pytest.mark.parametrize(
    "name, params",
    [
        ("induction", dict(vocab_size=16, seq_len=16)),
        ("needle", NEEDLE),
        ("mqar", dict(vocab_size=16, seq_len=16, num_kv_pairs=(1, 3))),
        ("selective_copy", dict(vocab_size=8, seq_len=16, num_tokens=4)),
        ("variable_tracking", dict(seq_len=32, hops=2, num_variables=8, num_values=8)),
    ],
)
def test_tokenizer_round_trips_task_text_one_token_per_symbol(tmp_path, name, params):
    task = make_task(name, **params)
    model = random_model(task)
    export(model, task, str(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    symbols = task_symbols(task)
    assert len(tokenizer) == task.vocab_size  # no extra special tokens
    assert tokenizer.bos_token is None and tokenizer.eos_token is None and tokenizer.unk_token is None
    assert tokenizer.pad_token in symbols.tokens and tokenizer.padding_side == "left"
    batch = task.sample(4, torch.Generator().manual_seed(5)).inputs
    for row in batch.tolist():
        text = " ".join(symbols.tokens[i] for i in row)
        for add in (True, False):
            assert tokenizer(text, add_special_tokens=add)["input_ids"] == row
        assert tokenizer.decode(row) == text
        assert tokenizer.convert_ids_to_tokens(row) == text.split()
    assert tokenizer("  " + text.replace(" ", "\n", 1) + " ")["input_ids"] == row  # any whitespace separates
    with pytest.raises(Exception, match="UNK"):  # an unknown word is an error, never a silent id
        tokenizer(text + " nonsymbol")


def test_symbols_encode_refuses_unknown_words():
    symbols = task_symbols(make_task("needle", **NEEDLE))
    assert symbols.encode("k1 v2\tf3  Q k1") == [6, 11, 3, 4, 6]  # f0-f3 = 0-3, Q = 4, k0 = 5, v0 = 9
    assert symbols.decode([6, 11, 3, 4, 6]) == "k1 v2 f3 Q k1"
    with pytest.raises(ValueError, match="^text: 'k9', 'x' are not symbols of this task"):
        symbols.encode("k1 x k9")


def test_task_json_rebuilds_the_task_and_its_example(tmp_path):
    task = make_task("needle", **NEEDLE)
    export(random_model(task), task, str(tmp_path), training={"steps": 7})
    rebuilt, symbols, record = read_task(str(tmp_path))
    assert rebuilt == task and symbols == task_symbols(task)
    assert record["task"] == "needle" and record["training"] == {"steps": 7}
    assert record["params"] == {**NEEDLE, "num_depths": 5, "test_factors": [1, 2, 4], "value_len": 1}
    words = record["example"]["text"].split()
    assert len(words) == task.seq_len and words[-2] == "Q" and words[-1].startswith("k")
    [[position, answer]] = record["example"]["answers"]
    assert position == task.seq_len - 1
    assert words[words.index(words[-1]) + 1] == answer  # the value written after the queried key
    with pytest.raises(ValueError, match="^directory: .* has no task.json"):
        read_task(str(tmp_path / "nowhere"))


def test_from_pretrained_works_offline(tmp_path):
    task = make_task("needle", **NEEDLE)
    model = random_model(task)
    export(model, task, str(tmp_path))
    ids = task.sample(1, torch.Generator().manual_seed(6)).inputs
    script = (
        "import sys, json, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1]); t = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "ids = t(sys.argv[2], return_tensors='pt').input_ids\n"
        "print(json.dumps(m(ids).logits[0, -1].tolist()))\n"
    )
    text = " ".join(task_symbols(task).tokens[i] for i in ids[0].tolist())
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "HF_HOME": str(tmp_path / "empty-hf-home"),
    }
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), text], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    with torch.no_grad():
        expected = model(ids)[0, -1]
    torch.testing.assert_close(torch.tensor(json.loads(out.stdout.splitlines()[-1])), expected, **TOL[torch.float32])


# ---------------------------------------------------------------- the command line


def test_cli_exports_one_run(tmp_path, capsys):
    out, target = tmp_path / "run", tmp_path / "model"
    code = main(
        [
            "arena",
            "needle",
            "--d-model",
            "16",
            "--heads",
            "2",
            "--param",
            "seq_len=16",
            "--param",
            "distractors=1",
            "--steps",
            "4",
            "--eval-every",
            "2",
            "--batch-size",
            "8",
            "--eval-examples",
            "32",
            "--no-plots",
            "--quiet",
            "--out",
            str(out),
            "--export",
            str(target),
        ]
    )
    assert code == 0
    assert f"transformers model: {target}" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json", "task.json"} <= set(os.listdir(target))
    task, _, record = read_task(str(target))
    assert task == make_task("needle", seq_len=16, distractors=1)
    assert record["training"]["d_model"] == 16 and record["training"]["steps"] == 4
    # The exported model scores the run's own held-out examples (drawn from the run's seed
    # stream) exactly as the trained model did in results.json.
    rows = json.loads((out / "results.json").read_text())["rows"]
    llama = load(target)
    for row in rows:
        length = row["eval_len"]
        data = make_task("needle", seq_len=length, distractors=1).held_out(32, generator(0, "eval", length))
        with torch.no_grad():
            logits = llama(data.inputs).logits
        accuracy = ((logits.argmax(-1) == data.targets) & data.mask).sum() / data.mask.sum()
        assert float(accuracy) == pytest.approx(row["accuracy"], abs=1e-12)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mechanisms", "softmax,sigmoid"], "--export: exports one run"),
        (["--seeds", "2"], "--export: exports one run"),
        (["--mechanisms", "gla"], "mechanism: layer 0 runs 'gla', whose own weights"),
    ],
)
def test_cli_refuses_exports_before_training(tmp_path, capsys, args, message):
    out = tmp_path / "run"
    code = main(
        [
            "arena",
            "needle",
            "--d-model",
            "8",
            "--heads",
            "2",
            "--param",
            "seq_len=16",
            "--steps",
            "2",
            "--quiet",
            "--out",
            str(out),
            "--export",
            str(tmp_path / "model"),
            *args,
        ]
    )
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (out / "results.csv").exists() and not (tmp_path / "model").exists()


def test_cli_refuses_a_task_without_tokens(tmp_path, capsys):
    code = main(
        [
            "arena",
            "regression",
            "--d-model",
            "8",
            "--heads",
            "2",
            "--steps",
            "2",
            "--quiet",
            "--out",
            str(tmp_path / "run"),
            "--export",
            str(tmp_path / "model"),
        ]
    )
    assert code == 2
    assert "model: expected an attnkit TransformerLM" in capsys.readouterr().err


# ---------------------------------------------------------------- the trained test subjects


def test_induction_export_has_induction_heads(induction_export):
    """Olsson et al. (arXiv 2209.11895): on a repeated random sequence, an induction head
    attends from a token of the second copy to the token after its earlier occurrence.
    The fixture (the induction-32 organism) trained on segments of 8-14 tokens at random offsets,
    so distance carries no information; measured here at segment lengths it never saw in
    training (5 and task.segment = 16), where only content can find the copy."""
    task, symbols, record = read_task(induction_export)
    assert min(record["training"]["accuracy"].values()) >= 0.99
    llama = load(induction_export, attn_implementation="eager")
    for S in (5, task.segment):
        _assert_induction_head(llama, task, S)


def _assert_induction_head(llama, task, S):
    segment = torch.rand(8, task.vocab_size, generator=torch.Generator().manual_seed(7)).argsort(1)[:, :S]
    ids = torch.cat([segment, segment], dim=1)
    with torch.no_grad():
        attentions = llama(ids, output_attentions=True).attentions  # per layer (B, H, N, N)
    queries = torch.arange(S, 2 * S - 1)  # second copy, whose next token is known
    keys = queries - S + 1  # the token after the earlier occurrence
    scores = torch.stack([a[:, :, queries, keys].mean(dim=(0, 2)) for a in attentions])  # (layers, heads)
    assert scores.max() > 0.5, scores
    layer = int(scores.max(dim=1).values.argmax())
    assert layer >= 1  # the induction head reads what an earlier layer wrote
    predictions = llama(ids).logits.argmax(-1)[:, queries]
    assert (predictions == ids[:, queries + 1]).float().mean() > 0.95


def test_induction_export_continues_a_segment_with_generate(induction_export):
    tokenizer = AutoTokenizer.from_pretrained(induction_export)
    llama = load(induction_export)
    task, symbols, _ = read_task(induction_export)
    words = symbols.roles["segment"]
    order = torch.rand(2, len(words), generator=torch.Generator().manual_seed(8)).argsort(1)[:, : task.segment].tolist()
    prompts = [" ".join(words[i] for i in row) + " " + " ".join(words[i] for i in row[:3]) for row in order]
    prompts[1] = " ".join(prompts[1].split()[2:])  # a shorter prompt: the batch is left-padded
    batch = tokenizer(prompts, padding=True, return_tensors="pt")
    assert batch["attention_mask"][1, :2].sum() == 0
    n_new = task.segment - 3
    out = llama.generate(**batch, max_new_tokens=n_new, do_sample=False)
    for row, generated in zip(order, out[:, -n_new:]):
        assert tokenizer.decode(generated) == " ".join(words[i] for i in row[3:])


def test_needle_export_retrieves(needle_export):
    """The needle's value comes back at every depth, through batched greedy generation."""
    task, symbols, record = read_task(needle_export)
    assert record["training"]["accuracy"][str(task.seq_len)] >= 0.95
    llama = load(needle_export)
    tokenizer = AutoTokenizer.from_pretrained(needle_export)
    data = task.held_out(64, torch.Generator().manual_seed(9))  # fresh examples at every depth
    prompts = [symbols.decode(row) for row in data.inputs.tolist()]
    batch = tokenizer(prompts, return_tensors="pt")
    out = llama.generate(**batch, max_new_tokens=1, do_sample=False)
    answers = [symbols.tokens[int(t)] for t in data.targets[:, -1]]
    right = sum(tokenizer.decode(new) == want for new, want in zip(out[:, -1:], answers))
    assert right / len(answers) >= 0.95
    assert all(a in symbols.roles["values"] for a in answers)
