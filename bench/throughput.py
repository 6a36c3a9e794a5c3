"""Training throughput of the toolkit against a bare accelerate loop and TRL, in one command on one machine.

    python bench/throughput.py [--quick] [--steps N] [--out bench/results]

Why: the toolkit claims (1) at most 3% overhead over a hand-written loop on identical batches, (2) padding-free
packing with at most 2% padding, (3) >= 1.3x TRL's default SFTTrainer and (4) >= 1.0x TRL with packing. This
script measures all of it with the same random-weight Qwen3, the same seeded chat data, the same LoRA config and
the same effective batch for every contender, prints a JSON summary and writes
`<out>/<YYYY-MM-DD>-<hostname>[-quick].json`. Targets are reported (met / not met), never asserted.

Contenders (each in its own fresh worker process: accelerate's state is a process-wide singleton, and a fresh
process gives every contender its own peak-memory high-water mark):
  bare            (a) plain accelerate loop over the identical pre-collated padded batches the toolkit uses
  toolkit         (b) train_curriculum.py under `accelerate launch`, no packing
  toolkit_packed  (c) train_curriculum.py with data.packing=true
  trl             (d) TRL SFTTrainer, defaults (padded batches), same batches as (a) and (b)
  trl_packed      (e) TRL SFTTrainer with packing=True (best-fit decreasing, padding-free)
See bench/README.md for how each figure is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import importlib.util
import itertools
import json
import math
import os
import platform
import random
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONTENDERS = ("bare", "toolkit", "toolkit_packed", "trl", "trl_packed")
LETTERS = dict(zip(CONTENDERS, "abcde", strict=True))
TRL_CONTENDERS = ("trl", "trl_packed")


@dataclass
class ModelSize:
    """Qwen3 shape of the benchmark model (random weights)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int


FULL_MODEL = ModelSize(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=1408)
QUICK_MODEL = ModelSize(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)


@dataclass
class Spec:
    """Everything a worker needs; written once to `<workdir>/spec.json` so every contender reads the same values."""

    workdir: str
    model_dir: str
    data_path: str
    samples_path: str
    max_seq_len: int
    micro_batch_size: int
    grad_accum: int
    packed_micro_batch_size: int
    warmup: int
    steps: int
    seed: int
    lr: float
    max_grad_norm: float
    lora_r: int
    lora_alpha: float
    dtype: str
    attn: str
    device: str
    threads: int
    timeout_s: int
    order: list[list[int]] = field(default_factory=list)  # global-batch sample indices per step, padded runs

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps


# --------------------------------------------------------------------------------------------------------------
# Shared helpers (orchestrator and workers)
# --------------------------------------------------------------------------------------------------------------

