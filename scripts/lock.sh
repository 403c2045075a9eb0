#!/usr/bin/env bash
# Re-resolve requirements.lock (the image's exact runtime dependencies, with hashes) after a
# change to pyproject.toml's dependencies. Pins already in the lock are kept while they still
# fit; `scripts/lock.sh --upgrade` moves everything to the newest releases.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/uv pip compile pyproject.toml --universal --python-version 3.11 --generate-hashes \
  --quiet --custom-compile-command scripts/lock.sh -o requirements.lock "$@"
