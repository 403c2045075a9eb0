#!/usr/bin/env bash
# Create .venv (if missing) and install room-outbox into it from a lock, hash-checked:
# * `scripts/install.sh --runtime` (scripts/demo.sh): the service's dependencies only,
#   requirements.lock, as the image installs them;
# * `scripts/install.sh` (scripts/test.sh): requirements-dev.lock (the same runtime pins plus the
#   test tools), and the example third-party sink (examples/audit_sink) and consumer handler
#   (examples/gift_stats), which the tests install through their entry points.
# The installs are editable, so a code change needs none. Nothing is resolved here: a change of
# dependencies goes through pyproject.toml and scripts/lock.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
lock=requirements-dev.lock
examples=(-e examples/audit_sink -e examples/gift_stats)
if [ "${1:-}" = "--runtime" ]; then
  lock=requirements.lock
  examples=()
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# pip takes seconds to find nothing to do, so it runs only when the lock or the packages'
# pyproject.toml files differ from those of the last install into this .venv. A dev install
# holds every runtime pin, so it serves the demo too.
stamp=.venv/installed-from.sha256
wanted=$(cat "$lock" pyproject.toml examples/audit_sink/pyproject.toml examples/gift_stats/pyproject.toml | sha256sum)
dev_wanted=$(cat requirements-dev.lock pyproject.toml examples/audit_sink/pyproject.toml examples/gift_stats/pyproject.toml | sha256sum)
installed=$(cat "$stamp" 2>/dev/null || true)
if [ "$installed" != "$wanted" ] && [ "$installed" != "$dev_wanted" ]; then
  pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
  "${pip[@]}" --require-hashes --no-deps -r "$lock"
  "${pip[@]}" --no-deps -e . "${examples[@]}"
  echo "$wanted" > "$stamp"
fi
# An editable install leaves the package's own modules uncompiled, and where bytecode is not
# written (PYTHONDONTWRITEBYTECODE, as in the image) every process would compile them again at
# start. Compiled here, as pip does for the image's install: the tests' and the benchmark's
# processes start as the image's do. Only what changed since is compiled again.
.venv/bin/python -m compileall -q core plugins examples
