"""The strategy matrix: every accelerate config, 2 processes over gloo on CPU, gives single-process losses.

Each 2-process run trains the 2-stage smoke recipe packed (LoRA, gradient checkpointing on, `data.packing`: rows of
whole samples, attention per sample) with the same global batch as the 1-process reference and must reproduce its
per-step losses and its final adapter; unpacked rows are the curriculum matrix's below. These runs are forked from
the session's relauncher (conftest.train_forked: accelerate's own launch environment for the config, without a
launch's imports); the curriculum and bf16 matrices below are launched as users launch them. The loss head is the
default chunked one (toolkit/model/loss_head.py) everywhere. (That it runs where ZeRO-3 has gathered the head's weight
is tested in tests/model/test_loss_head.py: with this tiny model on CPU, DeepSpeed 0.19 left the head's weight gathered
after the head's forward (even with stage3_max_live_parameters and max_reuse_distance 0), so a head computed outside its
module would pass here too; FSDP2 keeps the root's weights, the head's among them, unsharded through forward and
backward.)
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from tests.conftest import (
    BF16_BASE,
    CURRICULUM,
    CURRICULUM_STEPS,
    LAUNCH_TIMEOUT_S,
    NO_THINK,
    REPO,
    cpu_kernel_family,
    dummy_run_args,
    launch_cmd,
    run_env,
    signal_tree,
    spy_dir,
    train,
    train_forked,
)
from tests.helpers.portable import adam_steps, check_portable_files, portable_state
from toolkit.builtin.models import TINY_MODEL, TINY_VL_MODEL, builtin_dir
from toolkit.curriculum.sampling import StageSampler
from toolkit.metrics.log import read_metrics
from toolkit.model.loss_head import liger_available, triton_interpreted

pytestmark = pytest.mark.slow

STRATEGIES = ["ddp", "fsdp", "zero2", "zero3", "zero3_offload"]
SEQUENCE_PARALLEL = "zero3_sp2"  # Ulysses over 2 processes: one data-parallel replica (tests below)
# smoke.yaml: micro 2 x accum 2 x 2 processes = 8; the reference gets micro 4 x accum 2 x 1 process = 8.
REFERENCE_OVERRIDES = ("train.micro_batch_size=4",)
# The smoke matrix and its reference train packed, as the flagship recipe does; the other references here do not.
PACKED = "data.packing=true"
# The references compute the loss in one chunk (the default for this 1,024-token vocabulary); the 2-process runs in
# chunks of 16 tokens.
CHUNKED = "model.loss_chunk_size=16"


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl", "train")]


def grad_norms(out: Path) -> list[float]:
    """Per step: equal norms prove equal gradients, where equal losses do not (Adam undoes a constant factor)."""
    return [r["grad_norm"] for r in read_metrics(out / "metrics.jsonl", "train")]


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("matrix")


@pytest.fixture(scope="module")
def reference(runs: Path) -> Path:
    out = runs / "single"
    train_forked("single", 1, out, *REFERENCE_OVERRIDES, PACKED)
    return out


def test_reference_trains(reference: Path) -> None:
    records = read_metrics(reference / "metrics.jsonl", "train")
    assert [r["step"] for r in records] == list(range(1, 8))
    assert [r["stage"] for r in records] == ["short"] * 4 + ["long"] * 3
    assert all(math.isfinite(r["loss"]) and r["tokens_per_sec"] > 0 for r in records)
    assert records[-1]["samples"] == 7 * 8
    assert records[-1]["tokens"] > records[0]["tokens"] > 0
    lora_b = [v for k, v in adapter(reference).items() if "lora_B" in k]
    assert lora_b and max(v.abs().max().item() for v in lora_b) > 0  # B starts at zero: it trained


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_matches_single_process(strategy: str, runs: Path, reference: Path) -> None:
    out = runs / strategy
    proc = train_forked(strategy, 2, out, "model.gradient_checkpointing=true", CHUNKED, PACKED)
    assert "loss head: chunked (16 tokens per chunk" in proc.stderr  # the match below is the chunked head's
    assert "packed into" in proc.stderr and "attention: sdpa_packed" in proc.stderr
    assert losses(out) == pytest.approx(losses(reference), rel=1e-4)
    ref, got = adapter(reference), adapter(out)
    assert got.keys() == ref.keys()
    assert all(t.numel() > 0 for t in got.values()), "empty tensors in the saved adapter"
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-3, atol=1e-5, msg=f"{strategy}: {k}")
    base = AutoModelForCausalLM.from_pretrained(builtin_dir(TINY_MODEL, out.parent / ".toolkit-cache"))
    model = PeftModel.from_pretrained(base, out / "final")
    assert sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) == sum(
        t.numel() for t in ref.values())


def test_two_machines_on_loopback_match_two_processes(runs: Path, reference: Path) -> None:
    """accelerate's multi-node launch (2 machines x 1 process, rendezvous on 127.0.0.1) equals 2 processes."""
    out = runs / "two-machines"
    two_machines_on_loopback("ddp", out, "--num_machines", "2", overrides=(PACKED,))
    assert losses(out) == pytest.approx(losses(reference), rel=1e-4)


