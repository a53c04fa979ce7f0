"""Render deploy/grafana/brisk.json's panels with matplotlib from Prometheus range-query results.

Grafana itself does not run where brisk is tested; this draws the same queries (the dashboard's own PromQL,
Grafana's variables substituted) so docs/observability.md can show what the dashboard shows. Used by
tests/test_observability.py, which queries a real Prometheus that scraped a live `brisk serve`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# Grafana's built-in variables, as the test's Prometheus (1 s scrapes) would get them.
GRAFANA_VARIABLES = {"$__rate_interval": "5s", "$model": ".*", "${model}": ".*"}


def promql(expr: str, variables: dict[str, str] | None = None) -> str:
    """A panel's expression with Grafana's variables replaced, ready for Prometheus' API."""
    for name, value in (variables or GRAFANA_VARIABLES).items():
        expr = expr.replace(name, value)
    return expr


def legend(template: str, labels: dict[str, str]) -> str:
    for key, value in labels.items():
        template = template.replace("{{" + key + "}}", value)
    return template


def render(dashboard: dict[str, Any], results: dict[tuple[int, str], list[dict]], path: Path, t0: float) -> None:
    """`results[(panel id, refId)]`: Prometheus `matrix` results; one subplot a panel, seconds since `t0`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = dashboard["panels"]
    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(15, 3.2 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        unit = panel["fieldConfig"]["defaults"].get("unit", "")
        for target in panel["targets"]:
            for series in results.get((panel["id"], target["refId"]), []):
                points = [(float(t) - t0, float(v)) for t, v in series["values"] if math.isfinite(float(v))]
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, label=legend(target.get("legendFormat", ""), series["metric"]) or None)
        ax.set_title(panel["title"], fontsize=10)
        ax.set_xlabel("seconds", fontsize=8)
        if unit == "percentunit":
            ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        elif unit == "s":
            ax.set_ylabel("seconds", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"{dashboard['title']} dashboard (rendered from Prometheus by matplotlib)", fontsize=12)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
