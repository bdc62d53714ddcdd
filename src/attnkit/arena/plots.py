"""The arena's figures as PNG files (matplotlib, Agg): accuracy against model width,
against sequence length, and against training time.

Points are means over seeds with min–max bars; learning curves are drawn per run.
"""

from __future__ import annotations

import os

from ..extras import require


def _pyplot():
    require("matplotlib", "attnkit.arena's plots")
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _mean_by(rows: list[dict], line_key, x_key) -> dict:
    """{line: {x: [accuracies]}}."""
    lines: dict = {}
    for row in rows:
        lines.setdefault(line_key(row), {}).setdefault(row[x_key], []).append(row["accuracy"])
    return lines


def _draw(ax, lines: dict) -> None:
    for label, points in lines.items():
        xs = sorted(points)
        means = [sum(points[x]) / len(points[x]) for x in xs]
        low = [m - min(points[x]) for m, x in zip(means, xs)]
        high = [max(points[x]) - m for m, x in zip(means, xs)]
        ax.errorbar(xs, means, yerr=[low, high], marker="o", capsize=3, label=label)


def _finish(plt, fig, ax, title: str, xlabel: str, path: str) -> str:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def accuracy_vs_width(rows: list[dict], path: str) -> str:
    plt = _pyplot()
    at_train = [r for r in rows if r["eval_len"] == r["seq_len"]]
    several = len({r["seq_len"] for r in at_train}) > 1
    lines = _mean_by(at_train, lambda r: r["mechanism"] + (f" N={r['seq_len']}" if several else ""), "d_model")
    fig, ax = plt.subplots(figsize=(6, 4))
    _draw(ax, lines)
    ax.set_xscale("log", base=2)
    return _finish(plt, fig, ax, f"{rows[0]['task']}: accuracy vs width", "d_model", path)


def accuracy_vs_length(rows: list[dict], path: str) -> str:
    plt = _pyplot()
    several = len({r["d_model"] for r in rows}) > 1
    lines = _mean_by(rows, lambda r: r["mechanism"] + (f" d={r['d_model']}" if several else ""), "eval_len")
    fig, ax = plt.subplots(figsize=(6, 4))
    _draw(ax, lines)
    ax.set_xscale("log", base=2)
    for n in sorted({r["seq_len"] for r in rows}):
        ax.axvline(n, color="grey", linestyle=":", linewidth=1)  # training lengths
    return _finish(
        plt, fig, ax, f"{rows[0]['task']}: accuracy vs sequence length (dotted: trained at)", "evaluated at length", path
    )


def accuracy_vs_time(records: list[dict], path: str) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    colors: dict[str, str] = {}
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    widths = sorted({rec["d_model"] for rec in records})
    styles = ["-", "--", ":", "-."]  # one per width, colours per mechanism
    labelled = set()
    for rec in records:
        mech = rec["mechanism"]
        colors.setdefault(mech, cycle[len(colors) % len(cycle)])
        label = mech + (f" d={rec['d_model']}" if len(widths) > 1 else "")
        xs = [h["seconds"] for h in rec["history"]]
        ys = [h["accuracy"] for h in rec["history"]]
        ax.plot(
            xs,
            ys,
            marker=".",
            color=colors[mech],
            linestyle=styles[widths.index(rec["d_model"]) % len(styles)],
            alpha=0.8,
            label=None if label in labelled else label,
        )
        labelled.add(label)
    return _finish(plt, fig, ax, f"{records[0]['task']}: held-out accuracy during training", "training seconds", path)


def write_plots(rows: list[dict], records: list[dict], directory: str) -> list[str]:
    """The three figures in ``directory``; returns their paths."""
    os.makedirs(directory, exist_ok=True)
    return [
        accuracy_vs_width(rows, os.path.join(directory, "accuracy_vs_width.png")),
        accuracy_vs_length(rows, os.path.join(directory, "accuracy_vs_length.png")),
        accuracy_vs_time(records, os.path.join(directory, "accuracy_vs_time.png")),
    ]
