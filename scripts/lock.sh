#!/usr/bin/env bash
# Re-resolve the two locks after a change to pyproject.toml's dependencies:
# * requirements.lock: the service's runtime dependencies, hashed; what the image and
#   scripts/demo.sh install.
# * requirements-dev.lock: the same runtime pins plus the test tools and the otlp-grpc extra,
#   hashed; what scripts/test.sh installs, so the tests run on the versions that ship.
# Pins already in a lock are kept while they still fit; `scripts/lock.sh --upgrade` moves
# everything to the newest releases. LOCK_DIR (default: the repository) is where both are read
# and written; tests/test_build.py re-resolves copies there to see the locks are current.
set -euo pipefail
cd "$(dirname "$0")/.."
# Paths without a leading "./" so the dev lock's "-c requirements.lock" annotations read the
# same whichever directory wrote them.
runtime_lock=${LOCK_DIR:+$LOCK_DIR/}requirements.lock
dev_lock=${LOCK_DIR:+$LOCK_DIR/}requirements-dev.lock
uv=.venv/bin/uv
"$uv" pip compile pyproject.toml --universal --python-version 3.11 --generate-hashes \
  --quiet --custom-compile-command scripts/lock.sh -o "$runtime_lock" "$@"
"$uv" pip compile pyproject.toml --extra test --extra otlp-grpc --constraint "$runtime_lock" \
  --universal --python-version 3.11 --generate-hashes \
  --quiet --custom-compile-command scripts/lock.sh -o "$dev_lock" "$@"
