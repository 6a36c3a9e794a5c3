#!/usr/bin/env bash
# Create .venv (if missing) and install the toolkit into it (editable), with the extras named (comma-separated, as
# in pyproject.toml): `bash scripts/setup.sh` is the lean install the demo needs; scripts/test.sh asks for
# dev,liger,deepspeed,bench,browser,rl,video. Idempotent: a second call adds what is missing.
# torch is installed first and explicitly: without a pin, pip picks a multi-GB CUDA build even on CPU machines.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${1:-}
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q torch            # CUDA build for GPU machines
  else
    python -m pip install -q "torch==2.13.0"  # CPU build
  fi
fi
if [[ ",$EXTRAS," == *",deepspeed,"* ]]; then
  # DeepSpeed's build imports torch to decide which ops to prebuild: build it against the torch just installed.
  python -m pip install -q --no-build-isolation "deepspeed>=0.19.3; sys_platform == 'linux'"
fi
python -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
