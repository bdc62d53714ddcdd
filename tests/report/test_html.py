"""The HTML report: escaping, self-containment, heatmap colours, table, token view."""

import json
import re
from html import unescape

import pytest
from report_profiles import HOSTILE, hostile_profile

from attnkit.inspection import AttentionProfile
from attnkit.report import choose_token_heads, render_html


@pytest.fixture(scope="module")
def profile():
    return hostile_profile()


@pytest.fixture(scope="module")
def page(profile):
    return render_html(profile)


def test_no_input_text_reaches_the_page_unescaped(page):
    assert page.count("<script") == 2  # the data block and the page's own code
    for bad in HOSTILE[:3]:
        assert bad not in page
    assert "<img" not in page and 'onerror="' not in page
    # the model name is shown, as text
    assert "&lt;script&gt;document.body.setAttribute(&quot;data-pwned&quot;,&quot;4&quot;)&lt;/script&gt;" in page


def test_token_data_is_escaped_json_that_reads_back(page, profile):
    block = re.search(r'<script type="application/json" id="attnkit-data">(.*?)</script>', page, re.S).group(1)
    assert "<" not in block and ">" not in block and "&" not in block
    data = json.loads(block)
    assert data["tokens"] == profile.tokens
    head = data["heads"][0]
    top = profile.arrays["top_keys"][(head["layer"], head["head"])]
    assert head["index"] == top["index"][0].tolist()


def test_self_contained(page):
    assert not re.search(r'(src|href)\s*=\s*"(?!#)', page)  # no file, no URL: only in-page anchors
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in page


def test_heatmap_colours_follow_the_values(page, profile):
    # the sink.score heatmap: the smallest value gets viridis' first colour, the largest its last
    svg = re.search(r'<svg class="heatmap"[^>]*aria-label="sink.score">(.*?)</svg>', page, re.S).group(1)
    cells = re.findall(r'fill="(#[0-9a-f]{6})"><title>layer (\d+), head (\d+): sink.score = ', svg)
    assert len(cells) == len(profile.heads)
    values = {(int(layer), int(h)): profile.value(int(layer), int(h), "sink.score") for _, layer, h in cells}
    lo, hi = min(values, key=values.get), max(values, key=values.get)
    fills = {(int(layer), int(h)): fill for fill, layer, h in cells}
    assert fills[lo] == "#440154" and fills[hi] == "#fde725"


def test_heads_table_has_every_head_with_sortable_values(page, profile):
    table = re.search(r'<table class="heads sortable">(.*?)</table>', page, re.S).group(1)
    header = re.findall(r"<th data-type=\"\w+\">(.*?)</th>", table)
    assert header[:3] == ["layer", "head", "class"] and "sink.score" in header and "span.doc" in header
    rows = re.findall(r"<tr><td data-v=\"(\d+)\">\d+</td><td data-v=\"(\d+)\">", table)
    assert sorted((int(a), int(b)) for a, b in rows) == profile.heads
    col = header.index("sink.score")
    first = re.search(r"<tbody><tr>(.*?)</tr>", table).group(1)
    values = re.findall(r'data-v="([^"]*)"', first)
    layer, head = int(values[0]), int(values[1])
    assert float(values[col]) == profile.value(layer, head, "sink.score")


def test_token_view_only_up_to_512_tokens(profile):
    long = AttentionProfile(profile.rows, [f"t{i}" for i in range(600)], dict(profile.meta, tokens=600), profile.arrays)
    page = render_html(long)
    assert 'id="attnkit-data"' not in page and "up to 512 tokens; this one has 600" in page


def test_token_heads_choice_and_errors(profile):
    classes = profile.classify()
    chosen = choose_token_heads(profile, classes, limit=3)
    assert len(chosen) == 3 and len(set(chosen)) == 3
    page = render_html(profile, token_heads=[(1, 2)])
    data = json.loads(unescape(re.search(r'id="attnkit-data">(.*?)</script>', page, re.S).group(1)))
    assert [(h["layer"], h["head"]) for h in data["heads"]] == [(1, 2)]
    with pytest.raises(ValueError, match="token_heads"):
        render_html(profile, token_heads=[(7, 7)])
    with pytest.raises(ValueError, match="profile"):
        render_html({"rows": []})
