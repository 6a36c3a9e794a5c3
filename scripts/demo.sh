#!/usr/bin/env bash
# Install (if needed: the lean install, no test or optional extras) and train the embedded default: a tiny local
# Qwen3, dummy data, a 2-stage curriculum, through `toolkit train` (it prints the accelerate launch line it runs).
# Runs on whatever is there (GPU or CPU) in about a minute; extra arguments are recipe overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
toolkit train --accelerate-config single logging.progress_bar=false "$@" -- --mixed_precision no
