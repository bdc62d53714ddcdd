"""O(N) memory: a tiny random Llama profiled at 32,768 tokens with every meter.

Eager ``output_attentions=True`` would hold L x H x N^2 float32 weights: 2 x 2 x 32768^2
x 4 bytes = 16 GiB for this model. attnkit keeps O(N) state per head; the whole process
(Python, torch, transformers, the model, activations) must stay under 3 GiB of peak RSS,
read in a fresh subprocess."""

import pytest

from attnkit.bench import peak_rss_growth

N = 32768
# One thread: the result is about memory, and a single thread keeps the run time steady
# on a shared machine (two contending OpenMP threads can make it ten times longer).
SETUP = f"""
torch.set_num_threads(1)
import transformers as T
import attnkit as ak
config = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, max_position_embeddings={N})
model = T.LlamaForCausalLM(config).eval()
ids = torch.randint(0, 64, (1, {N}))
"""
BODY = """
profile = ak.inspect(model, ids, meters=["sink", "entropy", "distance", "logits", "topkeys", "spans"],
                     spans={"early": (0, 4096), "late": (28000, 32768)})
assert profile.meta["tokens"] == %d and profile.heads == [(0, 0), (0, 1), (1, 0), (1, 1)], profile
assert profile.arrays["top_keys"][(1, 1)]["index"].shape == (1, %d, 8)
""" % (N, N)  # noqa: UP031 (a script template)


@pytest.mark.slow
def test_32k_tokens_every_meter_under_3_gib():
    result = peak_rss_growth(SETUP, BODY, timeout=600)
    assert "error" not in result, result
    assert result["peak_mb"] < 3 * 1024, f"peak RSS {result['peak_mb']:.0f} MB"
