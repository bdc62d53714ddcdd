"""A measured profile whose text tries to break out of the page."""

import torch
from inspect_models import llama

import attnkit as ak

# Each would run if the report put tokens into the page unescaped.
HOSTILE = [
    '<script>document.body.setAttribute("data-pwned","1")</script>',
    "<img src=x onerror=\"document.body.setAttribute('data-pwned','2')\">",
    "</script><script>document.body.setAttribute('data-pwned','3')</script>",
    "<!--",
    "&amp;",
]


def hostile_profile(n=40):
    ids = torch.randint(5, 40, (1, n), generator=torch.Generator().manual_seed(0))
    profile = ak.inspect(llama(), ids, spans={"doc": (3, 20)})
    profile.tokens = [HOSTILE[i % len(HOSTILE)] if i % 4 == 1 else f"w{i}" for i in range(n)]
    profile.meta["model"] = '<script>document.body.setAttribute("data-pwned","4")</script>'
    return profile
