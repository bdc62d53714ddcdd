"""``attnkit inspect --model VLM_DIR --image FILE --prompt TEXT`` end to end on a tiny
LLaVA saved with its processor, and its report in headless Chromium: no console
output, the patch-grid overlays drawn over the image with each head's received mass,
the share curves present, and hostile text kept as text."""

import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import tiny_vlms as V

from attnkit.cli import main

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


def chromium(tmp_path, *args, url):
    """Debian's chromium, as tests/report/test_chromium.py runs it."""
    binary = shutil.which("chromium")
    assert binary, "chromium is not installed: run scripts/setup.sh --test (it installs Debian's chromium)"
    profile_dir = tmp_path / f"chromium-profile-{len(os.listdir(tmp_path))}"
    cmd = [binary, *FLAGS, f"--user-data-dir={profile_dir}", "--enable-logging=stderr", "--v=0", *args, url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def console_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


HOSTILE = "is there a red circle ? <script>document.body.dataset.pwned=1</script>"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from PIL import Image

    root = tmp_path_factory.mktemp("vlm")
    model_dir, out = str(root / "model"), str(root / "report")
    V.save_llava(model_dir)
    pixels = np.zeros((24, 30, 3), np.uint8)
    pixels[2:10, 4:12] = (230, 40, 40)  # a red square top-left on black
    Image.fromarray(pixels).save(root / "scene.png")
    code = main(
        [
            "inspect",
            "--model",
            model_dir,
            "--image",
            str(root / "scene.png"),
            "--prompt",
            HOSTILE,
            "--max-new-tokens",
            "4",
            "--top-k",
            "3",
            "--out",
            out,
            "--json",
            "--quiet",
        ]
    )
    assert code == 0
    return root, out


def test_cli_writes_profile_with_per_step_shares(run, capsys):
    _, out = run
    doc = json.load(open(os.path.join(out, "profile.json")))
    assert doc["meta"]["vision"]["steps"] == 4
    assert doc["meta"]["vision"]["images"] == [{"row": 0, "start": 0, "end": 9, "grid": [3, 3]}]  # no BOS: the image first
    shares = doc["arrays"]["visual_share"]
    assert sorted(shares) == [f"{layer}.{h}" for layer in range(2) for h in range(4)]
    assert all(len(v["values"][0]) == 4 and v["step_start"] == doc["meta"]["prompt_tokens"] - 1 for v in shares.values())
    metrics = {r[2] for r in doc["rows"]}
    assert {"visual.share", "visual.drift", "visual.top3", "visual.blind"} <= metrics


def test_overlay_cells_carry_each_heads_received_mass(run):
    _, out = run
    page = open(os.path.join(out, "report.html"), encoding="utf-8").read()
    doc = json.load(open(os.path.join(out, "profile.json")))
    assert page.count('<use href="#attnkit-image"/>') == 8 and page.count('id="attnkit-image"') == 1
    for key, data in doc["arrays"]["visual_received"].items():
        layer, head = key.split(".")
        fig = re.search(rf'<figure class="head" data-layer="{layer}" data-head="{head}">(.*?)</figure>', page).group(1)
        cells = [float(v) for v in re.findall(r'class="cell"[^>]*data-v="([^"]+)"', fig)]
        assert cells == pytest.approx(data["values"][0][0:9], rel=1e-5)
    assert "<script>document" not in page  # the prompt's markup stays text
    assert "&lt;script&gt;document" in page


def test_report_renders_in_chromium(run, tmp_path):
    import matplotlib.image as mpimg

    _, out = run
    html = os.path.join(out, "report.html")
    proc = chromium(tmp_path, "--dump-dom", url=f"file://{html}")
    assert console_lines(proc.stderr) == []
    body = re.search(r"<body[^>]*>", proc.stdout).group(0)
    assert "pwned" not in body
    shot = tmp_path / "shot.png"
    chromium(tmp_path, "--window-size=1000,700", f"--screenshot={shot}", "--hide-scrollbars", url=f"file://{html}")
    img = mpimg.imread(str(shot))[..., :3]
    r, g, b = img[..., 0], img[..., 1], img[..., 2]
    orange = ((r > 0.5) & (r - b > 0.3)).mean()  # the cells' fill over the image
    dark = ((r + g + b) < 0.6).mean()  # the image's black background seen through the cells
    assert orange > 0.01 and dark > 0.005, (orange, dark)


def test_bad_options(tmp_path, capsys):
    png = tmp_path / "x.png"
    png.write_bytes(b"not a png")
    for argv, expected in [
        (["--image", str(png), "--prompt", "hi"], "--model: --image needs a local vision-language model"),
        (["--image", str(png)], "--prompt: --image needs a question"),
        (["--prompt", "hi", "--max-new-tokens", "3"], "--max-new-tokens: only with --image"),
        (["--image", str(png), "--prompt", "hi", "--meters", "sink"], "--meters: not used with --image"),
    ]:
        assert main(["inspect", *argv, "--out", str(tmp_path / "o")]) != 0
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1, err
