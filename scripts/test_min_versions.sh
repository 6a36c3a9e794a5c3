#!/usr/bin/env bash
# Tests at the lowest versions pyproject.toml allows of transformers, accelerate, peft, datasets and deepspeed, in a
# virtual environment of its own (.venv-min, or $MIN_VENV; the project's .venv is not touched). CI runs it after
# scripts/test.sh (.ci/run). Extra arguments go to pytest (they replace the subset below); `--install-only` (alone)
# builds the environment and stops (CI builds it while the main suite runs; a second call finds it done).
#
# A representative subset, not the fast suite: the whole CI must stay under 45 minutes on 2 cores (it took about 32
# on 2026-11-29, the main suite 29 of them; 49 before the fast tests ran on both cores), the install here about 7
# (torch, a DeepSpeed build; beside the main suite) and the fast suite at these versions would add several more. The
# subset (under a minute, on both cores) runs the code that touches the APIs the floors were set for:
#   transformers >= 5.18  the attention and mask interfaces (q_length/q_offset) of the packed kernels
#                         (test_attention); the Qwen2.5-VL processor, row encoding and labels (test_vision: 5.4-5.17
#                         fail there); generate with left padding under the toolkit's kernels, the loss head and a
#                         LoRA adapter, and with images (test_generation)
#   peft >= 0.18          LoRA under the loss head, including PEFT < 0.21 calling model.forward directly
#                         (test_loss_head); the adapters' input-cast switch over a bf16 base (test_activation_memory)
#   accelerate >= 1.12    the single-process training loop in-process (test_loop); Ulysses sequence parallelism
#                         (parallelism_config sp_size): the launch refusals and batch slicing in-process
#                         (test_sequence_parallel); the 2-process Ulysses launch (test_strategies.py::
#                         test_sequence_parallel_splits_each_row_and_matches_single_process: passed at these floors
#                         on 2026-11-26) is not in the subset (a DeepSpeed launch here costs minutes: see deepspeed
#                         below; pass its id to this script to run it)
#   deepspeed >= 0.19.3   installed and imported, not launched: a 2-process ZeRO-3 launch costs 3 minutes here
#                         (test_vision's mixed batches, ZeRO-3 + LoRA: passed at these floors on 2026-11-24; to
#                         run it, pass "tests/data/test_vision.py::test_mixed_batches_across_ranks_do_not_hang[zero3]"
#                         to this script), and the fix the floor is for (ZeRO-3 + LoRA + non-reentrant checkpointing) is
#                         the release's, not shown by any fast test
#   datasets >= 3.0       the toolkit does not import it (bench/throughput.py does, through TRL): installed at its
#                         floor so the environment resolves
#
# torch is the one package not at its floor: CI installs the CPU build of torch==2.13.0, the only CPU build at hand
# (every other torch version on the package index is a multi-GB CUDA build). So torch's floor (>=2.6: FSDP2's
# fully_shard, sdpa's enable_gqa) is checked by reading the code, not by this run.
# Liger (an optional extra) is left out: its tests skip.
# Nothing here skips quietly: a failed install, a version other than the floor, or a failing test ends the script
# (and CI) with a non-zero exit.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MIN_VENV:-.venv-min}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# DeepSpeed JIT-builds its CPU ops (cpu_adam, shm_comm) into torch's extensions folder, shared by default: an older
# DeepSpeed's build there would be loaded by the main environment's newer DeepSpeed (seen: "deepspeed_shm_comm has
# no attribute vector_kernel_level" in launches running beside this script). This environment builds into its own.
export TORCH_EXTENSIONS_DIR="$(cd "$VENV" && pwd)/torch_extensions"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
# "name>=X" of the five packages in [project].dependencies (DeepSpeed: its extra), as "name==X"
floors=$(python - <<'PYEOF'
import re
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = project["dependencies"] + project["optional-dependencies"]["deepspeed"]  # DeepSpeed: an extra
wanted = {"transformers", "accelerate", "peft", "datasets", "deepspeed"}
pins = [f"{m[1]}=={m[2]}" for d in deps if (m := re.match(r"([\w.-]+)>=([\d.]+)", d.split(";")[0].strip()))
        and m[1] in wanted]
assert len(pins) == len(wanted), f"a floor is missing from pyproject.toml: {pins}"
print(" ".join(pins))
PYEOF
)
echo "lowest versions: torch==2.13.0 (CPU; see above) $floors"
python -m pip install -q "torch==2.13.0"
deepspeed_pin=$(tr ' ' '\n' <<< "$floors" | grep '^deepspeed==')
# DeepSpeed's build imports torch to decide which ops to prebuild: build it against the torch just installed.
python -m pip install -q --no-build-isolation "$deepspeed_pin"
python -m pip install -q -e ".[dev,video]" $floors
# The versions that will run, checked against the floors (pip could have resolved another one).
python - "$floors" <<'PYEOF'
import sys
from importlib.metadata import version

from packaging.version import Version

wrong = [f"{pin} (installed {version(name)})" for pin in sys.argv[1].split()
         for name, want in [pin.split("==")] if Version(version(name)) != Version(want)]
print("installed:", ", ".join(f"{n} {version(n)}" for n in ("torch", *(p.split("==")[0] for p in sys.argv[1].split()))))
if wrong:
    sys.exit(f"error: not at the floor: {', '.join(wrong)}")
PYEOF
echo "install: ${SECONDS}s"
if [ "${1:-}" = "--install-only" ]; then
  exit 0
fi
if [ "$#" -eq 0 ]; then
  set -- tests/model/test_attention.py tests/data/test_vision.py tests/evals/test_generation.py tests/model/test_loss_head.py \
    tests/model/test_activation_memory.py tests/train/test_loop.py tests/strategies/test_sequence_parallel.py -m "not slow" \
    -n 2  # on both cores, as scripts/test.sh runs the fast tests
fi
started=$SECONDS
python -m pytest -q -ra -p no:cacheprovider "$@"
echo "tests: $((SECONDS - started))s"
