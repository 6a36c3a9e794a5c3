#!/usr/bin/env bash
# Install (if needed) the toolkit with the test extras (dev; liger and deepspeed, whose CPU tests run here; bench and
# browser: TRL and Playwright, for the preference and report page tests; rl: math-verify, for the math reward;
# video: PyAV, for video rows), ruff,
# then the whole test suite in two pytest runs: the fast tests (not marked slow) on both cores (pytest-xdist, -n 2),
# then the slow ones one at a time (each launches 2 processes: two launches at once would oversubscribe 2 cores and
# run into their timeouts). Arguments go to both runs; a `-m EXPR` of yours is combined with each run's own. Fast
# subset: scripts/test.sh -m "not slow". The exit code is the failing run's (5 when neither selected a test); a last
# line sums both runs (errors counted as failures).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,liger,deepspeed,bench,browser,rl,video
. .venv/bin/activate
ruff check .

marker="" args=()
while [ "$#" -gt 0 ]; do
  case "$1" in
    -m) marker="$2"; shift 2 ;;
    -m*) marker="${1#-m}"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
within() { if [ -n "$marker" ]; then echo "($marker) and ($1)"; else echo "$1"; fi; }
reports=$(mktemp -d)
trap 'rm -rf "$reports"' EXIT
# DeepSpeed JIT-builds its CPU ops (CPU Adam for optimizer offload; the shared-memory comm op of every launch) into
# torch's extensions folder the first time a launch needs them, while that launch waits: CPU Adam is 70-90 s of both
# cores on a fresh machine (CI's first offload launch took 91-116 s, the other launches of its test under 32 s), the
# comm op about 40. When the slow tests will run, both are built in the background during the fast ones, at a low
# CPU priority (below the tests, above the floors' install in .ci/run): the build takes the cycles the fast tests
# leave idle (none of them loads either op). The slow run starts once it is done, so no launch under a timeout waits
# on a low-priority build; an op that failed to build here is built again (and reported) by the first launch that
# needs it.
ops=""
if [ "$marker" != "not slow" ]; then
  nice -n 15 python - > "$reports/ops.log" 2>&1 <<'PYEOF' &
import importlib.util

if importlib.util.find_spec("deepspeed") is not None:  # setup.sh installs it on Linux only
    from deepspeed.comm.torch import build_shm_op  # as every DeepSpeed launch's comm backend loads it
    from deepspeed.ops.op_builder import CPUAdamBuilder  # as DeepSpeedCPUAdam loads it

    CPUAdamBuilder().load()
    build_shm_op()
PYEOF
  ops=$!
fi
run() {  # run NAME MARKER [pytest options]: the run's exit code goes to $reports/NAME.rc
  local name=$1 selected=$2 rc=0
  shift 2
  echo "== $name tests: -m \"$selected\""
  python -m pytest -q -ra --durations=15 -m "$selected" --junitxml="$reports/$name.xml" "$@" ${args[@]+"${args[@]}"} \
    || rc=$?
  echo "$rc" > "$reports/$name.rc"
}
# -n 2 is one worker per core; xdist's workers each run torch on one thread (tests/conftest.py)
echo 5 > "$reports/fast.rc"
echo 5 > "$reports/slow.rc"
[ "$marker" = slow ] || run fast "$(within "not slow")" -n 2
if [ -n "$ops" ]; then
  # Still building: it may now run at this script's own priority (if allowed: renice needs the right to raise one),
  # so the wait costs no more than the build inside the first launch did.
  tree() { local p; for p in $(pgrep -P "$1"); do echo "$p"; tree "$p"; done; }
  # shellcheck disable=SC2046
  renice -n "$(nice)" -p "$ops" $(tree "$ops") > /dev/null 2>&1 || true
  waited=$SECONDS
  if wait "$ops"; then
    echo "== DeepSpeed's CPU ops are built (waited $((SECONDS - waited)) s for them after the fast tests)"
  else
    tail -n 5 "$reports/ops.log"
    echo "== DeepSpeed's CPU ops did not build (above): the first launch that needs one builds it"
  fi
fi
[ "$marker" = "not slow" ] || run slow "$(within "slow")"
python - "$reports" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

totals = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
for xml in Path(sys.argv[1]).glob("*.xml"):
    for suite in ET.parse(xml).getroot().iter("testsuite"):
        for k in totals:
            totals[k] += int(suite.get(k, 0))
passed = totals["tests"] - totals["failures"] - totals["errors"] - totals["skipped"]
print(f"tests: {passed} passed, {totals['failures'] + totals['errors']} failed, {totals['skipped']} skipped")
PYEOF
fast=$(cat "$reports/fast.rc") slow=$(cat "$reports/slow.rc")
for rc in "$fast" "$slow"; do
  if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then exit "$rc"; fi
done
if [ "$fast" = 5 ] && [ "$slow" = 5 ]; then exit 5; fi
exit 0
