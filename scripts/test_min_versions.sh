#!/usr/bin/env bash
# The fast test suite (-m "not slow") against the lowest versions pyproject.toml allows of transformers, accelerate,
# peft, datasets and deepspeed, in a virtual environment of its own (.venv-min, or $MIN_VENV; the project's .venv is
# not touched). CI runs it after scripts/test.sh (.ci/run). Extra arguments go to pytest.
#
# torch is the one package not at its floor: CI installs the CPU build of torch==2.13.0, the only CPU build at hand
# (every other torch version on the package index is a multi-GB CUDA build). So torch's floor (>=2.6: FSDP2's
# fully_shard, sdpa's enable_gqa) is checked by reading the code, not by this run; the other five floors are run.
# Liger (an optional extra) is left out: its tests skip.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MIN_VENV:-.venv-min}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
# "name>=X" of the five packages in [project].dependencies, as "name==X"
floors=$(python - <<'PYEOF'
import re
import tomllib

deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
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
python -m pip install -q -e ".[dev]" $floors
python -m pip list 2>/dev/null | grep -iE '^(torch|transformers|accelerate|peft|datasets|deepspeed) '
python -m pytest -q -ra -p no:cacheprovider -m "not slow" "$@"
