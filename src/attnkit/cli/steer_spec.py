"""``attnkit probe NAME --steer SPEC``: interventions written on the command line, and the
probe run with and without them, merged into one result with a ``steered`` column.

A SPEC is ``KIND:key=value:key=value``:

- ``emphasize:span=NAME:alpha=0.01:heads=H`` — PASTA (arXiv 2311.02262) on the span the
  probe itself measures under that name (``needle`` for the needle, kv-retrieval,
  interference and ruler probes): its token ranges are read, per prompt, from the probe's
  span meter while the probe runs, so the emphasis follows every prompt the probe builds;
- ``ablate:heads=H`` (outputs zeroed), ``scale:heads=H:factor=X``,
  ``temperature:heads=H:t=X``, ``disperse:heads=H:strength=X``.

``heads`` (default ``all``): ``all``; ``layer.head`` pairs (``0.1,1.0``); ``topK-SCORE``
(the K best heads of a score of ``attnkit probe heads`` — retrieval, induction,
previous_token, duplicate_token, sink — computed on the fly on the same model; ``topK``
alone means retrieval); ``topK-SCORE@results.json`` (read from a saved run of the heads
probe); or the path of a head-set file (``probes.heads.save_head_set``).
"""

from __future__ import annotations

import os
import re
import time
import weakref
from collections.abc import Sequence

SCORE_NAMES = ("retrieval", "induction", "previous_token", "duplicate_token", "sink")
HEADS_HELP = (
    "all, layer.head pairs (0.1,1.0), topK-SCORE (computed on the fly), topK-SCORE@results.json of attnkit "
    "probe heads, or a head-set file"
)


