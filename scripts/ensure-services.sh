#!/usr/bin/env bash
# Start what the tests and the local run need, or fail loudly. MariaDB: started when it does
# not answer on 127.0.0.1:3306 (as this machine kind starts it), then waited for.
set -euo pipefail

mariadb_answers() {
  python3 - <<'PY' 2>/dev/null
import socket, sys
try:
    socket.create_connection(("127.0.0.1", 3306), timeout=1).close()
except OSError:
    sys.exit(1)
PY
}

if ! mariadb_answers; then
  echo "MariaDB is not answering on 127.0.0.1:3306; starting it" >&2
  if [ -x /usr/sbin/mariadbd ]; then
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
  else
    echo "error: MariaDB is not running and /usr/sbin/mariadbd is not installed" >&2
    exit 1
  fi
  for _ in $(seq 1 120); do
    mariadb_answers && break
    sleep 0.5
  done
  if ! mariadb_answers; then
    echo "error: MariaDB did not come up on 127.0.0.1:3306 within 60 s" >&2
    exit 1
  fi
fi
