#!/usr/bin/env bash
# Redraw docs/dashboard.png, the picture in docs/how-to/monitor.md of the Grafana dashboard's main panels: the
# Prometheus test (tests/observability/) runs a dispatcher under load through an IM outage and
# its recovery, then plots the panels' queries from Prometheus's range API with matplotlib
# (installed into .venv for this only; it is no dependency of room-outbox).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
.venv/bin/python -m pip install --quiet --disable-pip-version-check matplotlib
ROOM_OUTBOX_DASHBOARD_PNG="$PWD/docs/dashboard.png" \
  .venv/bin/python -m pytest -q -x --timeout=900 tests/observability/test_prometheus_scrape.py
echo "wrote docs/dashboard.png"
