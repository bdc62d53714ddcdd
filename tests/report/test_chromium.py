"""The report in a real browser: headless Chromium (Debian's ``chromium``, installed by
scripts/setup.sh --test). No console output, heatmaps drawn, the token view working,
and the hostile tokens never run."""

import os
import re
import shutil
import subprocess

import matplotlib.image as mpimg
import pytest
from report_profiles import hostile_profile

from attnkit.report import write_report

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
    profile_dir = tmp_path / f"chromium-profile-{len(os.listdir(tmp_path))}"  # fresh each run
    cmd = [binary, *FLAGS, f"--user-data-dir={profile_dir}", "--enable-logging=stderr", "--v=0", *args, url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def console_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    profile = hostile_profile()
    paths = write_report(profile, str(out), figures=False)
    return profile, paths["html"]


def test_console_check_catches_errors(tmp_path):
    # the check below is only as good as this: a page with an error must show up
    bad = tmp_path / "bad.html"
    bad.write_text("<!doctype html><body><script>undefinedFunction()</script></body>")
    proc = chromium(tmp_path, "--dump-dom", url=bad.as_uri())
    assert any("Uncaught ReferenceError" in line for line in console_lines(proc.stderr))


def test_page_runs_clean_and_hostile_tokens_stay_text(report, tmp_path):
    profile, html = report
    head = profile.arrays["top_keys"]
    layer, h = sorted(head)[-1]
    token = 17
    proc = chromium(tmp_path, "--dump-dom", url=f"file://{html}#token={layer}.{h}:{token}")
    assert console_lines(proc.stderr) == []
    dom = proc.stdout
    assert re.search(r'<body[^>]*data-ready="1"', dom), "the page's script did not finish"
    assert "data-pwned" not in re.search(r"<body[^>]*>", dom).group(0)
    assert "<img" not in dom
    # the token view: token 17 of head (layer, h) highlights exactly its top keys
    assert f'data-focus="{layer}.{h}:{token}"' in dom
    lit = {
        int(i)
        for i in re.findall(r'<span class="tok[^"]*" title="[^"]*" tabindex="0" data-i="(\d+)" style="background-color', dom)
    }
    want = {int(i) for i in head[(layer, h)]["index"][0, token].tolist() if i >= 0}
    assert lit == want


def test_heatmaps_are_drawn(report, tmp_path):
    _, html = report
    shot = tmp_path / "shot.png"
    chromium(tmp_path, "--window-size=1200,1600", f"--screenshot={shot}", "--hide-scrollbars", url=f"file://{html}")
    img = mpimg.imread(str(shot))[..., :3]
    # viridis cells: saturated blue-green-yellow pixels, absent from the white page and grey text
    r, g, b = img[..., 0], img[..., 1], img[..., 2]
    coloured = ((abs(r - g) > 0.15) | (abs(g - b) > 0.15)).mean()
    assert coloured > 0.05, f"only {coloured:.1%} coloured pixels: heatmaps not rendered"
