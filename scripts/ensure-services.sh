#!/usr/bin/env bash
# Start what the tests and the local run need, or fail loudly: MariaDB on 127.0.0.1:3306 and
# PostgreSQL on 127.0.0.1:5432, each started when it does not answer (as this machine kind
# installs them: mariadbd; Debian's postgresql-common clusters), then waited for.
set -euo pipefail

answers() {  # answers PORT: something accepts TCP connections on 127.0.0.1:PORT
  python3 - "$1" <<'PY' 2>/dev/null
import socket, sys
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1).close()
except OSError:
    sys.exit(1)
PY
}

wait_for() {  # wait_for NAME PORT: up to 60 s
  for _ in $(seq 1 120); do
    answers "$2" && return 0
    sleep 0.5
  done
  echo "error: $1 did not come up on 127.0.0.1:$2 within 60 s" >&2
  exit 1
}

if ! answers 3306; then
  echo "MariaDB is not answering on 127.0.0.1:3306; starting it" >&2
  if [ -x /usr/sbin/mariadbd ]; then
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
  else
    echo "error: MariaDB is not running and /usr/sbin/mariadbd is not installed" >&2
    exit 1
  fi
  wait_for MariaDB 3306
fi

if ! answers 5432; then
  echo "PostgreSQL is not answering on 127.0.0.1:5432; starting it" >&2
  if ! command -v pg_lsclusters >/dev/null || ! command -v pg_ctlcluster >/dev/null; then
    echo "error: PostgreSQL is not running and no cluster tools (pg_lsclusters, pg_ctlcluster) are installed" >&2
    exit 1
  fi
  # The cluster that listens on 5432 (version and name: the first two columns).
  cluster=$(pg_lsclusters --no-header | awk '$3 == 5432 {print $1, $2; exit}')
  if [ -z "$cluster" ]; then
    echo "error: PostgreSQL is not running and no cluster is set up on port 5432 (pg_lsclusters)" >&2
    exit 1
  fi
  # shellcheck disable=SC2086  # "version name": two arguments
  if ! pg_ctlcluster $cluster start; then
    echo "error: pg_ctlcluster $cluster start failed; see its log (pg_lsclusters names it)" >&2
    exit 1
  fi
  wait_for PostgreSQL 5432
fi