def two_machines_on_loopback(strategy: str, out: Path, *extra: str, mixed_precision: str | None = "no",
                             recipe: str = "recipes/smoke.yaml", overrides: tuple[str, ...] = ()) -> None:
    """Launch `strategy` as 2 machines x 1 process on this one, each with its --machine_rank and 127.0.0.1."""
    procs, port = [], None
    for machine_rank in (0, 1):
        base = launch_cmd(strategy, 2, mixed_precision=mixed_precision,
                          extra=[*extra, "--machine_rank", str(machine_rank), "--main_process_ip", "127.0.0.1"])
        if port is None:
            port = base[base.index("--main_process_port") + 1]
        base[base.index("--main_process_port") + 1] = port
        cmd = [*base, str(REPO / "train_curriculum.py"), "--config", recipe, "--create_dummy_data",
               "--num_dummy_samples", "64", f"output_dir={out}", *overrides]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=run_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:  # both launchers and their ranks, should one hang
            if p.poll() is None:
                signal_tree(p.pid, signal.SIGKILL)
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)


# --- Ulysses sequence parallelism ------------------------------------------------------------------------------------
# Each row's tokens split between the 2 processes of a sequence-parallel group
# (toolkit/strategies/sequence_parallel.py).
# The groups are data-parallel replicas: 2 processes with sp_size 2 are one replica, which takes the single process's
# micro-batches (micro 4); 4 processes are 2 replicas (micro 2 each, as the 2-process matrix above). Padded rows
# under Ulysses are the curriculum matrix's (SEQUENCE_PARALLEL there, its exact resume in tests/e2e/test_resume.py).

SPY_SP = REPO / "tests" / "helpers" / "spy_sequence_parallel.py"


def sp_config(tmp: Path, *, zero: str, processes: int, dp_shard: int) -> Path:
    """accelerate_configs/zero3_sp2.yaml with another ZeRO JSON and process count, as a user edits it."""
    text = (REPO / "accelerate_configs" / "zero3_sp2.yaml").read_text()
    text = (text.replace("ds_configs/zero3.json", f"ds_configs/{zero}.json")
            .replace("parallelism_config_dp_shard_size: 1", f"parallelism_config_dp_shard_size: {dp_shard}")
            .replace("num_processes: 2", f"num_processes: {processes}"))
    path = tmp / f"{zero}_sp2_x{processes}.yaml"
    path.write_text(text)
    return path


