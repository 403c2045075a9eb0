#!/usr/bin/env bash
# The first command: install into .venv, then run `room-outbox demo` — SQLite in a temporary
# folder and the fake Tencent IM in-process, so no service is needed. Arguments go to the demo
# (scripts/demo.sh --events 1000 --failure-rate 0.5; --help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --runtime
exec .venv/bin/room-outbox demo "$@"
