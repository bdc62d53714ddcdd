"""PNG figures: one per metric heatmap, distance profiles, head classes, sink summary."""

import os

import matplotlib.image as mpimg
from report_profiles import hostile_profile

from attnkit.report import write_figures
from attnkit.report.html import heatmap_metrics


def test_every_figure_is_written_and_drawn(tmp_path):
    profile = hostile_profile()
    paths = write_figures(profile, str(tmp_path), dpi=60)
    names = {os.path.basename(p) for p in paths}
    want = {f"heatmap_{m}.png" for m in heatmap_metrics(profile)} | {
        "distance_profiles.png",
        "head_classes.png",
        "sink_summary.png",
    }
    assert names == want
    for path in paths:
        img = mpimg.imread(path)[..., :3]
        ink = (img < 0.9).any(-1).mean()  # share of pixels that are not near-white
        assert ink > 0.02, f"{path} looks blank"