def check_kernels_saw_whole_rows(spy: Path, *, sp: int = 2, heads: int = 4, kv_heads: int = 2) -> None:
    """Each rank's decoder layers received T / sp tokens of each T-token row, and each attention call all T tokens
    over heads / sp query and kv_heads / sp key/value heads, with no mask and the whole row's packed boundaries
    (cu_seq_lens ending at T, max_length a host int)."""
    for rank in range(sp):
        events = json.loads((spy / f"rank{rank}.json").read_text())
        rows = [e[1] for e in events if e[0] == "row"]
        layers = [e[1] for e in events if e[0] == "layer"]
        attention = [e[1:] for e in events if e[0] == "attention"]
        assert rows and layers and attention, events[:20]
        assert all(e[0] == "row" or e[1] * sp in rows for e in events if e[0] == "layer"), f"rank {rank}: {events}"
        assert all(t % sp == 0 for t in rows)
        assert {a[2] for a in attention} == {n * sp for n in layers}  # every row whole in attention
        assert all(a[:2] == [heads // sp, kv_heads // sp] for a in attention), attention[:5]
        assert all(a[3] for a in attention), "a mask reached the kernel under Ulysses"
        assert all(a[4] == a[2] and a[5] for a in attention), "packed boundaries were not the whole row's"


GUIDE_CONFIG = """distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: ds_configs/zero3.json
machine_rank: 0
num_machines: 1
num_processes: 2
parallelism_config:
  parallelism_config_dp_replicate_size: 1
  parallelism_config_dp_shard_size: 1  # Must satisfy: 1 x 1 x 2 = 2 num_processes
  parallelism_config_sp_size: 2
  parallelism_config_sp_backend: deepspeed
  parallelism_config_sp_seq_length_is_variable: true
  parallelism_config_sp_attn_implementation: sdpa
"""
"""accelerate's sequence-parallelism guide's config file (docs/source/concept_guides/sequence_parallelism.md, 1.15),
as written but for its `path/to/ds_config.json`. It used to die at start: "core_attn_implementation='sdpa' does not
match model config attn_implementation='sdpa_packed'". No mixed_precision: fp32, accelerate's default."""


# The Ulysses smoke run's overrides: packed, checkpointed, the chunked head, the reference's batch, and a checkpoint
# after each of its 7 steps (resumed from each below).
SP_SMOKE = ("model.gradient_checkpointing=true", CHUNKED, PACKED, *REFERENCE_OVERRIDES, "checkpoint.save_steps=1",
            "checkpoint.keep_last=7")


@pytest.fixture(scope="module")
def guide_config(runs: Path) -> Path:
    config = runs / "guide_sp2.yaml"
    config.write_text(GUIDE_CONFIG)
    return config


def test_sequence_parallel_splits_each_row_and_matches_single_process(runs: Path, reference: Path,
                                                                      guide_config: Path) -> None:
    """The guide's config file as a user copies it (launched as written: fp32, 2 processes): packed rows split in
    two, the single process's losses, gradient norms and adapter, and the spy's proof that each kernel saw what
    Ulysses promises. (accelerate_configs/zero3_sp2.yaml verbatim is the curriculum's bf16 matrix below.)"""
    out, spy = runs / "zero3_sp2", runs / "zero3_sp2-spy"
    proc = train(guide_config, None, out, *SP_SMOKE, mixed_precision=None, script=SPY_SP,
                 env={"SPY_SP_DIR": str(spy)})
    assert "effective batch = 4 micro x 2 accum x 1 data-parallel replicas (2 processes / sp_size 2) = 8" in proc.stderr
    assert "strategy zero3_sp2" in proc.stderr and "attention: sdpa_packed" in proc.stderr
    assert losses(out) == pytest.approx(losses(reference), rel=1e-5)
    assert grad_norms(out) == pytest.approx(grad_norms(reference), rel=1e-5)
    assert [r["tokens"] for r in read_metrics(out / "metrics.jsonl", "train")] == [
        r["tokens"] for r in read_metrics(reference / "metrics.jsonl", "train")]  # each token counted once
    ref, got = adapter(reference), adapter(out)
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-6, msg=f"zero3_sp2: {k}")
    check_kernels_saw_whole_rows(spy)


def test_sequence_parallel_resumes_exactly_from_every_checkpoint(runs: Path, guide_config: Path) -> None:
    """The run above (packed rows, a checkpoint after each of its 7 steps, a stage boundary) resumed from each
    checkpoint into a new output_dir: every later step, the stage summaries and the final adapter equal the
    uninterrupted run's to the last bit, and the log says "resumed (exact)" (EXACT_RESUME_TESTED's zero3_sp2)."""
    from tests.e2e.test_resume import assert_exact_from_every_checkpoint

    reference = runs / "zero3_sp2"
    assert (reference / "final").is_dir(), "the Ulysses smoke run of the test above did not finish"
    assert_exact_from_every_checkpoint(guide_config, reference, dummy_run_args(*SP_SMOKE), steps=7,
                                       mixed_precision=None)


def test_sequence_parallel_with_two_replicas_on_four_processes(runs: Path, reference: Path) -> None:
    """4 processes, sp_size 2, ZeRO-2: 2 data-parallel replicas of 2 processes each, micro 2 per replica (the
    2-process matrix's global batch): the single process's losses and adapter."""
    out = runs / "zero2_sp2_x4"
    config = sp_config(runs, zero="zero2", processes=4, dp_shard=2)
    proc = train_forked(config, 4, out, CHUNKED, PACKED)
    assert "effective batch = 2 micro x 2 accum x 2 data-parallel replicas (4 processes / sp_size 2) = 8" in proc.stderr
    assert losses(out) == pytest.approx(losses(reference), rel=1e-4)
    assert grad_norms(out) == pytest.approx(grad_norms(reference), rel=1e-4)
    ref, got = adapter(reference), adapter(out)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-3, atol=1e-5, msg=f"zero2_sp2 x4: {k}")


