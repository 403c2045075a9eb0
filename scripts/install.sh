#!/usr/bin/env bash
# Create .venv (if missing) and install room-outbox with its test extras into it, plus the
# example third-party sink (examples/audit_sink) and consumer handler (examples/gift_stats), which the
# tests install through their entry points.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]' -e examples/audit_sink -e examples/gift_stats
