#!/usr/bin/env bash
# The whole test suite: install, make sure the services answer, run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
scripts/ensure-services.sh
# tests/test_compose.py validates docker-compose.yml with the Debian package docker-compose.
if ! command -v docker-compose >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && apt-get install -y -qq docker-compose >/dev/null
fi
if [ "$#" -eq 0 ]; then  # the full run also checks style and types; a focused run does not
  .venv/bin/ruff check --quiet .
  scripts/typecheck.sh
fi
exec .venv/bin/python -m pytest "$@"
