"""The probe report: figures drawn from meta["figures"] hold the values of the rows
(computed here independently), steered runs side by side, the sortable table, the run's
meta, escaping of every string a result carries, and a clean run in headless Chromium."""

import math
import re
import shutil
import subprocess
import warnings
from html import unescape

import matplotlib.image as mpimg
import pytest

from attnkit.probes import ProbeResult
from attnkit.report.probe import render_probe_html, write_probe_report

HOSTILE = [
    '<script>document.body.setAttribute("data-pwned","1")</script>',
    "<img src=x onerror=\"document.body.setAttribute('data-pwned','2')\">",
    "</script><script>document.body.setAttribute('data-pwned','3')</script>",
]
LENGTHS, DEPTHS, SAMPLES = (256, 1024, 4096), (0.0, 0.5, 1.0), 3


def score(n, d, s):
    """A value per grid cell and sample, in [0, 1], 0 and 1 both reached."""
    return [[0.0, 0.5, 1.0], [0.25, 0.5, 0.75], [1.0, 0.5, 0.0]][LENGTHS.index(n)][DEPTHS.index(d)] * (s + 1) / SAMPLES


def grid_result(**extra) -> ProbeResult:
    r = ProbeResult("grid")
    for n in LENGTHS:
        for d in DEPTHS:
            for s in range(SAMPLES):
                r.add("accuracy", score(n, d, s), length=n, depth=d, sample=s, **extra)
                r.add("mass", 2.0 + n / 1024 + d, length=n, depth=d, sample=s, **extra)
    r.meta = {
        "model": "tiny",
        "params": {"lengths": list(LENGTHS), "batch_size": 4},
        "seconds": 2.5,
        "figures": [
            {"kind": "heatmap", "rows": "depth", "cols": "length", "metric": "accuracy", "title": "accuracy grid"},
            {"kind": "curve", "x": "length", "metric": "accuracy", "series": "depth", "title": "accuracy curve"},
        ],
    }
    return r


def hostile_result() -> ProbeResult:
    r = ProbeResult(HOSTILE[0])
    for i, task in enumerate(HOSTILE):
        r.add(HOSTILE[1], 0.1 * i, task=task, layer=i)
        r.add("score", 1.0 - 0.1 * i, task=task, layer=i, note=HOSTILE[2])
    r.meta = {
        "model": HOSTILE[2],
        "params": {"needle": HOSTILE[0], HOSTILE[1]: 1},
        "seconds": 0.5,
        HOSTILE[0]: HOSTILE[1],
        "figures": [
            {"kind": "heatmap", "rows": "layer", "cols": "task", "metric": "score", "title": HOSTILE[0]},
            {"kind": "curve", "x": "layer", "metric": [HOSTILE[1], "score"], "series": None, "title": HOSTILE[1]},
            {"kind": HOSTILE[0]},
        ],
    }
    return r


def _svgs(page, cls):
    return re.findall(rf'<svg class="{cls}"[^>]*aria-label="([^"]*)">(.*?)</svg>', page, re.S)


def _cells(svg):
    """(row label, col label) -> (fill, value shown) of a heatmap's cells."""
    found = re.findall(r'fill="(#[0-9a-f]{6})"><title>(\w+) ([^,]+), (\w+) ([^:]+): (\S+) = ([^<]+)</title>', svg)
    return {(a, b): (fill, float(v) if v != "–" else math.nan) for fill, _, a, _, b, _, v in found}


def test_heatmap_cells_are_the_means_over_samples():
    page = render_probe_html(grid_result())
    ((label, svg),) = _svgs(page, "heatmap")
    assert label == "accuracy grid"
    cells = _cells(svg)
    assert len(cells) == len(LENGTHS) * len(DEPTHS)
    for n in LENGTHS:
        for d in DEPTHS:
            want = sum(score(n, d, s) for s in range(SAMPLES)) / SAMPLES
            fill, shown = cells[(f"{d:g}", str(n))]
            assert shown == pytest.approx(want, rel=1e-3)
    # values in [0, 1] are drawn on [0, 1]: 0 gets viridis' first colour, a mean of 2/3 of 1 ...
    assert cells[("0", "256")][0] == "#440154"
    top = max(cells.values(), key=lambda c: c[1])
    assert top[1] == pytest.approx(2 / 3, rel=1e-3) and top[0] not in ("#440154", "#fde725")


