"""The report: one self-contained HTML page (inline CSS, JS and SVG; nothing fetched).

Sections: the sink summary, head classes, a layer x head heatmap per metric, distance
profiles, a sortable table of every head, and — for inputs up to 512 tokens — a token
view of chosen heads (hover a token, see where it attends). Text from the input (tokens,
model names, span names) is escaped in HTML and in the embedded JSON, so a prompt
holding ``<script>`` shows as text and never runs.
"""

from __future__ import annotations

import json
from html import escape
from importlib import resources

from ..inspection.profile import AttentionProfile
from ..observe import LABELS, TOKEN_VIEW_LIMIT
from ..observe.distance import parse_bin_label
from .svg import bars, fmt, heatmap

CLASS_COLOURS = {
    "sink": "#d1495b",
    "previous-token": "#edae49",
    "local": "#66a182",
    "span-focused": "#8d5a97",
    "broad": "#00798c",
    "mixed": "#bdbdbd",
}
TABLE_METRICS = (
    "sink.score",
    "sink.first4",
    "sink.pos-1",
    "entropy.norm",
    "entropy.mean",
    "distance.mean",
    "distance.1",
    "logit.max",
    "logit.std",
    "topkeys.top1",
)


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath(f"assets/{name}").read_text(encoding="utf-8")


