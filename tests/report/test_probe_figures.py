"""The probe report's figures read at a glance (issue 27, item 6): heatmaps of readable
cells with axis titles and values; curves with axis titles, panels per value of a column,
a band of ± one standard error over a spread column and a dashed reference; grouped bars
with error bars and dots; the examples as a table, failures first. Every number checked
here is computed again from the rows (statistics.stdev / sqrt(n)), and the SVG is read as
XML, its pixels mapped back to values through the gridlines' data-v."""

import math
import re
import statistics
import warnings
import xml.etree.ElementTree as ET
from html import unescape

import pytest
from test_chromium import chromium, console_lines

from attnkit.probes import ProbeResult
from attnkit.report.probe import MAX_EXAMPLES, render_probe_html, write_probe_report
from attnkit.report.svg import fmt

NS = "{http://www.w3.org/2000/svg}"
POLICIES, BUDGETS, DEPTHS, SAMPLES = ("h2o", "snapkv"), (0.1, 0.5), (0.0, 0.5, 1.0), 4
ABLATIONS, DRAWS = ("none", "top2-retrieval", "random2"), 5


def em(policy, budget, depth, sample):
    """A deterministic 0/1 answer per prompt, varying with every column."""
    return float((sample * 7 + int(budget * 10) * 3 + int(depth * 2) + len(policy)) % 3 != 0)


def full_em(depth, sample):
    return float((sample + int(depth * 2)) % 4 != 0)


def curves_result() -> ProbeResult:
    r = ProbeResult("kv-curves")
    for d in DEPTHS:
        for s in range(SAMPLES):
            r.add("exact_match", full_em(d, s), policy="full", budget=1.0, depth=d, sample=s)
    for p in POLICIES:
        for b in BUDGETS:
            for d in DEPTHS:
                for s in range(SAMPLES):
                    r.add("exact_match", em(p, b, d, s), policy=p, budget=b, depth=d, sample=s)
    return r


def acc(ablation, draw, task):
    base = {"none": 0.9 - 0.02 * draw, "top2-retrieval": 0.3 + 0.05 * (draw % 2), "random2": 0.6 + 0.07 * draw}[ablation]
    return base - (0.1 if task == "b" else 0.0)


def ablation_result(series=True) -> ProbeResult:
    r = ProbeResult("heads")
    for a in ABLATIONS:
        for draw in range(DRAWS if a == "random2" else 3):
            for task in ("a", "b") if series else ("a",):
                r.add("accuracy", acc(a, draw, task), ablation=a, draw=draw, task=task)
    return r


