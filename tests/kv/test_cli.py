"""``attnkit kv``: both continuations and the bytes held, as text or JSON; every bad
value an error naming its option (exit 2), found before the model loads."""

import json

import pytest
import torch
import transformers as T

from attnkit.cli import main


def test_json_output_matches_generate(needle_export, capsys):
    assert main(["kv", needle_export, "--policy", "snapkv", "--budget", "0.5", "--param", "window=4",
                 "--max-new-tokens", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    tok = T.AutoTokenizer.from_pretrained(needle_export)
    model = T.AutoModelForCausalLM.from_pretrained(needle_export).eval()
    task = json.loads(open(f"{needle_export}/task.json").read())
    ids = tok([task["example"]["text"]], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        full = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)[:, ids.shape[1]:]
    assert out["full"] == full.tolist()
    assert out["policy"].startswith("snapkv(window=4")
    # n prompt tokens -> n // 2 kept, + 2 decoded, per KV head, 2 layers, keys and values, float32
    n = ids.shape[1]
    heads, dim = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    assert out["policy_bytes"] == 2 * 2 * heads * (n // 2 + 2) * dim * 4
    assert out["full_bytes"] == 2 * 2 * heads * (n + 2) * dim * 4


def test_text_output(needle_export, capsys):
    assert main(["kv", needle_export, "--policy", "streaming", "--budget", "8", "--max-new-tokens", "2"]) == 0
    text = capsys.readouterr().out
    assert "streaming(sinks=4" in text and "keys+values held" in text


@pytest.mark.parametrize("argv,option", [
    (["--policy", "snapkv", "--budget", "1.5"], "--budget"),
    (["--policy", "snapkv", "--budget", "half"], "--budget"),
    (["--policy", "snapkv", "--param", "window=0"], "--param window"),
    (["--policy", "snapkv", "--param", "sinks=2"], "--param sinks"),
    (["--policy", "snapkv", "--param", "window"], "--param"),
    (["--policy", "lru"], "--policy"),
    (["--policy", "snapkv", "--max-new-tokens", "0"], "--max-new-tokens"),
])
def test_bad_options(argv, option, capsys, tmp_path):
    assert main(["kv", str(tmp_path / "missing"), *argv]) == 2
    assert f"error: {option}: " in capsys.readouterr().err


def test_missing_model(capsys, tmp_path):
    assert main(["kv", str(tmp_path / "missing"), "--policy", "knorm"]) == 2
    assert "no such directory" in capsys.readouterr().err