@pytest.fixture(scope="module")
def full_reference(runs: Path) -> Path:
    out = runs / "single-full"
    train_forked("single", 1, out, "lora.enabled=false", *REFERENCE_OVERRIDES)
    return out


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_full_finetuning_matches_single_process(strategy: str, runs: Path, full_reference: Path) -> None:
    """Sharded full fine-tuning: same losses, and the gathered full model equals the single-process one."""
    out = runs / f"{strategy}-full"
    train_forked(strategy, 2, out, "lora.enabled=false", CHUNKED)  # the sharded head's weight itself trains
    assert losses(out) == pytest.approx(losses(full_reference), rel=1e-4)
    ref = load_file(full_reference / "final" / "model.safetensors")
    got = load_file(out / "final" / "model.safetensors")
    assert got.keys() == ref.keys() and all(t.numel() > 0 for t in got.values())
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-5, msg=f"{strategy}: {k}")
    AutoModelForCausalLM.from_pretrained(out / "final")


LM_HEAD_LORA = "lora.target_modules=[q_proj,v_proj,lm_head]"


def test_lora_on_lm_head_under_zero3_matches_single_process(runs: Path) -> None:
    """LoRA on lm_head: the head is PEFT's lora.Linear, whose weights sit in submodules that ZeRO-3 gathers at
    every call, once per chunk. Ranks with different label-token counts must still make the same calls (else
    they hang), and the losses and the head's adapters must be the single-process ones."""
    ref, out = runs / "lm-head-single", runs / "lm-head-zero3"
    train_forked("single", 1, ref, LM_HEAD_LORA, *REFERENCE_OVERRIDES)
    train_forked("zero3", 2, out, LM_HEAD_LORA, CHUNKED)
    assert losses(out) == pytest.approx(losses(ref), rel=1e-4)
    expected, got = adapter(ref), adapter(out)
    assert got.keys() == expected.keys() and any("lm_head.lora_B" in k for k in got)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-3, atol=1e-5, msg=k)


KEEP_STAGE_ENDS = "checkpoint.keep_last=3"  # one checkpoint per stage end, all kept


def stage_ends(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "stage_end"]


def completions(out: Path) -> dict[str, list[dict]]:
    """Every eval's completions file, by stage and step, without the file paths (another output dir)."""
    return {f"{path.parent.name}/{path.name}": [{k: v for k, v in json.loads(line).items() if k != "where"}
                                                for line in path.read_text().splitlines()]
            for path in sorted((out / "evals").glob("*/step-*.jsonl"))}