def test_heatmap_marks_missing_cells_and_uses_the_data_range_beyond_0_1():
    r = grid_result()
    r.rows = [row for row in r.rows if not (row["length"] == 4096 and row["depth"] == 1.0)]
    r.meta["figures"] = [{"kind": "heatmap", "rows": "depth", "cols": "length", "metric": "mass"}]
    cells = _cells(_svgs(render_probe_html(r), "heatmap")[0][1])
    assert cells[("1", "4096")][0] == "#d9d9d9" and math.isnan(cells[("1", "4096")][1])
    # mass ranges over 2.25 .. 6.5 here: the smallest is the first colour, the largest the last
    assert cells[("0", "256")] == ("#440154", 2.25) and cells[("0.5", "4096")] == ("#fde725", 6.5)


def test_small_scores_use_their_own_range_unless_the_spec_fixes_one():
    r = ProbeResult("heads")
    for layer in range(2):
        for head in range(3):
            r.add("induction", 0.02 + 0.01 * (3 * layer + head), layer=layer, head=head)  # 0.02 .. 0.07
    r.meta["figures"] = [
        {"kind": "heatmap", "rows": "layer", "cols": "head", "metric": "induction"},
        {"kind": "heatmap", "rows": "layer", "cols": "head", "metric": "induction", "range": [0, 1]},
    ]
    own, fixed = (_cells(svg) for _, svg in _svgs(render_probe_html(r), "heatmap"))
    assert own[("0", "0")][0] == "#440154" and own[("1", "2")][0] == "#fde725"  # 0.02 and 0.07: both ends
    assert fixed[("1", "2")][0] not in ("#fde725",) and fixed[("0", "0")][0] != "#440154"  # near 0 on [0, 1]
    r.meta["figures"] = [{"kind": "heatmap", "rows": "layer", "cols": "head", "metric": "induction", "range": [1, 0]}]
    with pytest.warns(UserWarning):
        assert "&#x27;range&#x27; must be [lo, hi] with lo &lt; hi" in render_probe_html(r)


def test_curve_points_are_the_means_on_a_linear_y_and_log2_x_axis():
    page = render_probe_html(grid_result())
    ((label, svg),) = _svgs(page, "curve")
    points = re.findall(
        r'<circle class="point" cx="([\d.]+)" cy="([\d.]+)" r="3" fill="[^"]+"><title>depth=([^:]+): (\d+) → ([^<]+)</title>', svg
    )
    assert len(points) == len(LENGTHS) * len(DEPTHS)
    by = {}
    for cx, cy, d, n, shown in points:
        want = sum(score(int(n), float(d), s) for s in range(SAMPLES)) / SAMPLES
        assert float(shown) == pytest.approx(want, rel=1e-3)
        by[(float(d), int(n))] = (float(cx), float(cy), want)
    # y: linear in the value on [0, 1] (the bottom is 0); x: lengths 256, 1024, 4096 evenly (log2)
    bottom = by[(0.0, 256)][1]
    unit = (bottom - by[(0.5, 256)][1]) / by[(0.5, 256)][2]
    for _cx, cy, v in by.values():
        assert bottom - cy == pytest.approx(unit * v, abs=0.2)
    xs = sorted({cx for cx, _, _ in by.values()})
    assert len(xs) == 3 and xs[1] - xs[0] == pytest.approx(xs[2] - xs[1], abs=0.2)
    assert "length (log scale)" in svg
    # one polyline per depth, and a legend naming each
    assert svg.count("<polyline") == 3 and all(f">depth={d:g}</text>" in svg for d in DEPTHS)


