#!/usr/bin/env bash
# mypy --strict on core/ and plugins/. The package-dir mapping (core/ -> room_outbox,
# plugins/ -> room_outbox.plugins) is invisible to mypy, so check a linked tree shaped like
# the installed package.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/room_outbox"
for entry in core/*; do ln -s "$PWD/$entry" "$tree/room_outbox/$(basename "$entry")"; done
ln -s "$PWD/plugins" "$tree/room_outbox/plugins"
cd "$tree" && "$OLDPWD/.venv/bin/mypy" --config-file "$OLDPWD/pyproject.toml" --follow-imports=silent -p room_outbox
