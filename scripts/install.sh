#!/usr/bin/env bash
# Create .venv (if missing) and install room-outbox with its test extras into it, plus the
# example third-party sink (examples/audit_sink) and consumer handler (examples/gift_stats), which the
# tests install through their entry points.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# The installs are editable, so a code change needs none; what they install is decided by the
# three pyproject.toml files alone. pip takes about 20 s to find nothing to do, so it runs only
# when those files differ from the ones of the last install into this .venv.
stamp=.venv/installed-from.sha256
wanted=$(cat pyproject.toml examples/audit_sink/pyproject.toml examples/gift_stats/pyproject.toml | sha256sum)
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]' -e examples/audit_sink -e examples/gift_stats
  echo "$wanted" > "$stamp"
fi
