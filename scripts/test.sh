#!/usr/bin/env bash
# The whole test suite: install, make sure the services answer, run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
scripts/ensure-services.sh
# Debian packages the tests run: docker-compose (tests/test_compose.py validates
# docker-compose.yml), prometheus (tests/observability/: promtool checks the Prometheus config
# and alerts, and a real Prometheus scrapes a dispatcher), faketime (tests/faults/: processes
# whose clocks are off the database's), pgbouncer (tests/store/test_pgbouncer.py: PostgreSQL
# reached through it) and systemd (tests/observability/test_systemd.py: systemd-analyze reads the
# shipped unit file). Installed when missing and root.
missing=()
command -v docker-compose >/dev/null || missing+=(docker-compose)
{ command -v promtool >/dev/null && command -v prometheus >/dev/null; } || missing+=(prometheus)
command -v faketime >/dev/null || missing+=(faketime)
PATH="$PATH:/usr/sbin" command -v pgbouncer >/dev/null || missing+=(pgbouncer)
command -v systemd-analyze >/dev/null || missing+=(systemd)
if [ "${#missing[@]}" -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
for tool in docker-compose promtool prometheus faketime pgbouncer systemd-analyze; do
  if ! PATH="$PATH:/usr/sbin" command -v "$tool" >/dev/null; then
    echo "scripts/test.sh: $tool is missing; install the Debian packages: ${missing[*]}" >&2
    exit 1
  fi
done
# Each pytest run has an outer deadline besides the per-test timeout: at it, SIGABRT makes
# pytest's faulthandler print every thread's stack, and the run fails instead of stalling CI.
PYTEST_DEADLINE=${PYTEST_DEADLINE:-1800}
pytest_within() {
  timeout --signal=ABRT --kill-after=30 "$PYTEST_DEADLINE" .venv/bin/python -m pytest "$@"
}
if [ "$#" -gt 0 ]; then  # a focused run: pytest with these arguments, nothing else
  pytest_within "$@"
  exit
fi
# The full run has three parts, all of which always run; it fails when any does:
# 1. style, types, the import contracts and the docs site (mkdocs build --strict, into a
#    temporary folder), in the background beside part 2 (their output is printed when they end);
# 2. every test not marked serial, on two worker processes (most of a test's time is spent
#    waiting on real servers and processes);
# 3. the serial tests alone, once 1 and 2 have ended, so that their elapsed-time and rate bounds
#    hold as when every test ran one at a time.
checks_log=$(mktemp)
site=$(mktemp -d)
trap 'rm -rf "$checks_log" "$site"' EXIT
{ .venv/bin/ruff check --quiet . && .venv/bin/ruff format --check --quiet . && scripts/typecheck.sh && scripts/lint-imports.sh \
  && .venv/bin/mkdocs build --strict --quiet --site-dir "$site"; } >"$checks_log" 2>&1 &
checks=$!
status=0
pytest_within --numprocesses 2 -m "not serial" || status=$?
if ! wait "$checks"; then
  status=1
  echo "scripts/test.sh: the style, type, import-contract or docs-site checks failed:" >&2
fi
cat "$checks_log"
pytest_within -m serial || status=$?
exit "$status"
