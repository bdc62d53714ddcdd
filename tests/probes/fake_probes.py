"""Two small probes that follow the probe conventions, for the CLI's and the report's
tests: they echo every keyword they receive into ``meta["params"]`` (so a test can
check exactly what an option became) and measure something simple of the model."""

from __future__ import annotations

import time

from attnkit.probes import ProbeResult, as_probe_model


def fake(
    model=None,
    tokenizer=None,
    *,
    lengths=(4, 8),
    depths=(0.0, 1.0),
    samples: int = 1,
    seed: int = 0,
    progress=None,
    pooling: str = "mean",
    top: int | None = None,
    exact: bool = False,
    haystack=None,
    tasks: list[str] | None = None,
    scale=None,
) -> ProbeResult:
    """A probe for tests.

    ``lengths``: prompt lengths in tokens; ``depths``: fractions 0..1;
    ``pooling``: mean, cls or last."""
    start = time.perf_counter()
    pm = as_probe_model(model, tokenizer)
    lengths = [lengths] if isinstance(lengths, int) else list(lengths)
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"lengths: expected ints >= 1, got {lengths!r}")
    if pooling not in ("mean", "cls", "last"):
        raise ValueError(f"pooling: expected mean, cls or last, got {pooling!r}")
    for n in lengths:
        pm.check_length(n)
    params = {
        "lengths": lengths,
        "depths": list(depths),
        "samples": samples,
        "seed": seed,
        "pooling": pooling,
        "top": top,
        "exact": exact,
        "haystack": haystack,
        "tasks": tasks,
        "scale": scale,
    }
    result = ProbeResult("fake")
    for n in lengths:
        for d in depths:
            if progress is not None:
                progress(f"length={n} depth={d}")
            for s in range(samples):
                result.add("score", (n * (1 + d) + s) / 100.0, length=n, depth=d, sample=s)
    result.add("layers", pm.layers)
    result.meta = {
        "model": pm.name,
        "params": params,
        "seconds": time.perf_counter() - start,
        "kind": pm.kind,
        "figures": [
            {"kind": "heatmap", "rows": "depth", "cols": "length", "metric": "score", "title": "score"},
            {"kind": "curve", "x": "length", "metric": "score", "series": "depth", "title": "score by length"},
        ],
    }
    return result


def fake_causal(model=None, tokenizer=None, *, lengths=(4,), seed: int = 0, progress=None) -> ProbeResult:
    """A probe that needs a causal LM."""
    pm = as_probe_model(model, tokenizer)
    pm.require("causal", "fake-causal")
    result = ProbeResult("fake-causal")
    result.add("layers", pm.layers)
    result.meta = {"model": pm.name, "params": {"lengths": list(lengths), "seed": seed}, "seconds": 0.0, "figures": []}
    return result
