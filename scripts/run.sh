#!/usr/bin/env bash
# The main job: install, make sure MariaDB answers, migrate, run the dispatcher with
# config/config.yaml against the local MariaDB until Ctrl-C. That config sends IM events to the
# fake Tencent IM on 127.0.0.1:8090: when nothing answers there, it is started here and stopped
# on exit. Another config (ROOM_OUTBOX_CONFIG) names its own IM endpoint: nothing is started.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --runtime
scripts/ensure-services.sh
export ROOM_OUTBOX_CONFIG="${ROOM_OUTBOX_CONFIG:-config/config.yaml}"
.venv/bin/room-outbox migrate
if [ "$ROOM_OUTBOX_CONFIG" = config/config.yaml ] && ! (exec 3<>/dev/tcp/127.0.0.1/8090) 2>/dev/null; then
  echo "scripts/run.sh: starting the fake Tencent IM that config/config.yaml points at (room-outbox fake-im --port 8090)" >&2
  .venv/bin/room-outbox fake-im --port 8090 &
  fake=$!
  trap 'kill "$fake" 2>/dev/null || true' EXIT
fi
# Not exec: the trap above stops the fake IM when the dispatcher ends. SIGTERM/SIGINT sent to
# this script go on to the dispatcher, which ends cleanly.
.venv/bin/room-outbox run "$@" &
dispatcher=$!
trap 'kill -TERM "$dispatcher" 2>/dev/null || true' TERM INT
# A signal ends the first wait early (status > 128) while the dispatcher drains: the second
# wait gives the dispatcher's own exit status.
status=0
wait "$dispatcher" || status=$?
if [ "$status" -gt 128 ]; then
  status=0
  wait "$dispatcher" || status=$?
fi
exit "$status"
