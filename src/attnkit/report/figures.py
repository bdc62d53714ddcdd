"""The report's figures as PNG files (matplotlib, Agg), for papers and slides."""

from __future__ import annotations

import os
import re

from ..extras import require
from ..inspection.profile import AttentionProfile
from ..observe import LABELS
from ..observe.distance import parse_bin_label
from .html import CLASS_COLOURS, heatmap_metrics, is_distance_bin


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def write_figures(profile: AttentionProfile, out_dir: str, dpi: int = 150) -> list[str]:
    """Write one PNG per metric heatmap, the distance profiles, the head classes and
    the sink summary into ``out_dir``; returns the paths."""
    require("matplotlib", "attnkit.report's PNG figures")
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    os.makedirs(out_dir, exist_ok=True)
    paths = []

    def save(fig, name):
        path = os.path.join(out_dir, _safe(name) + ".png")
        fig.savefig(path, dpi=dpi, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)

    layers = profile.layers
    for metric in heatmap_metrics(profile):
        grid = profile.table(metric)[layers].numpy()
        fig, ax = plt.subplots(figsize=(1.2 + 0.38 * grid.shape[1], 0.9 + 0.32 * grid.shape[0]))
        im = ax.imshow(grid, cmap="viridis", aspect="auto")
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_yticks(range(len(layers)), [str(lay) for lay in layers])
        ax.set_title(metric)
        fig.colorbar(im, ax=ax)
        save(fig, f"heatmap_{metric}")

    bins = sorted((m for m in profile.metrics if is_distance_bin(m)), key=lambda m: parse_bin_label(m[len("distance.") :])[0])
    if bins:
        cols = min(len(layers), 4)
        rows = -(-len(layers) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows), squeeze=False, sharey=True)
        for ax, layer in zip(axes.flat, layers):
            for lay, h in profile.heads:
                if lay == layer and profile.has(lay, h, bins[0]):
                    ax.plot(range(len(bins)), [profile.value(lay, h, b) for b in bins], lw=1, alpha=0.8)
            ax.set_title(f"layer {layer}")
            ax.set_xticks(range(len(bins)), [b[len("distance.") :] for b in bins], rotation=60, fontsize=7)
            ax.set_ylim(0, 1)
        for ax in list(axes.flat)[len(layers) :]:
            ax.axis("off")
        axes[0][0].set_ylabel("mass")
        fig.suptitle("attention mass by distance |i - j|, one line per head")
        fig.tight_layout()
        save(fig, "distance_profiles")

    classes = profile.classify()
    n_heads = max(h for _, h in profile.heads) + 1
    codes = [[LABELS.index(classes[(lay, h)].label) if (lay, h) in classes else -1 for h in range(n_heads)] for lay in layers]
    fig, ax = plt.subplots(figsize=(1.2 + 0.38 * n_heads, 0.9 + 0.32 * len(layers)))
    cmap = ListedColormap(["#eeeeee"] + [CLASS_COLOURS[label] for label in LABELS])
    ax.imshow([[c + 1 for c in row] for row in codes], cmap=cmap, vmin=0, vmax=len(LABELS), aspect="auto")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_yticks(range(len(layers)), [str(lay) for lay in layers])
    handles = [plt.Rectangle((0, 0), 1, 1, color=CLASS_COLOURS[label]) for label in LABELS]
    ax.legend(handles, LABELS, bbox_to_anchor=(1.02, 1), loc="upper left", fontsize=8)
    ax.set_title("head classes")
    save(fig, "head_classes")

    if "sink.score" in profile.metrics:
        eps = profile.meta.get("meters", {}).get("sink", {}).get("epsilon", 0.3)
        table = profile.table("sink.score")[layers]
        measured = ~table.isnan()
        rate = ((table > eps) & measured).sum(1) / measured.sum(1).clamp_min(1)
        fig, ax = plt.subplots(figsize=(4.5, 0.8 + 0.3 * len(layers)))
        ax.barh([f"layer {lay}" for lay in layers], rate.tolist(), color="#31688e")
        ax.set_xlim(0, 1)
        ax.invert_yaxis()
        ax.set_xlabel(f"fraction of heads with sink score > {eps:g}")
        save(fig, "sink_summary")
    return paths
