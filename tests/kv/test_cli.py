"""``attnkit kv``: both continuations and the bytes held, as text or JSON; every bad
value an error naming its option (exit 2), found before the model loads."""

import json

import pytest
import torch
import transformers as T

from attnkit.cli import main


def test_json_output_matches_generate(needle_export, capsys):
    assert (
        main(
            [
                "kv",
                needle_export,
                "--policy",
                "snapkv",
                "--budget",
                "0.5",
                "--param",
                "window=4",
                "--max-new-tokens",
                "3",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    tok = T.AutoTokenizer.from_pretrained(needle_export)
    model = T.AutoModelForCausalLM.from_pretrained(needle_export).eval()
    task = json.loads(open(f"{needle_export}/task.json").read())
    ids = tok([task["example"]["text"]], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        full = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)[:, ids.shape[1] :]
    assert out["full"] == full.tolist()
    assert out["policy"].startswith("snapkv(window=4")
    # n prompt tokens -> n // 2 kept, + 2 decoded, per KV head, 2 layers, keys and values, float32
    n = ids.shape[1]
    heads, dim = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    assert out["policy_bytes"] == 2 * 2 * heads * (n // 2 + 2) * dim * 4
    assert out["full_bytes"] == 2 * 2 * heads * (n + 2) * dim * 4


def test_text_output(needle_export, capsys):
    assert main(["kv", needle_export, "--policy", "streaming", "--tokens", "8", "--max-new-tokens", "2"]) == 0
    text = capsys.readouterr().out
    assert "streaming(sinks=4" in text and "keys+values held" in text


@pytest.mark.parametrize(
    "argv,option",
    [
        (["--policy", "snapkv", "--budget", "1.5"], "--budget"),
        (["--policy", "snapkv", "--budget", "half"], "--budget"),
        (["--policy", "snapkv", "--param", "window=0"], "--param window"),
        (["--policy", "snapkv", "--param", "sinks=2"], "--param sinks"),
        (["--policy", "snapkv", "--param", "window"], "--param"),
        (["--policy", "lru"], "--policy"),
        # a count goes to --tokens: --budget is a fraction, and 8 there is refused, not read as 8 tokens
        (["--policy", "snapkv", "--budget", "8"], "--budget"),
        (["--policy", "snapkv", "--budget", "0"], "--budget"),
        (["--policy", "snapkv", "--tokens", "0.5"], "--tokens"),
        (["--policy", "snapkv", "--tokens", "0"], "--tokens"),
        (["--policy", "snapkv", "--budget", "0.5", "--tokens", "8"], "--tokens"),
        # selective needs a model trained with selective attention, switched by attnkit.hf.use: not offered
        (["--policy", "selective"], "--policy"),
        (["--policy", "snapkv", "--max-new-tokens", "0"], "--max-new-tokens"),
    ],
)
def test_bad_options(argv, option, capsys, tmp_path):
    assert main(["kv", str(tmp_path / "missing"), *argv]) == 2
    assert f"error: {option}: " in capsys.readouterr().err


def test_missing_model(capsys, tmp_path):
    assert main(["kv", str(tmp_path / "missing"), "--policy", "knorm"]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_a_count_in_budget_names_tokens(capsys, tmp_path):
    assert main(["kv", str(tmp_path / "missing"), "--policy", "snapkv", "--budget", "64"]) == 2
    assert (
        "--budget: expected a fraction of the prompt in (0, 1], got '64'; for a count of tokens use --tokens 64"
        in capsys.readouterr().err
    )


def test_budget_one_is_the_whole_prompt(needle_export, capsys):
    """--budget 1 is the fraction 1 (everything kept, as the help says), not one token."""
    assert (
        main(
            ["kv", needle_export, "--policy", "snapkv", "--budget", "1", "--param", "window=4", "--max-new-tokens", "3", "--json"]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    tok = T.AutoTokenizer.from_pretrained(needle_export)
    n = len(tok(json.loads(open(f"{needle_export}/task.json").read())["example"]["text"])["input_ids"])
    assert out["pruned"] == out["full"] and out["kept"] == [n + 2, n + 2]  # every prompt entry, + 2 decoded
    assert (
        main(
            ["kv", needle_export, "--policy", "snapkv", "--tokens", "1", "--param", "window=4", "--max-new-tokens", "3", "--json"]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["kept"] == [1 + 2, 1 + 2]  # one prompt entry


def test_an_encoder_is_refused(capsys, tmp_path):
    """An encoder directory would load as a causal LM with a randomly initialised head and
    generate noise: refused, as attnkit probe and rerank refuse it."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "inspect"))
    from inspect_models import bert, saved, tokenizer

    encoder = saved(bert(positions=64), tokenizer(tmp_path), tmp_path / "bert")
    assert main(["kv", encoder, "--policy", "knorm", "--prompt", "the code"]) == 2
    err = capsys.readouterr().err
    assert "MODEL: " in err and "needs a causal language model" in err and "is an encoder" in err