def test_a_curve_breaks_where_a_series_has_no_value():
    r = ProbeResult("gaps")
    for n, v in ((1, 0.2), (2, 0.4), (4, 0.8)):
        r.add("recall", v, n=n, keys=1)
    for n, v in ((1, 0.1), (4, 0.3)):  # nothing at n=2
        r.add("recall", v, n=n, keys=2)
    r.meta["figures"] = [{"kind": "curve", "x": "n", "metric": "recall", "series": "keys"}]
    ((_, svg),) = _svgs(render_probe_html(r), "curve")
    assert svg.count("<polyline") == 1  # keys=1 joins its three points; keys=2's two points are not joined across the gap
    assert len(re.findall(r"<title>keys=2: ", svg)) == 2 and len(re.findall(r"<title>keys=1: ", svg)) == 3
    assert "(log scale)" not in svg  # 1 .. 4 is no wide range


def test_steered_runs_are_drawn_side_by_side_on_one_scale():
    r = grid_result(steered=False)
    steered = grid_result(steered=True)
    for row in steered.rows:  # the steered run gets every cell half-way to 1
        if row["metric"] == "accuracy":
            row["value"] = (row["value"] + 1) / 2
    r.rows += steered.rows
    r.add("layers", 2)  # a row without the column does not split the figures it is not in
    page = render_probe_html(r)
    heat = _svgs(page, "heatmap")
    assert [label for label, _ in heat] == ["accuracy grid — steered=False", "accuracy grid — steered=True"]
    plain, steer = _cells(heat[0][1]), _cells(heat[1][1])
    for key, (_, v) in plain.items():
        assert steer[key][1] == pytest.approx((v + 1) / 2, rel=1e-3)
    assert plain[("0", "256")][0] == "#440154"  # both panels on [0, 1]
    assert [label for label, _ in _svgs(page, "curve")] == ["accuracy curve — steered=False", "accuracy curve — steered=True"]
    assert "is drawn once per value, side by side" in page


def test_results_table_is_sortable_and_cut_with_a_note():
    r = grid_result()
    page = render_probe_html(r)
    table = re.search(r'<table class="heads sortable results">(.*?)</table>', page, re.S).group(1)
    header = re.findall(r'<th data-type="(\w+)">(.*?)</th>', table)
    assert header == [
        ("text", "probe"),
        ("number", "length"),
        ("number", "depth"),
        ("number", "sample"),
        ("text", "metric"),
        ("number", "value"),
    ]
    body = re.findall(r"<tr>(.*?)</tr>", table)[1:]
    assert len(body) == len(r.rows)
    first = re.findall(r'data-v="([^"]*)"', body[0])
    row = r.rows[0]
    assert first == ["grid", str(row["length"]), repr(row["depth"]), str(row["sample"]), "accuracy", repr(row["value"])]
    cut = render_probe_html(r, max_rows=5)
    assert len(re.findall(r"<tr>", re.search(r"<tbody>(.*?)</tbody>", cut, re.S).group(1))) == 5
    assert f"Showing the first 5 of {len(r.rows)} rows" in cut and "results.csv holds every row" in cut


def test_unmeasured_values_sort_with_the_empty_cells():
    r = ProbeResult("gaps")
    r.add("accuracy", math.nan, length=1)
    r.add("accuracy", 0.5, length=2)
    body = re.search(r"<tbody>(.*?)</tbody>", render_probe_html(r), re.S).group(1)
    assert '<td data-v="">nan</td>' in body and '<td data-v="0.5">0.5</td>' in body


