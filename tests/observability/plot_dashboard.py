"""The picture in docs/how-to/monitor.md: the dashboard's main panels drawn from Prometheus range queries.

Used by test_prometheus_scrape.py when ROOM_OUTBOX_DASHBOARD_PNG is set
(scripts/dashboard-picture.sh); matplotlib is installed for that run only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from observability_stack import dashboards

#: The panels shown, in the dashboard's order.
MAIN_PANELS = (
    "Backlog per lane",
    "Oldest pending age",
    "Deliveries per second by sink",
    "Failures per second by sink and error class",
    "Delivery duration percentiles",
    "Lost leases",
)


def legend(template: str, labels: dict[str, str]) -> str:
    """Grafana's legendFormat: ``{{name}}`` replaced by the series' label (empty if absent)."""
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template).strip()
    return text or "total"


def draw(results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """``results``: query source ("panel 'Title' A") -> Prometheus range-query result."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (dashboard,) = dashboards().values()
    panels = {p["title"]: p for p in dashboard["panels"]}
    figure, axes = plt.subplots(3, 2, figsize=(13, 10), constrained_layout=True)
    start = min((float(v[0][0]) for r in results.values() for s in r for v in [s["values"]] if v), default=0.0)
    for ax, title in zip(axes.flat, MAIN_PANELS, strict=True):
        panel = panels[title]
        for target in panel["targets"]:
            for series in results.get(f"panel {title!r} {target['refId']}", []):
                xs = [float(t) - start for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                ax.plot(xs, ys, linewidth=1.4, label=legend(target["legendFormat"], series["metric"]))
        unit = panel["fieldConfig"]["defaults"].get("unit", "")
        ax.set_title(title, fontsize=11, loc="left")
        ax.set_ylabel({"ms": "ms", "ops": "per second"}.get(unit, ""))
        ax.set_xlabel("seconds")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    figure.suptitle("room-outbox dashboard: a dispatcher under load, an IM outage and its recovery", fontsize=12)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)