def parse_spec(text: str) -> tuple[str, dict[str, str]]:
    """``"ablate:heads=top5-retrieval"`` -> ("ablate", {"heads": "top5-retrieval"}); the
    kinds and their keys are those of ``steer.registry``; errors name --steer."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("--steer: expected KIND:key=value:..., e.g. ablate:heads=top5-retrieval")
    kinds = _registry()
    kind, *parts = text.strip().split(":")
    if kind not in kinds:
        raise ValueError(f"--steer: unknown intervention {kind!r} in {text!r}; expected one of {', '.join(kinds)}")
    entry = kinds[kind]
    params: dict[str, str] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or not key or not value.strip():
            raise ValueError(f"--steer: expected key=value after {kind}:, got {part!r} in {text!r}")
        if key not in entry.keys:
            raise ValueError(f"--steer: {kind} takes {', '.join(entry.keys)}; got {key!r} in {text!r}")
        if key in params:
            raise ValueError(f"--steer: {key} given twice in {text!r}")
        params[key] = value.strip()
    for key in entry.required:
        if key not in params:
            example = f", e.g. {entry.example}" if entry.example else ""
            raise ValueError(f"--steer: {kind} needs {key}=...{example}; got {text!r}")
    return kind, params


def _registry():
    """The registered interventions (``steer.registry``), the probe-span emphasis included."""
    from ..steer.registry import INTERVENTIONS, number, register_intervention, text

    if "emphasize" not in INTERVENTIONS:  # the command line's PASTA: on a span the running probe measures
        register_intervention(
            "emphasize",
            lambda heads, span, alpha: probe_span_emphasis(span, heads, alpha),
            params={"span": text, "alpha": number},
            required=("span",),
            defaults={"alpha": "0.01"},
            example="emphasize:span=needle:alpha=0.01:heads=top8",
        )
    return INTERVENTIONS


def _arguments(entry, params: dict[str, str], spec: str) -> dict:
    """The builder's keywords from a spec's text values (defaults filled in)."""
    out = {}
    for key, parse in entry.params.items():
        value = params.get(key, entry.defaults.get(key))
        if value is None:
            continue
        try:
            out[key] = parse(value)
        except ValueError as e:
            raise ValueError(f"--steer: {key}={value!r} {e} in {spec!r}") from None
    return out


class HeadScores:
    """Scores of ``attnkit probe heads`` for one model, computed at most once per score."""

    def __init__(self, pm, progress=None):
        self.pm, self.progress, self._results = pm, progress, {}

    def top(self, score: str, k: int, path: str | None, spec: str) -> list[list[int]]:
        from ..probes.heads import heads, top_heads
        from ..probes.result import ProbeResult

        if path is not None:
            if not os.path.isfile(path):
                raise ValueError(f"--steer: heads=...@{path}: no such file (expected results.json of attnkit probe heads)")
            try:
                result = ProbeResult.from_json(path)
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"--steer: heads=...@{path} is not a results.json of attnkit probe heads ({e})") from None
        else:
            if score not in self._results:
                self._results[score] = heads(self.pm, None, scores=[score], top=1, progress=self.progress)
            result = self._results[score]
        try:
            return top_heads(result, score, k)
        except ValueError as e:
            raise ValueError(f"--steer: {e} in {spec!r}") from None


def resolve_heads_value(value: str, scores: HeadScores, spec: str):
    """What ``heads=`` names, in a form ``steer.resolve_heads`` takes."""
    if value == "all":
        return "all"
    m = re.fullmatch(r"top(\d+)(?:-([A-Za-z_-]+))?(?:@(.+))?", value)
    if m:
        k = int(m.group(1))
        if k < 1:
            raise ValueError(f"--steer: heads={value}: K must be >= 1 in {spec!r}")
        score = (m.group(2) or "retrieval").replace("-", "_")
        if score not in SCORE_NAMES:
            raise ValueError(f"--steer: heads={value}: unknown score {score!r}; expected one of {', '.join(SCORE_NAMES)}")
        return [tuple(pair) for pair in scores.top(score, k, m.group(3), spec)]
    if re.fullmatch(r"\d+\.\d+(,\d+\.\d+)*", value):
        return [tuple(int(x) for x in pair.split(".")) for pair in value.split(",")]
    if os.path.isfile(value):
        return value  # a head-set file: steer.resolve_heads reads and checks it
    raise ValueError(f"--steer: heads={value!r} is not {HEADS_HELP}")


def probe_span_emphasis(span: str, heads, alpha: float):
    """PASTA on the span the running probe measures as ``span`` (see the module docstring)."""
    from ..steer.emphasize import Emphasize

    class ProbeSpanEmphasis(Emphasize):
        def __init__(self):
            super().__init__([(0, 1)], heads, alpha)  # placeholder ranges: the probe's meter gives the real ones
            self.span = span

        def prepare(self, model):
            self._model = weakref.ref(model)

        def spans_for(self, batch: int, k_len: int):
            from ..hf.switch import active_switch
            from ..probes.meters import RowSpanMass

            switch = active_switch(self._model())[0]
            meters = [o for o in (switch.observers or []) if isinstance(o, RowSpanMass)] if switch else []
            names = [n for m in meters for n in m.spans]
            rows: list[list[tuple[int, int]]] = [[] for _ in range(batch)]
            for meter in meters:
                for name, ranges in meter.spans.items():
                    if name == span or name.startswith(span + "#") or (name.startswith(span) and name[len(span) :].isdigit()):
                        if len(ranges) != batch:
                            raise ValueError(
                                f"--steer: span {span!r} is measured for {len(ranges)} prompts, the call has {batch}"
                            )
                        for b, r in enumerate(ranges):
                            rows[b].append(r)
            if not all(rows):
                raise ValueError(
                    f"--steer: span={span}: this probe measures no span of that name "
                    f"(it measures: {', '.join(sorted(set(names))) or 'none'})"
                )
            for b, ranges in enumerate(rows):
                for start, end in ranges:
                    if end > k_len:
                        raise ValueError(f"--steer: span {span!r} ({start}, {end}) of prompt row {b} lies past the {k_len} keys")
            return rows

        def __repr__(self):
            return f"emphasize(span={self.span!r}, {self.heads_spec!r}, alpha={self.alpha:g})"

    return ProbeSpanEmphasis()


def build_interventions(specs: Sequence[str], pm, progress=None) -> list:
    """The interventions of ``specs``, checked against ``pm.model`` (errors name --steer)."""
    from ..steer.targets import model_shape, resolve_heads

    scores = HeadScores(pm, progress)
    out = []
    for text in specs:
        kind, params = parse_spec(text)
        heads = resolve_heads_value(params.get("heads", "all"), scores, text)
        entry = _registry()[kind]
        arguments = _arguments(entry, params, text)
        try:
            resolve_heads(heads, *model_shape(pm.model))
            iv = entry.build(heads, **arguments)
        except ValueError as e:
            message = str(e)
            raise ValueError(message if message.startswith("--steer") else f"--steer: {message} (in {text!r})") from None
        out.append(iv)
    return out


def run_with_and_without(function, pm, specs: Sequence[str], call_kwargs: dict):
    """The probe's result without and with the interventions of ``specs``, in one
    ``ProbeResult`` whose ``steered`` column is "none" or the specs joined by " + "."""
    from ..probes.result import ProbeResult
    from ..steer import apply

    started = time.perf_counter()
    interventions = build_interventions(specs, pm, call_kwargs.get("progress"))  # every check before the runs
    plain = function(pm, None, **call_kwargs)
    with apply(pm.model, *interventions) as steering:
        steered = function(pm, None, **call_kwargs)
    label = " + ".join(specs)
    merged = ProbeResult(plain.probe, [], dict(plain.meta))
    merged.extend(plain, steered="none")
    merged.extend(steered, steered=label)
    merged.meta["steer"] = {
        "specs": list(specs),
        "interventions": [repr(iv) for iv in steering.interventions],
        "heads": [{str(layer): list(h) for layer, h in iv.heads.items()} for iv in steering.interventions],
        "steered_meta": {k: v for k, v in steered.meta.items() if k not in ("figures", "params")},
    }
    merged.meta["seconds"] = time.perf_counter() - started
    return merged