def check_generation(out: Path, reference: Path, strategy: str, spy: Path) -> None:
    """The generation evals' completions equal the single process's (greedy, the same batches on any number of
    processes); under ZeRO-3 and FSDP2 the weights were gathered once per eval: not one all-gather inside
    `generate`, where a sharded forward gathers every layer at every token (1,179 all-gathers under ZeRO-3 here).
    No rank destroyed its process group while its DDP model was alive (a hang after 'done')."""
    got, expected = completions(out), completions(reference)
    assert list(got) == ["easy_to_hard/step-00000008.jsonl", "mixture/step-00000004.jsonl",
                         "short_to_long/step-00000011.jsonl"]
    assert got == expected, f"{strategy}: completions differ from the single process"
    assert len({line["output"] for lines in got.values() for line in lines}) > 3  # varied, not one constant
    ranks = [json.loads((spy / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(c["evals"] == 3 and c["generate_calls"] == 3 for c in ranks), ranks
    if strategy in ("zero3", "zero3_offload", "fsdp", SEQUENCE_PARALLEL):
        assert all(c["gathers_inside_generate"] == 0 and c["gathers_in_evals"] > 0 for c in ranks), ranks
    assert all(c["destroyed_with_ddp_alive"] == 0 for c in ranks), ranks  # toolkit.runtime.process.finish_trackers


@pytest.mark.parametrize("strategy", [*STRATEGIES, SEQUENCE_PARALLEL])
def test_three_stage_curriculum_matches_single_process(strategy: str, curriculum_runs: Callable[[str], Path]) -> None:
    """Same losses as one process, and per-stage freezing: LoRA trains in stage 1, only the final norm in stage 2
    (LoRA weights and Adam moments bit-identical through it), both in stage 3; generation evals with uneven shares
    of prompts give the single process's completions, the weights gathered once per eval. Every checkpoint's
    portable state is the one-process run's: the first half of the portable-resume matrix
    (tests/e2e/test_portability.py). The runs (a checkpoint per step) are shared with tests/e2e/test_resume.py and
    tests/e2e/test_portability.py, which resume from their checkpoints."""
    out = curriculum_runs(strategy)
    check_curriculum(out, curriculum_runs("single"), strategy, rel=1e-4)
    if strategy == SEQUENCE_PARALLEL:  # DeepSpeed averages gradients differently under Ulysses (gradient_divisor)
        assert grad_norms(out) == pytest.approx(grad_norms(curriculum_runs("single")), rel=1e-4)
    check_portable_files(out, curriculum_runs("single"), strategy)
    check_generation(out, curriculum_runs("single"), strategy, spy_dir(out))
    if strategy in GOLDEN:  # the same launches prove the loop unchanged, bit for bit
        check_golden(out, strategy)


# fp32 per-step values recorded before the loop was split into named units (toolkit/train/loop.py); see the file's note.
# Bit-exact per CPU kernel family: the vector width of torch's CPU kernels (AVX2, AVX-512) changes the order of the
# sums inside a loss, so the last bits of a few losses differ between machines that are both right.
GOLDEN_FILE = json.loads((REPO / "tests" / "assets" / "curriculum_losses.json").read_text())
CPU_CAPABILITY = cpu_kernel_family()
GOLDEN = GOLDEN_FILE["by_cpu_capability"].get(CPU_CAPABILITY, GOLDEN_FILE["by_cpu_capability"]["AVX2"])
# On a CPU family with no record: equal within this (a real change of the loop moves a loss by far more; the
# resume bug of issue 23 moved one by 5e-6).
GOLDEN_REL_ELSEWHERE = 1e-6


def check_golden(out: Path, strategy: str) -> None:
    """Losses, gradient norms and learning rates equal the recorded ones exactly (as written in metrics.jsonl)."""
    records = read_metrics(out / "metrics.jsonl", "train")
    got = {k: [r[k] for r in records] for k in GOLDEN[strategy]}
    exact = CPU_CAPABILITY in GOLDEN_FILE["by_cpu_capability"]
    for k, expected in GOLDEN[strategy].items():
        assert len(got[k]) == len(expected), f"{strategy}: {len(got[k])} records of {k}, golden {len(expected)}"
        diffs = [(step, a, b) for step, a, b in zip(got["step"], got[k], expected, strict=True)
                 if (a != b if exact else a != pytest.approx(b, rel=GOLDEN_REL_ELSEWHERE))]
        assert not diffs, f"{strategy} {k} differs on {CPU_CAPABILITY} (step, got, golden): {diffs}"


def check_curriculum(out: Path, reference: Path, strategy: str, *, rel: float,
                     final_close: dict[str, float] | None = None, base_dtype: torch.dtype = torch.float32) -> None:
    """Per-step losses within `rel` of the reference run; the stages' sizes; freezing bit-exact (fp32 master
    weights and Adam moments, whatever the precision); Adam step counts; the final adapter saves the trained norm."""
    records = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["stage"] for r in records] == ["mixture"] * 4 + ["easy_to_hard"] * 4 + ["short_to_long"] * 3
    assert [r["loss"] for r in records] == pytest.approx(
        [r["loss"] for r in read_metrics(reference / "metrics.jsonl") if "loss" in r], rel=rel)
    norm_size = 64  # hidden size of the tiny model: the final RMSNorm's weight
    lora_size = stage_ends(out)[0]["trainable_params"]
    assert [(e["stage"], e["stage_steps"], e["stage_samples"], e["trainable_params"]) for e in stage_ends(out)] == [
        ("mixture", 4, 32, lora_size), ("easy_to_hard", 4, 32, norm_size),
        ("short_to_long", 3, 12, lora_size + norm_size)]
    ends = [portable_state(out, step) for step in (4, 8, 11)]
    lora = [k for k in ends[0] if "lora_" in k]
    norm = [k for k in ends[0] if k.startswith("param/") and "model.norm.modules_to_save" in k]
    assert lora and len(norm) == 1
    base = load_file(builtin_dir(TINY_MODEL, out.parent / ".toolkit-cache") / "model.safetensors")
    frozen_norm = base["model.norm.weight"].to(base_dtype).float()  # as loaded: a bf16 base holds it rounded
    assert torch.equal(ends[0][norm[0]], frozen_norm), f"{strategy}: norm moved while frozen"
    for k in lora:  # weights, exp_avg and exp_avg_sq of every adapter: untouched by stage 2
        assert torch.equal(ends[1][k], ends[0][k]), f"{strategy}: {k} changed in the stage that froze it"
    assert not torch.equal(ends[1][norm[0]], ends[0][norm[0]])
    assert any(not torch.equal(ends[2][k], ends[1][k]) for k in lora if k.startswith("param/"))
    steps = adam_steps(out, 8)  # Adam step counts: 4 updates each (LoRA in stage 1, the norm in stage 2)
    assert set(steps.values()) == {4} and set(adam_steps(out, 11).values()) == {7}
    final = load_file(out / "final" / "adapter_model.safetensors")
    saved = final["base_model.model.model.norm.weight"]
    # a bf16 run may save the 16-bit copy of the fp32 master weights: equal to within bf16 rounding
    torch.testing.assert_close(saved.float(), ends[2][norm[0]], **(final_close or {}))


# bf16: every shipped file exactly as a user launches it (only --num_processes 2 added; the file's precision,
# DeepSpeed's through its JSON), on the curriculum recipe so the same launches prove per-stage freezing in bf16, with
# the base model in bf16 as `model.dtype: auto` loads it on a GPU (LoRA: fp32 adapters, and the stage-trained norm
# kept in fp32, on a bf16 base; no fp32 input copies under autocast, tests/model/test_activation_memory.py).
# Tolerance per step loss, relative. bf16 keeps 8 significant bits (unit roundoff u = 2**-8). The strategies round
# different tensors to bf16 (DeepSpeed stores bf16 weights, DDP autocasts fp32 ones), so a step's loss, a mean
# over the ~200-500 label tokens of a step with independent rounding errors, moves by about u / sqrt(200) =
# 2.8e-4: we allow 3x that. FSDP2 casts its parameters (no autocast), so its loss is itself a bf16 number: half a
# bf16 ulp more, u relative.
BF16_REL = 3 * 2**-8 / math.sqrt(200)
BF16_REL_FSDP = BF16_REL + 2**-8
BF16_CLOSE = {"rtol": 2**-8, "atol": 1e-6}


@pytest.fixture(scope="module")
def curriculum_bf16_reference(bf16_curriculum_runs: Callable[[str], Path]) -> Path:
    out = bf16_curriculum_runs("single")
    check_trains(out)
    return out


def check_trains(out: Path) -> None:
    """Finite losses that go down: the LoRA stage's last step below its first, and the run's last below its first
    (stage 2 trains only the final norm while its pacing brings in harder rows: its loss may rise)."""
    records = read_metrics(out / "metrics.jsonl", "train")
    assert all(math.isfinite(r["loss"]) and not r["skipped"] for r in records)
    first_stage = [r["loss"] for r in records if r["stage"] == "mixture"]
    assert first_stage[-1] < first_stage[0] and records[-1]["loss"] < records[0]["loss"], [r["loss"] for r in records]


@pytest.mark.parametrize("strategy", [*STRATEGIES, SEQUENCE_PARALLEL])
def test_shipped_config_verbatim_bf16(strategy: str, curriculum_bf16_reference: Path,
                                      bf16_curriculum_runs: Callable[[str], Path]) -> None:
    """The README's launch line: bf16, the single-process bf16 losses within the tolerance above, per-stage
    freezing as exact as in fp32; and what the user reads: no per-step library warning, one line per checkpoint.
    (These runs, a checkpoint after every step, are also resumed from each of them: tests/e2e/test_resume.py.)"""
    out = bf16_curriculum_runs(strategy)
    for run in (curriculum_bf16_reference, out):
        assert json.loads((run / "run.json").read_text())["mixed_precision"] == "bf16"
    check_trains(out)
    check_curriculum(out, curriculum_bf16_reference, strategy, rel=BF16_REL_FSDP if strategy == "fsdp" else BF16_REL,
                     final_close=BF16_CLOSE, base_dtype=torch.bfloat16)
    output = out.with_suffix(".log").read_text()
    assert "FutureWarning" not in output and "Saving" not in output, output[-3000:]
    assert sum(" INFO checkpoint " in line for line in output.splitlines()) == CURRICULUM_STEPS


def test_shipped_multinode_zero3_verbatim_bf16(tmp_path: Path, curriculum_bf16_reference: Path) -> None:
    """multinode_zero3.yaml as its header says to run it (the same command per node, its --machine_rank; here
    both "nodes" on loopback with 1 process each): bf16 ZeRO-3, the single-process bf16 curriculum. In a folder
    of its own, so each "node" builds the built-in model into an empty cache at once, as a first multi-node smoke
    run does (the second node's copy had no weights: transformers saves them on global rank 0 only)."""
    out = tmp_path / "curriculum-multinode-verbatim"
    two_machines_on_loopback("multinode_zero3", out, mixed_precision=None, recipe=CURRICULUM,
                             overrides=(KEEP_STAGE_ENDS, BF16_BASE, *NO_THINK))  # as the reference trains
    check_curriculum(out, curriculum_bf16_reference, "multinode_zero3", rel=BF16_REL, final_close=BF16_CLOSE,
                     base_dtype=torch.bfloat16)


VL = "recipes/smoke_vl.yaml"  # stage 'align': projector only; stage 'instruct': LoRA + projector
# Stage 'instruct' also reads the dummy video rows: frame-list videos, an image and a video in one turn, images across
# turns, a video then an image (toolkit/builtin/dummy_data.py write_dummy_vl_video), beside vl_stage2's text-only,
# one-image and two-image rows, shuffled together: every strategy below trains on video rows with no launch of its own.
WITH_VIDEO = "stages.1.data=[dummy:vl_stage2, dummy:vl_video]"
VIDEO_LINE = "stage 'instruct' data: 128 rows, 128 kept"  # 64 + 64 rows; its video tokens follow on the line


def check_video_stage(output: str) -> None:
    """The run's stage 'instruct' held the video rows (48 of its 128 rows hold a 4-frame video: 2 frame pairs of 4
    tokens each)."""
    line = next((x for x in output.splitlines() if VIDEO_LINE in x), "")
    assert line.endswith("384 video tokens (192 frames) in its kept rows"), line or output[-3000:]


def videos_trained(run: Path) -> int:
    """How many of the samples a padded run's stage 'instruct' trained hold a video: its sampler's draws (the
    recipe's shuffle, seed 7, over vl_stage2's 64 rows then vl_video's 64), looked up in the run's generated files
    (16 of the 32)."""
    rows = [json.loads(line) for name in ("vl_stage2", "vl_video")
            for line in (run / "dummy_data" / f"{name}.jsonl").read_text().splitlines()]
    assert len(rows) == 128
    sampler = StageSampler(sizes=[64, 64], weights=None, replacement=False, order="shuffle", difficulty=None,
                           lengths=np.ones(128), pacing=None, seed=7, stage_index=1, global_batch=8, total_steps=4)
    return sum(bool(rows[i].get("videos")) for step in range(4) for i in sampler.batch(step))


# A third stage after the VL curriculum's two: dpo on vision pairs (`dummy:vl_pairs`: 16 pairs whose prompts hold an
# image, a frame-list video, or both; toolkit/builtin/dummy_data.py write_dummy_vl_pairs), LoRA and the projector
# training from its first step (no warmup), its reference the policy entering the stage. Every VL launch below runs
# it, so the launches that prove video and multi-image rows prove vision pairs too, the reference pass included, with
# no launch of their own.
PAIRS_STAGE = {"name": "pairs", "objective": "dpo", "data": ["dummy:vl_pairs"], "max_steps": 2, "lr": 1.0e-3,
               "warmup_ratio": 0.0, "trainable": ["lora", "visual.merger"]}  # no warmup: step 1 moves the policy
PAIRS_LINE = "stage 'pairs' data (dpo): 16 pairs, 16 kept"
VL_STAGES = ["align"] * 4 + ["instruct"] * 4 + ["pairs"] * 2
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def vl_pairs_recipe(runs: Path) -> str:
    """recipes/smoke_vl.yaml with `PAIRS_STAGE` after its stages."""
    recipe = yaml.safe_load((REPO / VL).read_text())
    recipe["stages"].append(PAIRS_STAGE)
    path = runs / "smoke_vl_pairs.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return str(path)


def check_pairs_stage(output: str, run: Path, reference: Path | None = None) -> None:
    """The run's stage 'pairs' read the 16 vision pairs, their prompts' videos among them (a pair's video tokens
    counted once: 10 of its pairs hold a 4-frame video, 2 frame pairs of 4 tokens each), scored them all in its
    reference pass and trained 2 dpo steps, the first at ln 2 (the policy is its reference); with `reference`,
    TRL's metrics of those steps are its."""
    line = next((x for x in output.splitlines() if PAIRS_LINE in x), "")
    assert line.endswith("80 video tokens (40 frames) in its kept pairs"), line or output[-3000:]
    assert "stage 'pairs': entry-policy reference log-probs of 16 pairs" in output, output[-3000:]
    records = read_metrics(run / "metrics.jsonl", "train")
    assert [r["stage"] for r in records] == VL_STAGES
    assert records[8]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert records[9]["loss"] != pytest.approx(math.log(2), abs=1e-5)
    if reference is not None:
        expected = read_metrics(reference / "metrics.jsonl", "train")
        for got, want in zip(records[8:], expected[8:], strict=True):
            for key in PAIR_METRICS:
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (got["step"], key)


# Liger's fused loss head runs in the ZeRO-3 launch, its kernels in Triton's interpreter (tests/conftest.py).
LIGER = liger_available() and triton_interpreted()


@pytest.fixture(scope="module")
def vl_reference(runs: Path, vl_pairs_recipe: str) -> Path:
    out = runs / "vl-single"
    output = train_forked("single", 1, out, *REFERENCE_OVERRIDES, WITH_VIDEO, recipe=vl_pairs_recipe).stderr
    check_video_stage(output)
    check_pairs_stage(output, out)
    assert videos_trained(out) > 0
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_vl_curriculum_matches_single_process(strategy: str, runs: Path, vl_reference: Path,
                                              vl_pairs_recipe: str) -> None:
    """Tiny Qwen2.5-VL, padded rows, text-only, image, multi-image and video rows mixed (`WITH_VIDEO`), then a dpo
    stage on vision pairs with images and videos in their prompts (`PAIRS_STAGE`): single-process losses and TRL's
    metrics; LoRA frozen in stage 1; the projector trains in full in every stage and is saved with the adapter."""
    out = runs / f"vl-{strategy}"
    liger = ("model.loss_head=liger",) if strategy == "zero3" and LIGER else ()  # Triton's interpreter on CPU
    proc = train_forked(strategy, 2, out, *liger, WITH_VIDEO, KEEP_STAGE_ENDS, recipe=vl_pairs_recipe)
    assert bool(liger) == ("loss head: liger" in proc.stderr)
    check_video_stage(proc.stderr)
    check_pairs_stage(proc.stderr, out, vl_reference)
    assert losses(out) == pytest.approx(losses(vl_reference), rel=1e-4)  # the reference's head is the chunked one
    first = portable_state(out, 4)
    lora_b = [k for k in first if k.startswith("param/") and "lora_B" in k]
    assert lora_b and all(first[k].abs().max() == 0 for k in lora_b), "LoRA B moved while frozen (it starts at 0)"
    base_dir = builtin_dir(TINY_VL_MODEL, out.parent / ".toolkit-cache")
    base = AutoModelForImageTextToText.from_pretrained(base_dir).state_dict()
    merger = {k: k.removeprefix("param/base_model.model.").replace(".modules_to_save.default", "")
              for k in first if k.startswith("param/") and "merger.modules_to_save" in k}
    assert merger and all(v in base for v in merger.values())
    assert all(not torch.equal(first[k], base[v]) for k, v in merger.items()), "the projector did not train"
    final = adapter(out)
    assert any("visual.merger" in k for k in final) and any("lora_B" in k for k in final)
    assert all(t.numel() > 0 for t in final.values())
    ends = stage_ends(out)
    merger_size = ends[0]["trainable_params"]
    assert merger_size > 0 and ends[1]["trainable_params"] > merger_size
    ref_final = adapter(vl_reference)
    for k in ref_final:
        torch.testing.assert_close(final[k], ref_final[k], rtol=1e-3, atol=1e-5, msg=f"{strategy}: {k}")


QWEN3_VL = "model.name_or_path=builtin:tiny-qwen3-vl"
# Packed rows are ~4x the padded batches' tokens here (8 samples a row): one micro-batch a step keeps the launches'
# time near the padded ones'.
QWEN3_VL_PACKED = (QWEN3_VL, PACKED, "train.grad_accum=1")


@pytest.fixture(scope="module")
def qwen3_vl_reference(runs: Path, vl_pairs_recipe: str) -> Path:
    out = runs / "qwen3-vl-single"
    output = train_forked("single", 1, out, *QWEN3_VL_PACKED, *REFERENCE_OVERRIDES, WITH_VIDEO,
                          recipe=vl_pairs_recipe).stderr
    check_video_stage(output)
    check_pairs_stage(output, out)
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_qwen3_vl_curriculum_matches_single_process(strategy: str, runs: Path, qwen3_vl_reference: Path,
                                                    vl_pairs_recipe: str) -> None:
    """The same VL curriculum, video rows and the vision pairs' dpo stage included, on a tiny Qwen3-VL (DeepStack
    features, 16-px patches, a timestamp before each frame pair) under every strategy, packed (`data.packing`: whole
    samples per row, each with its own rotary ids; each micro-batch of pairs one row), where the Qwen2.5-VL matrix
    above is padded: the single process's losses, TRL's metrics and final adapter."""
    out = runs / f"qwen3-vl-{strategy}"
    proc = train_forked(strategy, 2, out, *QWEN3_VL_PACKED, WITH_VIDEO, recipe=vl_pairs_recipe)
    assert "packed into" in proc.stderr and "attention: sdpa_packed" in proc.stderr
    assert "each micro-batch of pairs flattened into one row" in proc.stderr
    check_video_stage(proc.stderr)
    check_pairs_stage(proc.stderr, out, qwen3_vl_reference)
    assert losses(out) == pytest.approx(losses(qwen3_vl_reference), rel=1e-4)
    final, ref_final = adapter(out), adapter(qwen3_vl_reference)
    assert any("visual.merger" in k for k in final) and all(t.numel() > 0 for t in final.values())
    assert final.keys() == ref_final.keys()
    for k in ref_final:
        torch.testing.assert_close(final[k], ref_final[k], rtol=1e-3, atol=1e-5, msg=f"{strategy}: {k}")
