#!/usr/bin/env bash
# Install (if needed) and train the embedded default: a tiny local Qwen3, dummy data, a 2-stage curriculum.
# Runs on whatever is there (GPU or CPU) in about a minute; extra arguments are recipe overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
accelerate launch --config_file accelerate_configs/single.yaml --mixed_precision no \
  train_curriculum.py logging.progress_bar=false "$@"
