#!/usr/bin/env bash
# The whole test suite: install, make sure the services answer, run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
scripts/ensure-services.sh
exec .venv/bin/python -m pytest "$@"
