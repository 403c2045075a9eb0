#!/usr/bin/env bash
# import-linter's contracts (pyproject.toml [tool.importlinter]) on the package as installed:
# core/ as room_outbox with plugins/ inside it as room_outbox.plugins. The package-dir mapping
# is invisible to the import graph's file walk, so check a copy shaped like the installed package.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
cp -r core "$tree/room_outbox"
cp -r plugins "$tree/room_outbox/plugins"
find "$tree" -name __pycache__ -prune -exec rm -rf {} +
root=$PWD
cd "$tree" && PYTHONPATH="$tree" "$root/.venv/bin/lint-imports" "$root/pyproject.toml" --no-cache --no-logo "$@"