def _json_for_script(obj) -> str:
    """JSON safe inside <script>: no '<', '>' or '&' can close the element or open a comment."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(ch, esc)
    return text


def is_distance_bin(metric: str) -> bool:
    return metric.startswith("distance.") and metric != "distance.mean"


def heatmap_metrics(profile: AttentionProfile) -> list[str]:
    """Scalar metrics worth a layer x head heatmap (distance bins get their own view)."""
    return [m for m in profile.metrics if not is_distance_bin(m) and not m.endswith(".uniform")]


def _grid(profile: AttentionProfile, metric: str) -> list[list[float]]:
    return profile.table(metric).tolist()


def _n_heads(profile: AttentionProfile) -> int:
    return max(h for _, h in profile.heads) + 1


def choose_token_heads(profile: AttentionProfile, classes: dict, limit: int = 12) -> list[tuple[int, int]]:
    """Heads for the token view: the clearest two of each class, then others, up to ``limit``."""
    available = set(profile.arrays.get("top_keys", {}))

    def strength(key):
        c = classes[key]
        return max((abs(v) for v in c.evidence.values()), default=0.0)

    chosen = []
    for label in LABELS:
        heads = sorted((k for k, c in classes.items() if c.label == label and k in available), key=strength, reverse=True)
        chosen += heads[:2]
    rest = sorted(available - set(chosen))
    return (chosen + rest)[:limit]


def _sink_section(profile: AttentionProfile, classes: dict) -> str:
    eps = profile.meta.get("meters", {}).get("sink", {}).get("epsilon", 0.3)
    parts = []
    if "sink.score" in profile.metrics:
        per_layer, labels = [], []
        for layer in profile.layers:
            head_scores = [
                profile.value(layer, h, "sink.score")
                for (l2, h) in profile.heads
                if l2 == layer and profile.has(layer, h, "sink.score")
            ]
            if head_scores:
                per_layer.append(sum(s > eps for s in head_scores) / len(head_scores))
                labels.append(f"layer {layer}")
        scores = profile.values("sink.score")
        rate = sum(s > eps for s in scores.values()) / len(scores)
        top = sorted(((v, lay, h) for (lay, h), v in scores.items()), reverse=True)[:5]
        parts.append(
            f'<p class="note">Sink heads (sink score &gt; ε = {eps:g}, Gu et al. 2024, arXiv 2410.10781): '
            f"<b>{rate:.1%}</b> of {len(scores)} heads. Strongest: "
            + ", ".join(f"L{lay} H{h} ({v:.2f})" for v, lay, h in top)
            + ".</p>"
        )
        parts.append(
            '<div class="grid"><div class="figure">' + bars(per_layer, labels, "fraction of sink heads per layer") + "</div>"
        )
    else:
        parts.append('<p class="note">The sink meter did not run.</p><div class="grid">')
    counts = [sum(1 for c in classes.values() if c.label == label) for label in LABELS]
    parts.append('<div class="figure">' + bars(counts, list(LABELS), "heads per class", hi=max(counts + [1])) + "</div></div>")
    return "".join(parts)


def _class_grid(profile: AttentionProfile, classes: dict) -> str:
    n_heads = _n_heads(profile)
    cw, ch, left, top = 26, 18, 60, 34
    layers = profile.layers
    width, height = left + cw * n_heads + 8, top + ch * len(layers) + 8
    out = [
        f'<svg class="heatmap classes" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" aria-label="head classes">',
        f'<text x="{left}" y="12" class="svg-title">head classes</text>',
    ]
    for h in range(n_heads):
        out.append(f'<text x="{left + h * cw + cw / 2}" y="{top - 6}" text-anchor="middle" class="axis">{h}</text>')
    for r, layer in enumerate(layers):
        out.append(f'<text x="{left - 4}" y="{top + r * ch + ch * 0.7}" text-anchor="end" class="axis">layer {layer}</text>')
        for h in range(n_heads):
            c = classes.get((layer, h))
            fill = CLASS_COLOURS[c.label] if c else "#eeeeee"
            tip = f"layer {layer}, head {h}: " + (", ".join(c.labels) if c else "not measured")
            out.append(
                f'<rect x="{left + h * cw}" y="{top + r * ch}" width="{cw - 1}" height="{ch - 1}" fill="{fill}"><title>{escape(tip)}</title></rect>'
            )
    out.append("</svg>")
    legend = "".join(f'<span><i style="background:{CLASS_COLOURS[label]}"></i>{escape(label)}</span>' for label in LABELS)
    return '<div class="figure">' + "".join(out) + f'<div class="legend">{legend}</div></div>'


def _distance_section(profile: AttentionProfile) -> str:
    bins = [m for m in profile.metrics if is_distance_bin(m)]
    if not bins:
        return '<p class="note">The distance meter did not run.</p>'
    bins.sort(key=lambda m: parse_bin_label(m[len("distance.") :])[0])
    labels = [m[len("distance.") :] for m in bins]
    figs = []
    for layer in profile.layers:
        heads = sorted(h for (lay, h) in profile.heads if lay == layer and profile.has(layer, h, bins[0]))
        if not heads:
            continue
        grid = [[profile.value(layer, h, b) for b in bins] for h in heads]
        figs.append(
            '<div class="figure">'
            + heatmap(
                grid, [f"head {h}" for h in heads], labels, f"layer {layer}: mass by |i − j|", lo=0.0, hi=1.0, cell=(30, 16)
            )
            + "</div>"
        )
    return '<div class="grid">' + "".join(figs) + "</div>"


def _heads_table(profile: AttentionProfile, classes: dict) -> str:
    spans = [m for m in profile.metrics if m.startswith("span.") and not m.endswith(".uniform")]
    cols = [m for m in TABLE_METRICS if m in profile.metrics] + spans
    head = '<th data-type="number">layer</th><th data-type="number">head</th><th data-type="text">class</th>' + "".join(
        f'<th data-type="number">{escape(m)}</th>' for m in cols
    )
    body = []
    for layer, h in profile.heads:
        c = classes.get((layer, h))
        label = ", ".join(c.labels) if c else ""
        cells = [
            f'<td data-v="{layer}">{layer}</td>',
            f'<td data-v="{h}">{h}</td>',
            f'<td class="label" data-v="{escape(label)}">{escape(label)}</td>',
        ]
        for m in cols:
            if profile.has(layer, h, m):
                v = profile.value(layer, h, m)
                cells.append(f'<td data-v="{v!r}">{escape(fmt(v))}</td>')
            else:
                cells.append('<td data-v="">–</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (
        f'<div class="table-wrap"><table class="heads sortable"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )


def _token_data(profile: AttentionProfile, heads: list[tuple[int, int]], classes: dict) -> dict:
    top = profile.arrays["top_keys"]
    out = []
    for layer, h in heads:
        d = top[(layer, h)]
        index, weight = d["index"], d["weight"]
        if index.dim() == 3:  # (B, R, k): the token view shows batch row 0
            index, weight = index[0], weight[0]
        out.append(
            {
                "layer": layer,
                "head": h,
                "label": classes[(layer, h)].label if (layer, h) in classes else "",
                "q_start": int(d["q_start"]),
                "index": index.tolist(),
                "weight": [[round(float(x), 4) for x in row] for row in weight.tolist()],
            }
        )
    return {"tokens": profile.tokens, "heads": out}


def render_html(profile: AttentionProfile, *, token_heads=None, title: str | None = None) -> str:
    """The report page as a string."""
    if not isinstance(profile, AttentionProfile):
        raise ValueError(f"profile: expected an AttentionProfile, got {type(profile).__name__}")
    classes = profile.classify()
    meta = profile.meta
    n_tokens = meta.get("tokens", len(profile.tokens or []))
    title = title or f"attnkit inspect — {meta.get('model', 'model')}"
    meta_line = (
        f"{meta.get('model', '?')} ({meta.get('model_type', '?')}) · {n_tokens} tokens"
        + (f" (truncated from {meta['truncated_from']})" if meta.get("truncated_from") else "")
        + f" · {len(profile.layers)} layers × {_n_heads(profile)} heads · mechanism {meta.get('mechanism', 'softmax')}"
        + (f" · measured in {meta['seconds']:.2f} s" if isinstance(meta.get("seconds"), (int, float)) else "")
    )
    n_heads = _n_heads(profile)
    heat = []
    for metric in heatmap_metrics(profile):
        grid = _grid(profile, metric)
        rows = [grid[layer] for layer in profile.layers]
        heat.append(
            '<div class="figure">'
            + heatmap(
                rows,
                [f"layer {lay}" for lay in profile.layers],
                [str(h) for h in range(n_heads)],
                metric,
                tooltip=lambda r, c, v, m=metric: f"layer {profile.layers[r]}, head {c}: {m} = {fmt(v)}",
            )
            + "</div>"
        )
    sections = [
        (
            "summary",
            "Sinks and head classes",
            _sink_section(profile, classes) + '<div class="grid">' + _class_grid(profile, classes) + "</div>",
        ),
        (
            "heatmaps",
            "Metrics by layer and head",
            '<p class="note">Hover a cell for its value. Means over every query row measured; see docs/inspect.md for each metric.</p>'
            + '<div class="grid">'
            + "".join(heat)
            + "</div>",
        ),
        (
            "distance",
            "Distance profiles",
            '<p class="note">Mean attention mass a query puts on keys at each distance |i − j| (log-spaced bins).</p>'
            + _distance_section(profile),
        ),
        ("heads", "All heads", '<p class="note">Click a column to sort.</p>' + _heads_table(profile, classes)),
    ]
    data_script = ""
    tokens = profile.tokens
    if tokens and len(tokens) <= TOKEN_VIEW_LIMIT and profile.arrays.get("top_keys"):
        heads = choose_token_heads(profile, classes) if token_heads is None else [tuple(x) for x in token_heads]
        missing = [x for x in heads if x not in profile.arrays["top_keys"]]
        if missing:
            raise ValueError(
                f"token_heads: {missing} have no top keys in this profile (measured: {sorted(profile.arrays['top_keys'])[:8]}...)"
            )
        data_script = (
            f'<script type="application/json" id="attnkit-data">{_json_for_script(_token_data(profile, heads, classes))}</script>'
        )
        sections.append(
            (
                "tokens",
                "Token view",
                '<p class="note">Pick a head, then hover (or tab to) a token: its top keys light up.</p>'
                '<div id="token-view"><div class="controls"><label>head <select></select></label></div>'
                '<div class="tokens"></div><div class="info"></div></div>',
            )
        )
    elif tokens and len(tokens) > TOKEN_VIEW_LIMIT:
        sections.append(
            (
                "tokens",
                "Token view",
                f'<p class="note">The token view is drawn for inputs up to {TOKEN_VIEW_LIMIT} tokens; this one has {len(tokens)}.</p>',
            )
        )
    nav = "".join(f'<a href="#{sid}">{escape(name)}</a>' for sid, name, _ in sections)
    body = "".join(f'<section id="{sid}"><h2>{escape(name)}</h2>{content}</section>' for sid, name, content in sections)
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{_asset('report.css')}</style></head><body>"
        f'<header><h1>{escape(title)}</h1><p class="meta">{escape(meta_line)}</p></header>'
        f"<nav>{nav}</nav><main>{body}</main>{data_script}<script>{_asset('report.js')}</script></body></html>"
    )
