#!/usr/bin/env bash
# Install (if needed) the toolkit with the test extras (dev, and liger and deepspeed, whose CPU tests run here) and run
# the whole test suite. Fast subset: scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,liger,deepspeed
. .venv/bin/activate
ruff check .
python -m pytest -q -ra --durations=15 "$@"
