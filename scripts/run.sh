#!/usr/bin/env bash
# The main job: install, make sure MariaDB answers, migrate, run the dispatcher with
# config/config.yaml against the local MariaDB until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
scripts/ensure-services.sh
export ROOM_OUTBOX_CONFIG="${ROOM_OUTBOX_CONFIG:-config/config.yaml}"
.venv/bin/room-outbox migrate
exec .venv/bin/room-outbox run "$@"