def log(msg: str) -> None:
    """Progress on stderr, so stdout carries only the JSON summary."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def step_order(num_samples: int, global_batch: int, total_steps: int, seed: int) -> list[list[int]]:
    """Sample indices of every step's global batch in the toolkit's default `shuffle` order for a one-stage run:
    each epoch is `num_samples // global_batch` full batches from the front of a permutation seeded by
    [seed, stage 0, epoch]. Kept here rather than imported (the toolkit's sampling API moves); the orchestrator's
    `checks` verify that the toolkit really trained these batches."""
    import numpy as np

    per_epoch = num_samples // global_batch
    if per_epoch == 0:
        raise ValueError(f"{num_samples} samples hold no global batch of {global_batch}")
    order: list[list[int]] = []
    perm = np.arange(0)
    for step in range(total_steps):
        epoch, k = divmod(step, per_epoch)
        if k == 0:
            perm = np.random.default_rng([seed, 0, epoch]).permutation(num_samples)
        order.append(perm[k * global_batch:(k + 1) * global_batch].tolist())
    return order


def summarise(step_times: list[float], real: list[int], slots: list[int], warmup: int) -> dict[str, Any]:
    """Throughput figures of the steps after `warmup`: trained (non-pad) tokens over wall time, pad share of the
    token slots processed, and the mean step time."""
    t, r, s = step_times[warmup:], real[warmup:], slots[warmup:]
    if not t or sum(t) <= 0:
        raise RuntimeError(f"no timed steps after {warmup} warm-up steps (got {len(step_times)} steps)")
    seconds = sum(t)
    return {"tokens_per_sec": sum(r) / seconds, "padding_fraction": 1.0 - sum(r) / sum(s) if sum(s) else 0.0,
            "mean_step_time_s": seconds / len(t), "timed_steps": len(t), "timed_tokens": sum(r),
            "timed_slots": sum(s), "timed_seconds": seconds, "step_times_s": [round(x, 5) for x in step_times]}


def torch_setup(spec: Spec) -> tuple[Any, Callable[[], None]]:
    """Thread count and dtype for an in-process contender, plus a device sync for honest step timing."""
    import torch

    torch.set_num_threads(spec.threads)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    return getattr(torch, spec.dtype), sync


def peak_memory_self() -> tuple[float, str]:
    """Peak memory of this process: max CUDA memory allocated on GPU, else the RSS high-water mark."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30, "torch.cuda.max_memory_allocated (worker process)"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "ru_maxrss RUSAGE_SELF (worker process)"


def load_base_model(spec: Spec, dtype: Any) -> Any:
    """The benchmark model as the toolkit loads it: from_pretrained with the spec's dtype and attention, no cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec.model_dir, dtype=dtype, attn_implementation=spec.attn)
    model.config.use_cache = False
    return model


def lora_config(spec: Spec) -> Any:
    """The one LoRA config of every contender (the toolkit builds the same from its recipe)."""
    from peft import LoraConfig

    return LoraConfig(r=spec.lora_r, lora_alpha=spec.lora_alpha, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")


def load_samples(spec: Spec) -> list[dict[str, list[int]]]:
    """The tokenised samples (toolkit.data.encode_files output, written once by the orchestrator)."""
    return json.loads(Path(spec.samples_path).read_text())


# --------------------------------------------------------------------------------------------------------------
# Workers: one per contender, each in a fresh process; each writes <workdir>/<name>.result.json
# --------------------------------------------------------------------------------------------------------------

def worker_bare(spec: Spec) -> dict[str, Any]:
    """(a) The reference: model(**batch), backward, clip, step over pre-collated batches; no toolkit code in the step.

    The batches are the toolkit's own non-packed ones (same samples per step, same collator), built before timing.
    """
    import torch
    from accelerate import Accelerator
    from peft import get_peft_model
    from transformers import AutoTokenizer

    from toolkit.data.collate import padding_collator  # data preparation only, outside the timed loop

    dtype, sync = torch_setup(spec)
    accelerator = Accelerator(mixed_precision="no", gradient_accumulation_steps=spec.grad_accum)
    torch.manual_seed(spec.seed)
    model = get_peft_model(load_base_model(spec, dtype), lora_config(spec))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=spec.lr)
    model, optimizer = accelerator.prepare(model, optimizer)

    samples = load_samples(spec)
    collate = padding_collator(AutoTokenizer.from_pretrained(spec.model_dir))
    m = spec.micro_batch_size
    steps = [[collate([samples[i] for i in idx[j * m:(j + 1) * m]]) for j in range(spec.grad_accum)]
             for idx in spec.order]
    real = [sum(int(b["attention_mask"].sum()) for b in step) for step in steps]
    slots = [sum(b["input_ids"].numel() for b in step) for step in steps]

    model.train()
    times: list[float] = []
    sync()
    last = time.perf_counter()
    for step in steps:
        for batch in step:
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
        sync()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    memory, source = peak_memory_self()
    return {**summarise(times, real, slots, spec.warmup), "peak_memory_gb": memory, "memory_source": source,
            "micro_batch_size": m, "grad_accum": spec.grad_accum}


def toolkit_recipe(spec: Spec, out: Path) -> dict[str, Any]:
    """A one-stage recipe for train_curriculum.py: the spec's model, data, LoRA and batch; no eval, no
    checkpoints, no trackers, a metrics record every step."""
    return {
        "output_dir": str(out), "run_name": out.name,
        "model": {"name_or_path": spec.model_dir, "dtype": spec.dtype, "attn_implementation": spec.attn},
        "lora": {"enabled": True, "r": spec.lora_r, "alpha": spec.lora_alpha, "dropout": 0.0,
                 "target_modules": "all-linear"},
        "data": {"max_seq_len": spec.max_seq_len, "overlength": "drop", "train_on": "assistant", "packing": False},
        "stages": [{"name": "bench", "data": [spec.data_path], "max_steps": spec.total_steps, "lr": spec.lr}],
        "optimizer": {"lr": spec.lr, "max_grad_norm": spec.max_grad_norm},
        "train": {"micro_batch_size": spec.micro_batch_size, "grad_accum": spec.grad_accum, "seed": spec.seed},
        "checkpoint": {"save_on_stage_end": False, "resume": "none", "portable": False},
        "logging": {"logging_steps": 1, "progress_bar": False, "trackers": []},
    }


def worker_toolkit(spec: Spec, packed: bool) -> dict[str, Any]:
    """(b)/(c) train_curriculum.py launched single-process with `accelerate launch`; figures from its metrics.jsonl.

    This worker imports no torch: on CPU, RUSAGE_CHILDREN's ru_maxrss is then exactly the largest RSS among the
    launcher and the training process it waits for (the training process), and no other contender's.
    """
    name = "toolkit_packed" if packed else "toolkit"
    out = Path(spec.workdir) / name
    shutil.rmtree(out, ignore_errors=True)  # a fresh run (checkpoint.resume is none) for every repeat
    recipe = Path(spec.workdir) / f"{name}.recipe.yaml"
    recipe.write_text(json.dumps(toolkit_recipe(spec, out), indent=2))  # JSON is YAML
    overrides = ["data.packing=true", f"train.micro_batch_size={spec.packed_micro_batch_size}"] if packed else []
    cmd = [sys.executable, "-m", "accelerate.commands.launch",
           "--config_file", str(REPO / "accelerate_configs" / "single.yaml"), "--mixed_precision", "no",
           "--num_processes", "1", "--num_cpu_threads_per_process", str(spec.threads),
           str(REPO / "train_curriculum.py"), "--config", str(recipe), *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=spec.timeout_s)
    if proc.returncode != 0:
        output = proc.stdout + proc.stderr
        # The launcher's own CalledProcessError traceback comes last; the training process's error is before it.
        cause = output[:output.rfind("Traceback")] if output.count("Traceback") > 1 else output
        raise RuntimeError(f"train_curriculum.py exited with {proc.returncode}:\n{cause[-4000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in records if "tokens_per_sec" in r]  # training records (eval records have none)
    if [r["step"] for r in records] != list(range(1, spec.total_steps + 1)):
        raise RuntimeError(f"expected one metrics record per step 1..{spec.total_steps}, got steps "
                           f"{[r['step'] for r in records]}")
    cumulative = [0] + [int(r["tokens"]) for r in records]
    real = [b - a for a, b in itertools.pairwise(cumulative)]
    slots = [round(n / (1.0 - r["padding_fraction"])) for n, r in zip(real, records, strict=True)]
    times = [float(r["step_time"]) for r in records]  # logging_steps=1: the whole loop iteration of that step
    reported = max(float(r["peak_memory_gb"]) for r in records)
    if spec.device == "cuda":
        memory, source = reported, "toolkit metrics peak_memory_gb (torch.cuda.max_memory_allocated, training proc)"
    else:
        memory = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
        source = "ru_maxrss RUSAGE_CHILDREN of a worker whose only child is accelerate launch -> training process"
    return {**summarise(times, real, slots, spec.warmup), "peak_memory_gb": memory, "memory_source": source,
            "toolkit_reported_peak_memory_gb": reported, "micro_batch_size": spec.packed_micro_batch_size if packed
            else spec.micro_batch_size, "grad_accum": spec.grad_accum, "overrides": overrides}


def worker_trl(spec: Spec, packed: bool) -> dict[str, Any]:
    """(d)/(e) TRL's SFTTrainer on the same tokenised samples, model, LoRA config and effective batch.

    TRL defaults except where the work would otherwise differ: gradient_checkpointing=False (TRL defaults to True,
    the toolkit to False), bf16=False (no autocast, like `--mixed_precision no`; the weights' dtype comes from
    loading, bf16 on GPU), same lr, clipping, max_length, and logging/saving/eval off. The sampler is replaced by
    the toolkit's seeded per-step order so (d) trains on exactly the batches of (a) and (b).
    """
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    dtype, sync = torch_setup(spec)
    samples = load_samples(spec)
    dataset = Dataset.from_list([{"input_ids": s["input_ids"], "labels": s["labels"]} for s in samples])
    micro = spec.packed_micro_batch_size if packed else spec.micro_batch_size
    counts: dict[int, list[Any]] = {}

    class Timer(TrainerCallback):
        """Wall time from one optimizer-step end to the next (the first from train begin)."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.last = 0.0

        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            sync()
            self.last = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            sync()
            now = time.perf_counter()
            self.times.append(now - self.last)
            self.last = now

    class BenchSFTTrainer(SFTTrainer):
        """SFTTrainer that counts the tokens it trains on and takes its sample order from the benchmark."""

        def _get_train_sampler(self, train_dataset: Any = None) -> Any:
            n = len(train_dataset if train_dataset is not None else self.train_dataset)
            order = spec.order if not packed else step_order(n, micro * spec.grad_accum, spec.total_steps,
                                                              spec.seed)
            return [i for idx in order for i in idx]

        def training_step(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            ids = inputs["input_ids"]
            real = inputs["attention_mask"].sum() if "attention_mask" in inputs else ids.numel()  # no host sync
            entry = counts.setdefault(self.state.global_step, [0, 0])
            entry[0] += real
            entry[1] += ids.numel()
            return super().training_step(model, inputs, *args, **kwargs)

    config = SFTConfig(
        output_dir=str(Path(spec.workdir) / ("trl_packed" if packed else "trl")),
        per_device_train_batch_size=micro, gradient_accumulation_steps=spec.grad_accum, max_steps=spec.total_steps,
        learning_rate=spec.lr, max_grad_norm=spec.max_grad_norm, max_length=spec.max_seq_len, packing=packed,
        gradient_checkpointing=False, bf16=False, fp16=False, seed=spec.seed, data_seed=spec.seed,
        logging_strategy="no", save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0)
    torch.manual_seed(spec.seed)
    tokenizer = AutoTokenizer.from_pretrained(spec.model_dir)
    timer = Timer()
    trainer = BenchSFTTrainer(model=load_base_model(spec, dtype), args=config, train_dataset=dataset,
                              processing_class=tokenizer, peft_config=lora_config(spec), callbacks=[timer])
    labels_kept = packed or trainer.train_dataset[0]["labels"] == samples[0]["labels"]
    trainer.train()
    if sorted(counts) != list(range(spec.total_steps)) or len(timer.times) != spec.total_steps:
        raise RuntimeError(f"expected {spec.total_steps} steps, counted {sorted(counts)} / timed {len(timer.times)}")
    real = [int(counts[s][0]) for s in range(spec.total_steps)]
    slots = [int(counts[s][1]) for s in range(spec.total_steps)]
    memory, source = peak_memory_self()
    return {**summarise(timer.times, real, slots, spec.warmup), "peak_memory_gb": memory, "memory_source": source,
            "micro_batch_size": micro, "grad_accum": spec.grad_accum, "padding_free": trainer.padding_free,
            "dataset_rows": len(trainer.train_dataset), "labels_preserved": bool(labels_kept)}


def run_worker(name: str, spec_path: Path) -> int:
    """Worker entry point: run one contender, write its result file (status ok or failed)."""
    spec = Spec(**json.loads(spec_path.read_text()))
    result_path = Path(spec.workdir) / f"{name}.result.json"
    try:
        if name == "bare":
            result = worker_bare(spec)
        elif name in ("toolkit", "toolkit_packed"):
            result = worker_toolkit(spec, packed=name == "toolkit_packed")
        elif name in TRL_CONTENDERS:
            result = worker_trl(spec, packed=name == "trl_packed")
        else:
            raise ValueError(f"unknown contender {name}")
        result["status"] = "ok"
    except Exception as e:  # reported in the JSON, the other contenders still run
        import traceback

        result = {"status": "failed", "error": f"{type(e).__name__}: {e}"[-4000:],
                  "traceback": traceback.format_exc()[-4000:]}
    result_path.write_text(json.dumps(result, indent=2))
    return 0 if result["status"] == "ok" else 1


# --------------------------------------------------------------------------------------------------------------
# Orchestrator
# --------------------------------------------------------------------------------------------------------------

_WORD_TEXT = (
    "the a an and or but of to in on at for with from by is are was were be it this that what how many much "
    "number count reverse list word answer question total each left more less apple orange book cat dog bird "
    "tree house car train water bread box red blue green small big fast slow happy quick brown fox jumps over "
    "lazy one two three four five six seven eight nine ten has have gives buys eats sells then now there you "
    "we they he she please sure here result first second last order letters sentence model learn data test "
    "loss step value return print function class import def self true false coins cards pens eggs fish sun"
)
WORDS = _WORD_TEXT.split()


def target_length(rng: random.Random, max_seq_len: int) -> int:
    """A long-tailed token length: ~88% short (log-normal around 8% of max_seq_len), ~12% within 70-98% of it."""
    if rng.random() < 0.12:
        return int(rng.uniform(0.70, 0.98) * max_seq_len)
    return int(min(0.6 * max_seq_len, 12 + rng.lognormvariate(math.log(0.08 * max_seq_len), 0.8)))


def write_chat_data(path: Path, tokenizer: Any, rows: int, max_seq_len: int, seed: int) -> None:
    """Seeded chat JSONL (one user and one assistant turn per row) whose templated lengths follow
    `target_length` and never exceed max_seq_len (so no contender drops or truncates a row)."""
    rng = random.Random(seed)

    def length(messages: list[dict[str, str]]) -> int:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    with path.open("w", encoding="utf-8") as f:
        for _ in range(rows):
            want = target_length(rng, max_seq_len)
            user = " ".join(rng.choice(WORDS) for _ in range(max(2, want // 8))) + "?"
            pool = [rng.choice(WORDS) for _ in range(want)]  # a word is at least one token

            def row(n: int, user: str = user, pool: list[str] = pool) -> list[dict[str, str]]:
                return [{"role": "user", "content": user},
                        {"role": "assistant", "content": " ".join(pool[:n]) + "."}]

            lo, hi = 1, len(pool)  # the longest reply whose templated row fits in `want` tokens
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if length(row(mid)) <= want else (lo, mid - 1)
            f.write(json.dumps({"messages": row(lo)}) + "\n")


def machine_info() -> dict[str, Any]:
    """Where the numbers come from."""
    import psutil
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"hostname": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(), "logical_cpus": os.cpu_count(),
            "physical_cpus": psutil.cpu_count(logical=False), "memory_gb": psutil.virtual_memory().total / 2**30,
            "device": "cuda" if gpu else "cpu", "gpu": gpu}


def versions() -> dict[str, str | None]:
    """Installed versions of everything that affects the figures."""
    out: dict[str, str | None] = {}
    for pkg in ("torch", "transformers", "accelerate", "peft", "datasets", "trl", "curriculum-toolkit"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def worker_env(threads: int) -> dict[str, str]:
    """Environment of every worker: same thread count for all (accelerate launch would otherwise default the
    training process to 1 thread), offline, no telemetry, the repository importable."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", PYTHONUNBUFFERED="1",
               TRANSFORMERS_NO_ADVISORY_WARNINGS="1", PYTHONPATH=os.pathsep.join(
                   [str(REPO), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]))
    return env


def run_contender(name: str, spec: Spec, spec_path: Path) -> dict[str, Any]:
    """Run one contender's worker process and read back its result."""
    logfile = Path(spec.workdir) / f"{name}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--spec", str(spec_path)]
    (Path(spec.workdir) / f"{name}.result.json").unlink(missing_ok=True)  # never read a previous repeat's
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    try:
        with logfile.open("w") as f:
            subprocess.run(cmd, cwd=REPO, env=worker_env(spec.threads), stdout=f, stderr=subprocess.STDOUT,
                           timeout=spec.timeout_s + 60, check=False)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "error": f"timed out after {spec.timeout_s + 60} s"}
    result_path = Path(spec.workdir) / f"{name}.result.json"
    if not result_path.is_file():
        return {"status": "failed", "error": "worker wrote no result:\n" + logfile.read_text()[-4000:]}
    result = json.loads(result_path.read_text())
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # Contention diagnostic: CPU seconds of the worker and its children per wall second, about the thread count
    # when nothing else runs (imports and set-up pull it down a little), much lower when other processes compete.
    wall = time.monotonic() - started
    cpu = cpu_after.ru_utime + cpu_after.ru_stime - cpu_before.ru_utime - cpu_before.ru_stime
    result.update(wall_s=round(wall, 1), cpu_s=round(cpu, 1), cpu_per_wall=round(cpu / wall, 2))
    if result["status"] != "ok":
        result["log_tail"] = logfile.read_text()[-3000:]
    return result


def pick_median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The repeat with the median tokens/s (upper median for an even count); failed if any repeat failed."""
    failed = [r for r in runs if r["status"] != "ok"]
    if failed:
        return failed[0]
    ranked = sorted(runs, key=lambda r: r["tokens_per_sec"])
    chosen = dict(ranked[len(ranked) // 2])
    if len(runs) > 1:
        chosen["repeats_tokens_per_sec"] = [r["tokens_per_sec"] for r in runs]
    return chosen


def ratio(results: dict[str, dict[str, Any]], num: str, den: str) -> float | None:
    """tokens/s of `num` over `den`, None unless both ran."""
    a, b = results.get(num, {}), results.get(den, {})
    if a.get("status") != "ok" or b.get("status") != "ok":
        return None
    return a["tokens_per_sec"] / b["tokens_per_sec"]


def expected_tokens(order: list[list[int]], lengths: list[int], micro: int, warmup: int) -> tuple[int, int]:
    """(real tokens, padded slots) of the timed steps for batches padded to their longest row."""
    real = slots = 0
    for idx in order[warmup:]:
        for j in range(0, len(idx), micro):
            chunk = [lengths[i] for i in idx[j:j + micro]]
            real += sum(chunk)
            slots += len(chunk) * max(chunk)
    return real, slots


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="Tiny model (hidden 64, 2 layers), max_seq_len 128.")
    p.add_argument("--steps", type=int, default=None, help="Timed steps per contender (default 10, quick 3).")
    p.add_argument("--warmup", type=int, default=None, help="Untimed warm-up steps first (default 3, quick 2).")
    p.add_argument("--out", default=str(REPO / "bench" / "results"), help="Directory for the results JSON.")
    p.add_argument("--max-seq-len", type=int, default=None, help="Default 512, quick 128.")
    p.add_argument("--rows", type=int, default=None, help="Rows of generated chat data (default 512, quick 128).")
    p.add_argument("--micro-batch-size", type=int, default=8, help="Samples per padded micro-batch.")
    p.add_argument("--packed-micro-batch-size", type=int, default=None,
                   help="Packed rows per micro-batch (default: as many as hold one padded micro-batch's real tokens).")
    p.add_argument("--grad-accum", type=int, default=1, help="Micro-batches per optimizer step (all contenders).")
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "eager", "flash_attention_2"),
                   help="Attention kernel of every contender (flash_attention_2 needs flash-attn and CUDA).")
    p.add_argument("--threads", type=int, default=None, help="Torch threads per contender (default: physical cores).")
    p.add_argument("--repeats", type=int, default=1, help="Runs per contender, interleaved; the median run counts.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default=",".join(CONTENDERS), help="Comma-separated subset of contenders to run.")
    p.add_argument("--timeout", type=int, default=1800, help="Seconds allowed per contender.")
    p.add_argument("--keep-workdir", action="store_true", help="Keep the model, data, logs and runs for inspection.")
    p.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    p.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return run_worker(args.worker, args.spec)

    args.only = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = sorted(set(args.only) - set(CONTENDERS))
    if unknown:
        p.error(f"unknown contenders {unknown}; choose from {list(CONTENDERS)}")
    args.steps = args.steps if args.steps is not None else (3 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    args.max_seq_len = args.max_seq_len or (128 if args.quick else 512)
    args.rows = args.rows or (128 if args.quick else 512)
    if args.steps < 1 or args.warmup < 1 or args.repeats < 1:
        p.error("--steps, --warmup and --repeats must be at least 1 (the first step includes setup time)")
    stdout = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):  # libraries print to stdout; it must carry only the JSON
        summary = benchmark(args)
    print(json.dumps(summary, indent=2), file=stdout, flush=True)
    failed = [n for n, r in summary["contenders"].items() if r["status"] == "failed"]
    return 1 if failed else 0


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Build the model and data once, run every contender, write and return the summary."""
    only, steps, warmup, max_seq_len, rows = args.only, args.steps, args.warmup, args.max_seq_len, args.rows
    size = QUICK_MODEL if args.quick else FULL_MODEL
    sys.path.insert(0, str(REPO))
    import psutil
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from toolkit.builtin.text_model import build_tokenizer, write_tiny_qwen3
    from toolkit.data.packing import pack_samples
    from toolkit.data.plan import encode_files
    from toolkit.model.params import count_params
    from toolkit.templates import CHATML_TEMPLATE

    threads = args.threads or psutil.cpu_count(logical=False) or os.cpu_count() or 1
    cuda = torch.cuda.is_available()
    dtype = "bfloat16" if cuda and torch.cuda.is_bf16_supported() else "float32"
    load_at_start = os.getloadavg()[0]
    if load_at_start > 0.5:
        log(f"the machine is not idle (1-minute load average {load_at_start:.2f}): figures will be noisy")
    workdir = Path(tempfile.mkdtemp(prefix="bench-throughput-"))
    started = time.monotonic()
    try:
        log(f"workdir {workdir}; writing the model ({asdict(size)})")
        # The ChatML template the recorded results were measured with (the tiny model's own is Qwen3's since issue 30).
        model_dir = write_tiny_qwen3(workdir / "model", tokenizer=build_tokenizer(CHATML_TEMPLATE), **asdict(size),
                                     seed=args.seed)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        data_path = workdir / "chat.jsonl"
        write_chat_data(data_path, tokenizer, rows, max_seq_len, args.seed)
        data = encode_files([data_path], tokenizer, max_seq_len=max_seq_len, overlength="drop",
                               train_on="assistant")
        samples = data.samples
        lengths = sorted(len(s["input_ids"]) for s in samples)
        (workdir / "samples.json").write_text(json.dumps(samples))

        # Packed micro-batch: as many packed rows as hold, on average, the real tokens of one padded micro-batch.
        packed_rows = pack_samples(samples, max_seq_len)
        packed_micro = args.packed_micro_batch_size or max(1, round(args.micro_batch_size * len(packed_rows)
                                                                    / len(samples)))
        global_batch = args.micro_batch_size * args.grad_accum
        spec = Spec(workdir=str(workdir), model_dir=str(model_dir), data_path=str(data_path),
                    samples_path=str(workdir / "samples.json"), max_seq_len=max_seq_len,
                    micro_batch_size=args.micro_batch_size, grad_accum=args.grad_accum,
                    packed_micro_batch_size=packed_micro, warmup=warmup, steps=steps, seed=args.seed, lr=2e-4,
                    max_grad_norm=1.0, lora_r=16, lora_alpha=32, dtype=dtype, attn=args.attn,
                    device="cuda" if cuda else "cpu", threads=threads,
                    timeout_s=args.timeout)
        spec.order = step_order(len(samples), global_batch, spec.total_steps, args.seed)
        spec_path = workdir / "spec.json"
        spec_path.write_text(json.dumps(asdict(spec)))

        trl_missing = importlib.util.find_spec("trl") is None
        runs: dict[str, list[dict[str, Any]]] = {}
        results: dict[str, dict[str, Any]] = {}
        for name in CONTENDERS:
            if name not in only:
                results[name] = {"status": "skipped", "reason": "not selected with --only"}
            elif name in TRL_CONTENDERS and trl_missing:
                results[name] = {"status": "skipped",
                                 "reason": "trl is not installed (pip install 'curriculum-toolkit[bench]')"}
            else:
                runs[name] = []
        # Rounds a, b, c, d, e, a, b, ...: a slow spell of a noisy machine then hits every contender alike.
        for rep in range(args.repeats):
            for name in runs:
                tag = f"({LETTERS[name]}) {name}" + (f" [{rep + 1}/{args.repeats}]" if args.repeats > 1 else "")
                log(f"{tag}: {warmup} warm-up + {steps} timed steps")
                r = run_contender(name, spec, spec_path)
                runs[name].append(r)
                log(f"{tag}: " + (
                    f"{r['tokens_per_sec']:.0f} tok/s, padding {r['padding_fraction']:.1%}, "
                    f"{r['mean_step_time_s']:.3f} s/step, peak {r['peak_memory_gb']:.2f} GiB ({r['wall_s']} s)"
                    if r["status"] == "ok" else f"FAILED: {r.get('error', '')[:300]}"))
        for name, done in runs.items():
            results[name] = pick_median(done)

        # Cross-checks: the padded contenders trained exactly the batches the toolkit's own order predicts, and the
        # toolkit's packed run trained the predicted packed rows.
        lens = [len(s["input_ids"]) for s in samples]
        exp_real, exp_slots = expected_tokens(spec.order, lens, args.micro_batch_size, warmup)
        packed_order = step_order(len(packed_rows), packed_micro * args.grad_accum, spec.total_steps, args.seed)
        exp_packed = sum(len(packed_rows[i]["input_ids"]) for idx in packed_order[warmup:] for i in idx)
        checks: dict[str, bool | None] = {}
        for name in ("bare", "toolkit", "trl"):
            r = results[name]
            checks[f"{name}_trained_expected_padded_batches"] = (
                r["timed_tokens"] == exp_real and r["timed_slots"] == exp_slots if r["status"] == "ok" else None)
        r = results["toolkit_packed"]
        checks["toolkit_packed_trained_expected_rows"] = (
            r["timed_tokens"] == exp_packed if r["status"] == "ok" else None)

        ratios = {"c/a": ratio(results, "toolkit_packed", "bare"), "c/d": ratio(results, "toolkit_packed", "trl"),
                  "c/e": ratio(results, "toolkit_packed", "trl_packed"), "b/a": ratio(results, "toolkit", "bare")}
        packed_padding = (results["toolkit_packed"]["padding_fraction"]
                          if results["toolkit_packed"]["status"] == "ok" else None)

        def target(value: float | None, op: str, bound: float, what: str) -> dict[str, Any]:
            met = None if value is None else (value >= bound if op == ">=" else value <= bound)
            return {"what": what, "value": value, "target": f"{op} {bound}", "met": met}

        targets = {
            "toolkit_overhead": target(ratios["b/a"], ">=", 0.97, "(b)/(a) tokens/s: toolkit vs bare loop"),
            "packing_padding": target(packed_padding, "<=", 0.02, "(c) padding fraction with packing"),
            "packed_vs_trl": target(ratios["c/d"], ">=", 1.3, "(c)/(d) tokens/s: toolkit packed vs TRL default"),
            "packed_vs_trl_packed": target(ratios["c/e"], ">=", 1.0, "(c)/(e) tokens/s: toolkit vs TRL, both packed"),
        }
        config = AutoConfig.from_pretrained(model_dir)
        summary = {
            "schema": 1,
            "date": datetime.date.today().isoformat(),
            "quick": args.quick,
            "command": " ".join(["python", *sys.argv]),
            "machine": machine_info(),
            "versions": versions(),
            "setup": {
                "model": {**asdict(size), "vocab_size": config.vocab_size, "dtype": dtype, "attn": args.attn,
                          "matmul_params": count_params(config)["matmul"], "lora": {"r": 16, "alpha": 32,
                          "dropout": 0.0, "target_modules": "all-linear"}},
                "data": {"rows": rows, "samples": len(samples), "max_seq_len": max_seq_len,
                         "tokens_mean": sum(lengths) / len(lengths), "tokens_p50": lengths[len(lengths) // 2],
                         "tokens_p90": lengths[int(0.9 * (len(lengths) - 1))], "tokens_max": lengths[-1],
                         "packed_rows": len(packed_rows)},
                "batch": {"micro_batch_size": args.micro_batch_size, "grad_accum": args.grad_accum,
                          "packed_micro_batch_size": packed_micro,
                          "real_tokens_per_padded_micro_batch": args.micro_batch_size * sum(lengths) / len(lengths),
                          "real_tokens_per_packed_micro_batch": packed_micro * sum(lengths) / len(packed_rows)},
                "warmup_steps": warmup, "timed_steps": steps, "threads": threads, "seed": args.seed,
                "repeats": args.repeats, "load_avg_1m_at_start": round(load_at_start, 2),
                "lr": spec.lr, "max_grad_norm": spec.max_grad_norm,
            },
            "contenders": {name: {"label": LETTERS[name], **results[name]} for name in CONTENDERS},
            "ratios": ratios,
            "targets": targets,
            "checks": checks,
            "wall_s": round(time.monotonic() - started, 1),
        }
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        out_file = out_dir / f"{summary['date']}-{socket.gethostname()}{'-quick' if args.quick else ''}.json"
        out_file.write_text(json.dumps(summary, indent=2) + "\n")
        summary["results_file"] = str(out_file)
        for key, t in targets.items():
            state = "n/a" if t["met"] is None else ("met" if t["met"] else "NOT met")
            value = "n/a" if t["value"] is None else f"{t['value']:.3f}"
            log(f"target {key}: {value} {t['target']} -> {state}")
        log(f"wrote {out_file} ({summary['wall_s']} s)")
        return summary
    finally:
        if args.keep_workdir:
            log(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
