"""The HTML report and its PNG figures, from an AttentionProfile.

paths = attnkit.report.write_report(profile, "attnkit-report/")
paths["html"]      # one self-contained page: open it in any browser, offline
"""

from __future__ import annotations

import os

from .figures import write_figures
from .html import choose_token_heads, render_html
from .probe import render_probe_html, write_probe_report


def write_report(profile, out_dir: str, *, token_heads=None, figures: bool = True, title: str | None = None) -> dict:
    """Write ``report.html`` (and ``figures/*.png``) into ``out_dir``; returns their paths."""
    html = render_html(profile, token_heads=token_heads, title=title)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "report.html")
    with open(path, "w", encoding="utf-8") as f:
        f.write(html)
    pngs = write_figures(profile, os.path.join(out_dir, "figures")) if figures else []
    return {"html": path, "figures": pngs}


__all__ = ["choose_token_heads", "render_html", "render_probe_html", "write_figures", "write_probe_report", "write_report"]