def test_meta_shows_model_params_and_seconds():
    page = render_probe_html(grid_result())
    run = re.search(r'<section id="run">(.*?)</section>', page, re.S).group(1)
    kv = dict(re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td></tr>", run))
    assert kv["probe"] == "grid" and kv["model"] == "tiny" and kv["seconds"] == "2.50"
    assert kv["--lengths"] == "[256, 1024, 4096]" and kv["--batch-size"] == "4"
    assert "figures" not in kv


def test_no_result_text_reaches_the_page_unescaped():
    with pytest.warns(UserWarning, match="not drawn"):
        page = render_probe_html(hostile_result())
    assert page.count("<script") == 1  # the page's own code
    for bad in HOSTILE:
        assert bad not in page
    assert "<img" not in page and 'onerror="' not in page
    # each shows as text: in the title, the heatmap's labels, the curve's legend, the table, the meta
    text = unescape(re.sub(r"<[^>]+>", "", page.split("<script>")[0]))
    for bad in HOSTILE:
        assert bad in text
    assert "&lt;script&gt;document.body.setAttribute(&quot;data-pwned&quot;,&quot;1&quot;)&lt;/script&gt;" in page
    assert len(_svgs(page, "heatmap")) == 1 and len(_svgs(page, "curve")) == 1
    assert "A figure could not be drawn: unknown figure kind" in page


def test_self_contained():
    page = render_probe_html(grid_result())
    assert not re.search(r'(src|href)\s*=\s*"(?!#)', page)  # no file, no URL: only in-page anchors
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in page


@pytest.mark.parametrize(
    "spec,message",
    [
        (
            {"kind": "heatmap", "rows": "depth", "cols": "nope", "metric": "accuracy"},
            "table: no &#x27;accuracy&#x27; rows with both",
        ),
        ({"kind": "heatmap", "rows": "depth", "metric": "accuracy"}, "heatmap: &#x27;cols&#x27; must name a parameter"),
        ({"kind": "curve", "x": "length", "metric": "nope"}, "curve: no numeric rows of &#x27;nope&#x27;"),
        ({"kind": "curve", "x": "length", "metric": []}, "curve: &#x27;metric&#x27; must name a metric"),
        ({"kind": "curve", "x": "length", "metric": "accuracy", "where": [1]}, "&#x27;where&#x27; must be a dict"),
        ("heatmap", "a figure spec is a dict"),
    ],
)
def test_a_bad_figure_spec_is_a_note_not_a_crash(spec, message):
    r = grid_result()
    r.meta["figures"] = [spec, r.meta["figures"][0]]
    with pytest.warns(UserWarning, match="not drawn"):
        page = render_probe_html(r)
    assert f"A figure could not be drawn: {message}" in page
    assert len(_svgs(page, "heatmap")) == 1  # the good figure is still drawn


def test_no_figures_and_bad_arguments(tmp_path):
    r = grid_result()
    r.meta["figures"] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        page = render_probe_html(r)
    assert "This probe declared no figures" in page and "<svg" not in page
    with pytest.raises(ValueError, match="result: expected a ProbeResult"):
        render_probe_html({"rows": []})
    with pytest.raises(ValueError, match="max_rows: expected an int >= 1"):
        render_probe_html(r, max_rows=0)
    path = write_probe_report(r, str(tmp_path / "new" / "dir"))
    assert path == str(tmp_path / "new" / "dir" / "report.html") and open(path).read() == page


# -- in a real browser --------------------------------------------------------------------------

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


def chromium(tmp_path, *args, url):
    binary = shutil.which("chromium")
    assert binary, "chromium is not installed: run scripts/setup.sh --test (it installs Debian's chromium)"
    profile_dir = tmp_path / f"chromium-profile-{len(list(tmp_path.iterdir()))}"
    proc = subprocess.run(
        [binary, *FLAGS, f"--user-data-dir={profile_dir}", "--enable-logging=stderr", "--v=0", *args, url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def test_in_chromium_the_page_runs_clean_hostile_text_stays_text_and_figures_show(tmp_path):
    r = grid_result()
    hostile = hostile_result()
    r.meta["model"] = hostile.meta["model"]
    r.rows += hostile.rows
    r.meta["figures"] += hostile.meta["figures"][:2]
    path = write_probe_report(r, str(tmp_path / "out"))
    proc = chromium(tmp_path, "--dump-dom", url=f"file://{path}")
    assert [line for line in proc.stderr.splitlines() if ":CONSOLE" in line] == []
    dom = proc.stdout
    body = re.search(r"<body[^>]*>", dom).group(0)
    assert 'data-ready="1"' in body and "data-pwned" not in body
    assert "<img" not in dom
    shot = tmp_path / "shot.png"
    chromium(tmp_path, "--window-size=1200,900", f"--screenshot={shot}", "--hide-scrollbars", url=f"file://{path}")
    img = mpimg.imread(str(shot))[..., :3]

    def pixels(hex_colour):  # how many pixels show this colour
        rgb = [int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
        return int((abs(img - rgb) < 0.03).all(-1).sum())

    # the heatmap's 0-valued cells (viridis' first colour) and the curve's first line are on screen
    assert pixels("#440154") > 100, "the heatmap did not render"
    assert pixels("#0072b2") > 50, "the curve did not render"