def render(result, *specs, **meta) -> str:
    result.meta = {"model": "m", **meta, "figures": list(specs)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every spec here must draw
        return render_probe_html(result)


def svgs(page, cls) -> list:
    return [ET.fromstring(s) for s in re.findall(rf'<svg class="{cls}".*?</svg>', page, re.S)]


def panel_titles(page) -> list[str]:
    return [unescape(t) for t in re.findall(r'<div class="panel-title">(.*?)</div>', page)]


def texts(svg, cls=None) -> list[str]:
    return ["".join(t.itertext()) for t in svg.iter(NS + "text") if cls is None or cls in (t.get("class") or "").split()]


def titles(svg, tag, cls=None) -> list[str]:
    return [
        e.find(NS + "title").text
        for e in svg.iter(NS + tag)
        if (cls is None or e.get("class") == cls) and e.find(NS + "title") is not None
    ]


def y_scale(svg):
    """value -> pixel row, from the gridlines (each carries its value)."""
    grid = [(float(g.get("data-v")), float(g.get("y1"))) for g in svg.iter(NS + "line") if g.get("class") == "grid"]
    (v0, y0), (v1, y1) = grid[0], grid[-1]
    return lambda v: y0 + (v - v0) * (y1 - y0) / (v1 - v0), abs((y1 - y0) / (v1 - v0))


def se(values):
    return statistics.stdev(values) / math.sqrt(len(values))


# -- heatmaps -----------------------------------------------------------------------------------


def grid(cols=4, rows=3) -> ProbeResult:
    r = ProbeResult("needle")
    for i in range(rows):
        for j in range(cols):
            for s in range(2):
                r.add("accuracy", ((i + j + s) % 5) / 4, depth=i / 2, length=256 * (j + 1), sample=s)
    return r


def cells(svg):
    return [e for e in svg.iter(NS + "rect") if e.find(NS + "title") is not None]


def test_heatmap_cells_are_large_with_axis_titles_values_and_hover():
    page = render(grid(), {"kind": "heatmap", "rows": "depth", "cols": "length", "metric": "accuracy"})
    (svg,) = svgs(page, "heatmap")
    rects = cells(svg)
    assert len(rects) == 12
    xs = sorted({float(e.get("x")) for e in rects})
    ys = sorted({float(e.get("y")) for e in rects})
    assert min(b - a for a, b in zip(xs, xs[1:])) >= 36 and min(b - a for a, b in zip(ys, ys[1:])) >= 24
    assert all(float(e.get("width")) >= 35 and float(e.get("height")) >= 23 for e in rects)
    # axis titles default to the parameters' names
    assert texts(svg, "x-title") == ["length"] and texts(svg, "y-title") == ["depth"]
    assert texts(svg, "scale-title") == ["colour: accuracy"]
    # every cell's value on hover, and written inside (4 columns: a small grid), the two equal
    tips = titles(svg, "rect")
    assert len(tips) == 12 and all(re.fullmatch(r"depth \S+, length \d+: accuracy = \S+", t) for t in tips)
    shown = texts(svg, "cell-value")
    assert len(shown) == 12
    for tip, text in zip(tips, shown):
        assert float(text) == pytest.approx(float(tip.rsplit("= ", 1)[1]), abs=0.006)
    # the mean over samples at depth 0.5, length 512: (i + j + s) % 5 / 4 for s = 0, 1
    assert "depth 0.5, length 512: accuracy = 0.625" in tips


def test_heatmap_titles_from_the_spec_values_off_and_wide_grids_scale_down():
    page = render(
        grid(),
        {
            "kind": "heatmap",
            "rows": "depth",
            "cols": "length",
            "metric": "accuracy",
            "x_title": "context length (tokens)",
            "y_title": "needle depth",
            "values": False,
        },
    )
    (svg,) = svgs(page, "heatmap")
    assert texts(svg, "x-title") == ["context length (tokens)"] and texts(svg, "y-title") == ["needle depth"]
    assert texts(svg, "cell-value") == []
    wide = svgs(render(grid(cols=13), {"kind": "heatmap", "rows": "depth", "cols": "length", "metric": "accuracy"}), "heatmap")[0]
    assert texts(wide, "cell-value") == []  # past 12 columns: hover only
    assert min(float(e.get("width")) for e in cells(wide)) >= 35  # 13 columns still fit at full size
    heads = ProbeResult("heads")
    for layer in range(2):
        for head in range(64):
            heads.add("mass", (layer + head) / 100, layer=layer, head=head)
    (huge,) = svgs(render(heads, {"kind": "heatmap", "rows": "layer", "cols": "head", "metric": "mass"}), "heatmap")
    rects = cells(huge)
    xs = sorted({float(e.get("x")) for e in rects})
    assert len(rects) == 128 and xs[-1] - xs[0] <= 1100 and min(float(e.get("height")) for e in rects) >= 23


# -- curves -------------------------------------------------------------------------------------


def test_curve_axis_titles_default_to_the_names_and_follow_the_spec():
    r = curves_result()
    (svg,) = svgs(render(r, {"kind": "curve", "x": "depth", "metric": "exact_match", "series": "policy"}), "curve")
    assert texts(svg, "axis-title") == ["depth", "exact_match"]
    (svg,) = svgs(
        render(
            r,
            {
                "kind": "curve",
                "x": "depth",
                "metric": "exact_match",
                "series": "policy",
                "x_title": "where the needle sits",
                "y_title": "accuracy",
            },
        ),
        "curve",
    )
    assert texts(svg, "axis-title") == ["where the needle sits", "accuracy"]
    assert int(svg.get("width")) >= 560 and int(svg.get("height")) >= 320  # the default size


def test_split_draws_one_panel_per_value_on_one_y_scale():
    r = curves_result()
    for row in r.rows:  # values beyond [0, 1], so the scale is the data's: shared it must still be
        row["value"] = 2 + 3 * row["value"] * (row["budget"] if row["budget"] < 1 else 0.2)
    page = render(
        r,
        {
            "kind": "curve",
            "x": "depth",
            "metric": "exact_match",
            "series": "policy",
            "split": "budget",
            "reference": {"policy": "full"},
            "title": "by depth",
        },
    )
    assert panel_titles(page) == [f"by depth — budget={b:g}" for b in BUDGETS]  # the reference's 1.0 gets no panel
    panels = svgs(page, "curve")
    grids = [[g.get("data-v") for g in svg.iter(NS + "line") if g.get("class") == "grid"] for svg in panels]
    assert grids[0] == grids[1]
    for svg, b in zip(panels, BUDGETS):
        tips = titles(svg, "circle", "point")
        assert len(tips) == len(POLICIES) * len(DEPTHS)
        for p in POLICIES:
            want = statistics.mean(2 + 3 * em(p, b, 0.5, s) * b for s in range(SAMPLES))
            (tip,) = [t for t in tips if t.startswith(f"policy={p}: 0.5 → ")]
            assert float(tip.split("→ ")[1]) == pytest.approx(want, rel=1e-3)


def test_spread_draws_a_band_of_one_standard_error_and_says_it_on_hover():
    r = curves_result()
    page = render(
        r,
        {
            "kind": "curve",
            "x": "depth",
            "metric": "exact_match",
            "series": "policy",
            "spread": "sample",
            "where": {"budget": 0.1},
        },
    )
    (svg,) = svgs(page, "curve")
    y_of, _ = y_scale(svg)
    bands = {b.get("data-series"): b for b in svg.iter(NS + "polygon") if b.get("class") == "band"}
    assert set(bands) == {f"policy={p}" for p in POLICIES}
    for p in POLICIES:
        points = [tuple(map(float, xy.split(","))) for xy in bands[f"policy={p}"].get("points").split()]
        upper, lower = points[: len(DEPTHS)], points[len(DEPTHS) :][::-1]
        tips = [t for t in titles(svg, "circle", "point") if t.startswith(f"policy={p}: ")]
        for d, (_, y_hi), (_, y_lo), tip in zip(DEPTHS, upper, lower, tips):
            values = [em(p, 0.1, d, s) for s in range(SAMPLES)]
            m, e = statistics.mean(values), se(values)
            assert y_hi == pytest.approx(y_of(min(m + e, 1.0)), abs=0.11)  # the scale is [0, 1]: clipped there
            assert y_lo == pytest.approx(y_of(max(m - e, 0.0)), abs=0.11)
            assert tip == f"policy={p}: {d:g} → {fmt(m)} ± {fmt(e)} s.e. (n = {SAMPLES})"


def test_spread_averages_rows_that_share_a_value_first():
    r = curves_result()
    page = render(r, {"kind": "curve", "x": "budget", "metric": "exact_match", "series": "policy", "spread": "sample"})
    (svg,) = svgs(page, "curve")
    tips = titles(svg, "circle", "point")
    for p in POLICIES:
        for b in BUDGETS:
            per_sample = [statistics.mean(em(p, b, d, s) for d in DEPTHS) for s in range(SAMPLES)]
            want = f"policy={p}: {b:g} → {fmt(statistics.mean(per_sample))} ± {fmt(se(per_sample))} s.e. (n = {SAMPLES})"
            assert want in tips


def test_reference_rows_are_a_dashed_horizontal_line_not_a_series():
    r = curves_result()
    page = render(
        r,
        {
            "kind": "curve",
            "x": "budget",
            "metric": "exact_match",
            "series": "policy",
            "spread": "sample",
            "reference": {"policy": "full"},
        },
    )
    (svg,) = svgs(page, "curve")
    y_of, _ = y_scale(svg)
    (ref,) = [e for e in svg.iter(NS + "line") if e.get("class") == "reference"]
    assert ref.get("stroke-dasharray") and ref.get("y1") == ref.get("y2")
    per_sample = [statistics.mean(full_em(d, s) for d in DEPTHS) for s in range(SAMPLES)]
    assert float(ref.get("y1")) == pytest.approx(y_of(statistics.mean(per_sample)), abs=0.11)
    assert ref.find(NS + "title").text == (
        f"policy=full (reference), budget=1: {fmt(statistics.mean(per_sample))} ± {fmt(se(per_sample))} s.e. (n = {SAMPLES})"
    )
    assert "policy=full (reference)" in texts(svg, "legend-entry")
    # not a series: no point, band or legend line of its own, and no x tick at its budget 1.0
    assert not any(t.startswith("policy=full") for t in titles(svg, "circle", "point"))
    assert {b.get("data-series") for b in svg.iter(NS + "polygon")} == {f"policy={p}" for p in POLICIES}
    assert texts(svg, "legend-entry") == [f"policy={p}" for p in POLICIES] + ["policy=full (reference)"]
    x_ticks = [t.text for t in svg.iter(NS + "text") if t.get("class") == "axis" and t.get("text-anchor") == "middle"]
    assert x_ticks == [f"{b:g}" for b in BUDGETS]


def test_a_reference_over_several_x_is_a_dashed_series():
    r = curves_result()
    r.rows = [row for row in r.rows if row["budget"] in (0.5, 1.0)]  # the policies at one budget beside the full cache
    (svg,) = svgs(
        render(r, {"kind": "curve", "x": "depth", "metric": "exact_match", "series": "policy", "reference": {"policy": "full"}}),
        "curve",
    )
    assert svg.find(f"{NS}line[@class='reference']") is None
    (line,) = [e for e in svg.iter(NS + "polyline") if e.get("class") == "reference"]
    assert line.get("stroke-dasharray")
    tips = titles(svg, "circle", "reference-point")
    assert tips == [
        f"policy=full (reference): {d:g} → {fmt(statistics.mean(full_em(d, s) for s in range(SAMPLES)))}" for d in DEPTHS
    ]
    assert len(titles(svg, "circle", "point")) == len(POLICIES) * len(DEPTHS)  # the full cache's rows are no series
    # split by budget, the reference rows (all at budget 1.0) are drawn in each panel
    page = render(
        curves_result(),
        {
            "kind": "curve",
            "x": "depth",
            "metric": "exact_match",
            "series": "policy",
            "split": "budget",
            "reference": {"policy": "full"},
        },
    )
    assert all(len(titles(svg, "circle", "reference-point")) == len(DEPTHS) for svg in svgs(page, "curve"))


def test_the_legend_is_never_clipped():
    r = ProbeResult("p")
    names = [f"policy-{'x' * 40}-{i}" for i in range(3)] + [f"p{i}" for i in range(20)]
    for name in names:
        for x in range(3):
            r.add("m", x / 3, x=x, policy=name)
    for spec_names in (names[:3], names[3:]):  # long names (below the plot), many short ones (on the right)
        rr = ProbeResult("p", [row for row in r.rows if row["policy"] in spec_names])
        (svg,) = svgs(render(rr, {"kind": "curve", "x": "x", "metric": "m", "series": "policy"}), "curve")
        width, height = float(svg.get("width")), float(svg.get("height"))
        entries = [t for t in svg.iter(NS + "text") if "legend-entry" in (t.get("class") or "")]
        assert len(entries) == len(spec_names)
        for t in entries:
            assert float(t.get("y")) <= height - 2
            assert float(t.get("x")) + 6.2 * len(t.text) <= width  # a generous width per character


# -- bars ---------------------------------------------------------------------------------------


def test_bars_are_means_with_error_bars_of_one_standard_error_and_dots():
    r = ablation_result()
    page = render(
        r,
        {
            "kind": "bars",
            "x": "ablation",
            "metric": "accuracy",
            "series": "task",
            "spread": "draw",
            "title": "ablation",
            "y_title": "accuracy (needle)",
        },
    )
    (svg,) = svgs(page, "bars")
    y_of, px_per_unit = y_scale(svg)
    bars = [e for e in svg.iter(NS + "rect") if e.get("class") == "bar"]
    assert len(bars) == len(ABLATIONS) * 2  # categories × series
    assert [b.get("data-category") for b in bars[:3]] == list(ABLATIONS)  # in the rows' order
    errs = list(svg.iter(NS + "g"))
    assert len(errs) == len(bars)
    for bar, err in zip(bars, errs):
        a, task = bar.get("data-category"), bar.get("data-series").split("=")[1]
        values = [acc(a, d, task) for d in range(DRAWS if a == "random2" else 3)]
        m, e = statistics.mean(values), se(values)
        assert float(bar.get("y")) == pytest.approx(y_of(m), abs=0.11)
        stem = err.findall(NS + "line")[0]
        assert abs(float(stem.get("y2")) - float(stem.get("y1"))) == pytest.approx(2 * e * px_per_unit, abs=0.02)
        assert (float(stem.get("y1")) + float(stem.get("y2"))) / 2 == pytest.approx(y_of(m), abs=0.02)
        tip = f"ablation={a}, task={task}: mean {fmt(m)} ± {fmt(e)} s.e. (n = {len(values)})"
        assert bar.find(NS + "title").text == tip and err.find(NS + "title").text == tip
    dots = [d for d in svg.iter(NS + "circle") if d.get("class") == "dot"]
    assert len(dots) == 2 * (3 + DRAWS + 3)  # one per draw
    dot_tips = [d.find(NS + "title").text for d in dots]
    assert f"ablation=random2, task=b, draw=4: {fmt(acc('random2', 4, 'b'))}" in dot_tips
    assert texts(svg, "axis-title") == ["ablation", "accuracy (needle)"]
    assert texts(svg, "legend-entry") == ["task=a", "task=b"]


def test_bars_without_series_or_spread():
    r = ablation_result(series=False)
    (svg,) = svgs(render(r, {"kind": "bars", "x": "ablation", "metric": "accuracy"}), "bars")
    bars = [e for e in svg.iter(NS + "rect") if e.get("class") == "bar"]
    assert len(bars) == len(ABLATIONS) and not list(svg.iter(NS + "g")) and svg.find(f".//{NS}circle") is None
    assert texts(svg, "legend-entry") == []
    want = statistics.mean(acc("random2", d, "a") for d in range(DRAWS))
    assert bars[2].find(NS + "title").text == f"ablation=random2: mean {fmt(want)} ({DRAWS} rows)"


@pytest.mark.parametrize(
    "spec,message",
    [
        ({"kind": "bars", "metric": "accuracy"}, "bars: &#x27;x&#x27; must name a parameter"),
        ({"kind": "bars", "x": "ablation", "metric": ["accuracy"]}, "bars: &#x27;metric&#x27; must name a metric"),
        ({"kind": "bars", "x": "nope", "metric": "accuracy"}, "bars: no numeric rows"),
        ({"kind": "curve", "x": "draw", "metric": "accuracy", "spread": 3}, "curve: &#x27;spread&#x27; must name a parameter"),
        (
            {"kind": "curve", "x": "draw", "metric": "accuracy", "reference": "none"},
            "curve: &#x27;reference&#x27; must be a dict",
        ),
    ],
)
def test_a_bad_new_spec_is_a_note(spec, message):
    r = ablation_result()
    r.meta = {"figures": [spec]}
    with pytest.warns(UserWarning, match="not drawn"):
        page = render_probe_html(r)
    assert f"A figure could not be drawn: {message}" in page


# -- examples -----------------------------------------------------------------------------------

SCRIPT = '<script>document.body.setAttribute("data-pwned","1")</script>'


def examples(n=6):
    out = []
    for i in range(n):
        ok = i % 3 != 1
        out.append(
            {
                "length": 256,
                "depth": i / n,
                "sample": i,
                "key": "apple",
                "prompt": "filler " * 40 + f"The secret of apple is {1000 + i}. " + "more " * 40 + "What is apple's secret?",
                "answer": str(1000 + i),
                "output": str(1000 + i) if ok else (SCRIPT if i == 1 else "9999"),
                "score": 1.0 if ok else 0.0,
            }
        )
    return out


def example_section(page):
    return re.search(r'<section id="examples">(.*?)</section>', page, re.S).group(1)


def test_examples_are_a_table_failures_first_escaped_and_not_in_the_run_section():
    ex = examples()
    page = render(grid(), examples=ex)
    section = example_section(page)
    header = [unescape(h) for h in re.findall(r"<th data-type[^>]*>(.*?)</th>", section)]
    assert header == ["length", "depth", "sample", "key", "prompt (excerpt)", "expected", "output", "correct"]
    rows = re.findall(r'<tr class="(pass|fail)">(.*?)</tr>', section)
    assert len(rows) == len(ex)
    failures = [i for i, e in enumerate(ex) if e["score"] < 1]
    assert [c for c, _ in rows] == ["fail"] * len(failures) + ["pass"] * (len(ex) - len(failures))
    samples = [int(re.findall(r'data-v="([^"]*)"', body)[2]) for _, body in rows]
    assert samples == failures + [i for i in range(len(ex)) if i not in failures]  # failures first, then in run order
    marks = [unescape(re.sub(r"<[^>]+>", "", body.rsplit("<td", 1)[1].split(">", 1)[1])) for _, body in rows]
    assert marks == ["✗"] * len(failures) + ["✓"] * (len(ex) - len(failures))
    # the prompt's excerpt is around the answer, marked
    assert "<mark>1001</mark>" in rows[0][1] and "What is apple" not in rows[0][1]
    # a model's output holding <script> is text
    assert SCRIPT not in page and page.count("<script") == 1
    assert "&lt;script&gt;document.body.setAttribute(&quot;data-pwned&quot;,&quot;1&quot;)&lt;/script&gt;" in section
    assert 'class="heads sortable examples"' in section
    assert "2 of 6 answers wrong" in section
    run = re.search(r'<section id="run">(.*?)</section>', page, re.S).group(1)
    assert "examples" not in re.findall(r"<tr><th>(.*?)</th><td>", run)
    assert page.index('id="examples"') < page.index('id="results"')


def test_many_examples_are_cut_with_a_note_keeping_every_failure_first():
    ex = examples(3 * MAX_EXAMPLES)
    for e in ex:
        del e["prompt"]
    section = example_section(render(grid(), examples=ex))
    rows = re.findall(r'<tr class="(pass|fail)">', section)
    assert len(rows) == MAX_EXAMPLES and rows == ["fail"] * MAX_EXAMPLES  # 600 examples, 200 failures: all of them
    assert f"Showing {MAX_EXAMPLES} of {3 * MAX_EXAMPLES} examples" in section
    assert "prompt (excerpt)" not in section


def test_examples_of_another_shape_stay_in_the_run_section():
    other = [{"task": "niah", "length": 256, "answer": "x", "references": ["x"]}]  # no output, no score
    page = render(grid(), examples=other)
    assert 'id="examples"' not in page
    run = re.search(r'<section id="run">(.*?)</section>', page, re.S).group(1)
    assert "examples" in re.findall(r"<tr><th>(.*?)</th><td>", run)


# -- in a real browser --------------------------------------------------------------------------


def test_in_chromium_the_new_figures_and_the_examples_render_without_console_errors(tmp_path):
    r = curves_result()
    r.rows += ablation_result().rows
    r.rows += grid().rows
    r.meta = {
        "model": SCRIPT,
        "examples": examples(),
        "figures": [
            {
                "kind": "curve",
                "x": "budget",
                "metric": "exact_match",
                "series": "policy",
                "spread": "sample",
                "reference": {"policy": "full"},
                "x_title": "budget",
                "y_title": "accuracy",
            },
            {
                "kind": "curve",
                "x": "depth",
                "metric": "exact_match",
                "series": "policy",
                "split": "budget",
                "spread": "sample",
                "reference": {"policy": "full"},
            },
            {"kind": "bars", "x": "ablation", "metric": "accuracy", "series": "task", "spread": "draw"},
            {"kind": "heatmap", "rows": "depth", "cols": "length", "metric": "accuracy"},
        ],
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = write_probe_report(r, str(tmp_path / "out"))
    proc = chromium(tmp_path, "--dump-dom", url=f"file://{path}")
    assert console_lines(proc.stderr) == []
    dom = proc.stdout
    body = re.search(r"<body[^>]*>", dom).group(0)
    assert 'data-ready="1"' in body and "data-pwned" not in body
    assert dom.count('<svg class="curve"') == 3 and dom.count('<svg class="bars"') == 1 and dom.count('<svg class="heatmap"') == 1
    assert dom.count('class="band"') >= 2 and 'class="reference"' in dom and dom.count('class="bar"') == 6
    assert len(re.findall(r'<tr class="fail">', dom)) == 2
