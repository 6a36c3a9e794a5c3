#!/usr/bin/env bash
# One command for a lent GPU: the whole Qwen3-8B LoRA measurement of issue 34, recorded in one go.
#
#   bash bench/run_gpu_session.sh [OUT]            # OUT defaults to bench/results; on a lent machine pass $OUT
#   BENCH=grpo bash bench/run_gpu_session.sh [OUT] # issue 49: the grpo row (Qwen3-8B LoRA, rollout + training)
#   BENCH=vl bash bench/run_gpu_session.sh [OUT]   # issue 50: Qwen2.5-VL-7B LoRA on video rows
#
# Runs bench/gpu_qwen3_8b.py once with every row (the default and each lever on and off, the default with the
# micro-batch copies in turn, whose loss must agree: the prefetch stream's event wait; the checkpointed row;
# rows that cannot run here are skipped with why), profiled (the idle share), and writes into OUT/<date>-<gpu>/:
#   gpu8b.json / gpu8b.md   the bench's summary and table (bench/gpu_qwen3_8b.py)
#   session.json            date, GPU, driver, CUDA, the Python packages that shape the numbers, the command
#   bench.log               the bench's stderr (every row's progress, the losses check)
#   rows-so-far.json        only when the bench was cut off: the rows it finished (rows-so-far-vl.json for BENCH=vl)
#   session-grpo.json, session-vl.json   the same as session.json, for BENCH=grpo and BENCH=vl
# Sized for the 10-minute limit of one device command: about a minute to write the random weights, then per row
# about 40 s to start and load them and 3 + 6 + 2 optimizer steps of 2 x 4096 tokens (the compile row pays its
# compilation in the warm-up); the skipped rows cost nothing. Give the command a 600 s timeout. BENCH_STEPS,
# BENCH_WARMUP and BENCH_ROWS override the defaults; BENCH_EXTRA adds bench options (`--tiny --peak-tflops 1`
# checks the script on a CPU). The long rows of issue 33 (4k, 16k and 32k-token packed rows, checkpointed, with
# preflight's estimate of each peak) are a second command: BENCH_ROWS="grad_ckpt long16k long32k" bash ...
#
# BENCH=grpo and BENCH=vl are each a command of their own (each well inside the 10-minute limit, 600 s timeout):
#   grpo  bench/gpu_qwen3_8b.py --variants grpo, not profiled: about a minute to write the random Qwen3-8B, 40 s to
#         load it, then 1 + 3 optimizer steps (BENCH_WARMUP, BENCH_STEPS), each drawing 8 completions of 4 prompts
#         up to 256 tokens (one generate call of 8 sequences per prompt, with the KV cache: about 256 decode steps
#         of the 8B model each, some 5-10 s) and training on the 32 sequences: about 3-4 minutes in all. Writes
#         gpu8b-grpo.json / .md and gpu8b-grpo.log.
#   vl    bench/gpu_qwen2_5_vl.py, rows frames8 and frames32: about 1.5 minutes to write the random Qwen2.5-VL-7B,
#         then per row 40 s to load it and decode 18 videos of 16 s (448x336) into the frame store, and 2 + 5 steps
#         of 2 rows of about 800 and 3100 tokens: about 4 minutes in all. Writes gpuvl.json / .md and gpuvl.log.
set -uo pipefail

cd "$(dirname "$0")/.."
out_root=${1:-bench/results}
bench=${BENCH:-levers}
case "$bench" in
    levers) script=bench/gpu_qwen3_8b.py; tag=gpu8b; log=bench.log; profile=--profile
            steps=${BENCH_STEPS:-6}; warmup=${BENCH_WARMUP:-3}
            rows=${BENCH_ROWS:-default no_overlap compile lora_fused_on lora_fused_off micro2 grad_ckpt fa4} ;;
    grpo)   script=bench/gpu_qwen3_8b.py; tag=gpu8b-grpo; log=gpu8b-grpo.log; profile=
            steps=${BENCH_STEPS:-3}; warmup=${BENCH_WARMUP:-1}; rows=${BENCH_ROWS:-grpo} ;;
    vl)     script=bench/gpu_qwen2_5_vl.py; tag=gpuvl; log=gpuvl.log; profile=
            steps=${BENCH_STEPS:-5}; warmup=${BENCH_WARMUP:-2}; rows=${BENCH_ROWS:-frames8 frames32} ;;
    *)      echo "error: BENCH=$bench: the benches are levers (the default), grpo and vl." >&2; exit 2 ;;
esac
extra=${BENCH_EXTRA:-}
python=${PYTHON:-python}

gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr ' ' '-' | tr -cd '[:alnum:]-')
dir="$out_root/$(date -u +%Y-%m-%d)-${gpu:-nogpu}"
mkdir -p "$dir"

"$python" - "$dir/session${BENCH:+-$bench}.json" "$steps" "$warmup" "$rows" "$extra" "$script" "$profile" <<'EOF'
import datetime, importlib.metadata, json, platform, subprocess, sys

def version(pkg):
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None

def smi(query):
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None

import torch
path, steps, warmup, rows, extra, script, profile = sys.argv[1:]
info = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": smi("name"), "driver": smi("driver_version"), "gpu_memory": smi("memory.total"),
        "cuda": torch.version.cuda, "python": platform.python_version(), "platform": platform.platform(),
        "packages": {p: version(p) for p in ("torch", "transformers", "accelerate", "peft", "liger-kernel", "triton",
                                                "flash-attn", "flash-attn-4", "curriculum-toolkit")},
        "command": f"{script} --warmup {warmup} --steps {steps} {profile} --variants {rows} {extra}"}
open(path, "w").write(json.dumps(info, indent=2))
print(json.dumps(info), file=sys.stderr)
EOF

# shellcheck disable=SC2086  # profile, rows and extra are lists of words
"$python" "$script" --warmup "$warmup" --steps "$steps" $profile --variants $rows --out "$dir" $extra \
    > /dev/null 2> "$dir/$log"
status=$?
prefix=${tag%%-*}  # the bench names its files <date>-<host>-gpu8b[-tiny].* or <date>-<host>-gpuvl[-tiny].*
for f in "$dir"/*-"$prefix".json "$dir"/*-"$prefix".md "$dir"/*-"$prefix"-tiny.json "$dir"/*-"$prefix"-tiny.md; do
    [ -e "$f" ] && mv "$f" "$dir/$tag.${f##*.}"
done
tail -n 20 "$dir/$log"
echo "bench exit $status; results in $dir" >&2
exit $status
