"""Attention measured inside a model: ``attnkit.inspect(model, inputs)`` -> AttentionProfile.

model, tok = attnkit.hf.load_default_model()
profile = attnkit.inspect(model, "Some text.", tokenizer=tok)
profile.to_csv("profile.csv")              # layer, head, metric, value
profile.classify()[(0, 3)].label           # sink, previous-token, local, ...
attnkit.report.write_report(profile, "out/")
"""

from .compare import ProfileComparison, compare, kl_divergence
from .loading import load_local_model, sample_text
from .profile import AttentionProfile
from .run import TOKEN_VIEW_LIMIT, inspect

__all__ = [
    "AttentionProfile",
    "ProfileComparison",
    "TOKEN_VIEW_LIMIT",
    "compare",
    "inspect",
    "kl_divergence",
    "load_local_model",
    "sample_text",
]
