"""PNG plots of benchmark runs: the throughput/interactivity Pareto curve, TTFT and ITL distributions.

Figures are made with `matplotlib.figure.Figure` directly, not pyplot: no global figure state, no GUI backend.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.figure import Figure


def pareto_front(xy: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both axes (higher is better on both), in increasing x."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(xy, key=lambda p: (-p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return front[::-1]


def _point_label(point: dict[str, Any]) -> str:
    if point["concurrency"] is None and point["request_rate"] is not None:
        return f"{point['request_rate']:g}/s"
    return f"c={point['concurrency'] or 'inf'}"


def plot_pareto(runs: list[tuple[str, list[dict[str, Any]]]], path: str, title: str) -> None:
    """Output tok/s per GPU (throughput) against output tok/s per user (interactivity), one series per run:
    every point marked and labelled with its concurrency, the Pareto-optimal ones joined by a line."""
    fig = Figure(figsize=(8, 5.5), layout="constrained")
    ax = fig.add_subplot()
    x_max = y_max = 0.0
    for label, points in runs:
        measured = [p for p in points if p["output_throughput_per_user"] and p["completed"]]
        xy = [(p["output_throughput_per_user"], p["output_throughput_per_gpu"]) for p in measured]
        if not xy:
            continue
        x_max, y_max = max(x_max, *(x for x, _ in xy)), max(y_max, *(y for _, y in xy))
        marks = ax.scatter([x for x, _ in xy], [y for _, y in xy], label=label, zorder=3)
        front = pareto_front(xy)
        ax.plot([x for x, _ in front], [y for _, y in front], color=marks.get_facecolor()[0], zorder=2)
        for (x, y), p in zip(xy, measured):
            ax.annotate(_point_label(p), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("output tok/s per user (1 / mean TPOT)")
    ax.set_ylabel("output tok/s per GPU")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    # From zero, so that the eye reads ratios; headroom for the labels of the top and rightmost points.
    ax.set_xlim(0, x_max * 1.15 or 1.0)
    ax.set_ylim(0, y_max * 1.15 or 1.0)
    if x_max:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no completed point", ha="center", va="center", transform=ax.transAxes)
    fig.savefig(path, dpi=120)


def plot_cdfs(points: list[dict[str, Any]], metric: str, path: str, title: str) -> None:
    """Empirical CDF of a per-request metric ("ttft_ms") or of all inter-token gaps ("itl_ms"), one line per
    point, on a log time axis since one run spans several orders of magnitude."""
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.add_subplot()
    drawn = False
    for p in points:
        ok = [r for r in p["requests"] if r["error"] is None]
        if metric == "itl_ms":
            values = np.sort([gap for r in ok for gap in r["itl_ms"]])
        else:
            values = np.sort([r[metric] for r in ok if r[metric] is not None])
        if values.size == 0:
            continue
        values = np.maximum(values, 1e-3)  # a log axis cannot show a zero gap (two chunks in one read)
        ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=_point_label(p))
        drawn = True
    ax.set_xlabel(f"{metric.removesuffix('_ms').upper()} (ms)")
    ax.set_ylabel("fraction of " + ("gaps" if metric == "itl_ms" else "requests"))
    ax.set_title(title)
    ax.grid(True, alpha=0.3, which="both")
    if drawn:
        ax.set_xscale("log")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    fig.savefig(path, dpi=120)
