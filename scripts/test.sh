#!/usr/bin/env bash
# The whole test suite: install, make sure the services answer, run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
scripts/ensure-services.sh
# Debian packages the tests run: docker-compose (tests/test_compose.py validates
# docker-compose.yml) and prometheus (tests/observability/: promtool checks the Prometheus config
# and alerts, and a real Prometheus scrapes a dispatcher). Installed when missing and root.
missing=()
command -v docker-compose >/dev/null || missing+=(docker-compose)
{ command -v promtool >/dev/null && command -v prometheus >/dev/null; } || missing+=(prometheus)
if [ "${#missing[@]}" -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
for tool in docker-compose promtool prometheus; do
  if ! command -v "$tool" >/dev/null; then
    echo "scripts/test.sh: $tool is missing; install the Debian packages: ${missing[*]}" >&2
    exit 1
  fi
done
if [ "$#" -eq 0 ]; then  # the full run also checks style and types; a focused run does not
  .venv/bin/ruff check --quiet .
  scripts/typecheck.sh
  scripts/lint-imports.sh
fi
exec .venv/bin/python -m pytest "$@"
