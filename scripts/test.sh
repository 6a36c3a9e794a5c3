#!/usr/bin/env bash
# Install (if needed) and run the whole test suite. Fast subset: scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
python -m pytest -q -ra --durations=15 "$@"
