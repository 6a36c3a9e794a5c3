"""Configs as users write them: accelerate config files in the shape `accelerate config` writes (every key it
writes, not only the ones that matter), launched with nothing added, against one fp32 DDP run of the recipe.

Each either trains the recipe's run (the DDP losses within 1e-4: the fp32 strategy-matrix tolerance) or is
refused before anything loads with a one-line `error: ...` naming the fix. Log noise is checked on the same
launches: no library warning per step, one line per checkpoint, the error line first and again under the
launcher's own traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import REPO, dummy_run_args, free_port, run_env, run_launch, train_cmd, train_forked
from toolkit.errors import ToolkitError
from toolkit.metrics.log import read_metrics
from toolkit.runtime.process import check_launch_config, has_accelerator
from toolkit.strategies import strategy_of_config
from toolkit.strategies.deepspeed import own_deepspeed_config
from toolkit.train.stability import scaler_skipped, skip_update

# What `accelerate config` writes for a local machine around the strategy-specific keys (accelerate 1.x).
ACCELERATE_WRITES = {
    "compute_environment": "LOCAL_MACHINE", "debug": False, "downcast_bf16": "no", "enable_cpu_affinity": False,
    "machine_rank": 0, "main_training_function": "main", "mixed_precision": "no", "num_machines": 1,
    "num_processes": 2, "rdzv_backend": "static", "same_network": True, "tpu_env": [], "tpu_use_cluster": False,
    "tpu_use_sudo": False, "use_cpu": False,
}
# The recipe (smoke.yaml): micro 2 x accum 2 x 2 processes, max_grad_norm 1.0. The files below set other values.
ZERO2_OFFLOAD = {"distributed_type": "DEEPSPEED", "deepspeed_config": {
    "gradient_accumulation_steps": 4, "gradient_clipping": 0.01, "offload_optimizer_device": "cpu",
    "offload_param_device": "none", "zero3_init_flag": False, "zero_stage": 2}}
ZERO3 = {"distributed_type": "DEEPSPEED", "deepspeed_config": {  # the silently different run
    "gradient_accumulation_steps": 1, "gradient_clipping": 0.01, "offload_optimizer_device": "none",
    "offload_param_device": "none", "zero3_init_flag": True, "zero3_save_16bit_model": True, "zero_stage": 3}}
FSDP2 = {"distributed_type": "FSDP", "fsdp_config": {
    "fsdp_activation_checkpointing": False, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "fsdp_cpu_ram_efficient_loading": True, "fsdp_offload_params": False, "fsdp_reshard_after_forward": True,
    "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_version": 2}}
FSDP1 = {"distributed_type": "FSDP", "fsdp_config": {
    "fsdp_activation_checkpointing": False, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "fsdp_backward_prefetch": "BACKWARD_PRE", "fsdp_cpu_ram_efficient_loading": True, "fsdp_forward_prefetch": False,
    "fsdp_offload_params": False, "fsdp_sharding_strategy": "FULL_SHARD", "fsdp_state_dict_type": "SHARDED_STATE_DICT",
    "fsdp_sync_module_states": True, "fsdp_use_orig_params": True, "fsdp_version": 1}}
# A LLaMA-Factory / HF-examples style ZeRO-3 JSON: everything the trainer knows is "auto", including an optimizer
# and a scheduler block. `accelerate config` then writes no mixed_precision (the JSON owns it).
AUTO_JSON = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
}


def write_config(directory: Path, name: str, fields: dict) -> Path:
    path = directory / f"{name}.yaml"
    config = {**ACCELERATE_WRITES, **fields}
    path.write_text(yaml.safe_dump({k: v for k, v in config.items() if v is not None}))
    return path


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl", "train")]


def launch(config: Path, out: Path, *overrides: str) -> subprocess.CompletedProcess:
    """The launch line a user types: the file as written (the port aside: tests run side by side)."""
    cmd = train_cmd(config, None, out, *overrides, mixed_precision=None)
    return run_launch(cmd)


def trained(proc: subprocess.CompletedProcess) -> str:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return output


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("user-configs")


@pytest.fixture(scope="module")
def ddp_reference(runs: Path) -> list[float]:
    """The one fp32 DDP run every config here is compared with (gradient checkpointing as the recipe sets it),
    forked from the session's relauncher (conftest.train_forked): the configs under test are the ones launched."""
    out = runs / "ddp"
    train_forked("ddp", 2, out)
    return losses(out)


def noise_free(output: str, checkpoints: int) -> None:
    """What a user reads: no per-step library warning, one line per checkpoint (not accelerate's five)."""
    assert "FutureWarning" not in output and "is deprecated" not in output, output[-3000:]
    assert "Saving" not in output and "saved" not in output, output[-3000:]
    assert sum(" INFO checkpoint " in line for line in output.splitlines()) == checkpoints


@pytest.mark.slow
@pytest.mark.parametrize(("name", "fields", "override_note"), [
    ("zero2_offload_inline", ZERO2_OFFLOAD, "gradient_accumulation_steps 4 -> 2 (train.grad_accum)"),
    ("zero3_inline", ZERO3, "gradient_accumulation_steps 1 -> 2 (train.grad_accum)"),
    ("fsdp2", FSDP2, None),
])
def test_inline_config_trains_the_recipe(name: str, fields: dict, override_note: str | None, runs: Path,
                                         ddp_reference: list[float]) -> None:
    """Inline DeepSpeed settings (accumulation 4 or 1, clipping 0.01) and FSDP2: the recipe's run, and one log
    line naming each value the file set differently and the winner."""
    out = runs / name
    config = write_config(runs, name, fields)
    output = trained(launch(config, out, "model.gradient_checkpointing=true"))
    assert losses(out) == pytest.approx(ddp_reference, rel=1e-4)
    # preflight names the file's strategy as the live run records it (one naming table)
    assert json.loads((out / "run.json").read_text())["strategy"] == strategy_of_config(config)[0]
    notes = [line for line in output.splitlines() if "the recipe's values win" in line]
    if override_note is None:
        assert notes == []
    else:
        assert len(notes) == 1 and override_note in notes[0], output[-3000:]
        assert "gradient_clipping 0.01 -> 1.0 (optimizer.max_grad_norm)" in notes[0]
        assert "Using DeepSpeed's value" not in output  # accelerate's own mismatch warning: nothing left to say
    noise_free(output, checkpoints=2)  # smoke.yaml saves at each of its 2 stage ends


@pytest.mark.slow
def test_auto_json_with_optimizer_and_scheduler_blocks(runs: Path, ddp_reference: list[float]) -> None:
    """A JSON full of "auto" (optimizer and scheduler blocks too) named by a file with no mixed_precision, as
    `accelerate config` writes it: fp32, the recipe's AdamW and schedule, the DDP losses."""
    ds_json = runs / "ds_auto.json"
    ds_json.write_text(json.dumps(AUTO_JSON, indent=2))
    config = write_config(runs, "zero3_json", {"distributed_type": "DEEPSPEED", "mixed_precision": None,
                                               "deepspeed_config": {"deepspeed_config_file": str(ds_json),
                                                                    "zero3_init_flag": True}})
    out = runs / "zero3_json"
    trained(launch(config, out))
    assert json.loads((out / "run.json").read_text())["mixed_precision"] == "no"
    assert losses(out) == pytest.approx(ddp_reference, rel=1e-4)


@pytest.mark.slow
def test_toolkit_train_is_the_canonical_launch(runs: Path, ddp_reference: list[float]) -> None:
    """`toolkit train` (toolkit/commands/train.py) prints the canonical launch line first, then becomes it: the
    2-process DDP run trains the reference's losses, and the launch's exit code is the command's."""
    out, port = runs / "toolkit-train", str(free_port())
    cmd = [sys.executable, "-m", "toolkit.commands.cli", "train", "--config", "recipes/smoke.yaml",
           "--accelerate-config", "ddp", *dummy_run_args(f"output_dir={out}")[2:], "--", "--num_processes", "2",
           "--mixed_precision", "no", "--main_process_port", port]
    proc = run_launch(cmd)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.splitlines()[0] == (
        f"accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2 --mixed_precision no "
        f"--main_process_port {port} train_curriculum.py --config recipes/smoke.yaml --create_dummy_data "
        f"--num_dummy_samples 64 output_dir={out}")
    assert losses(out) == ddp_reference
    assert json.loads((out / "run.json").read_text())["strategy"] == "ddp"


@pytest.mark.slow
def test_accelerate_config_default(runs: Path, ddp_reference: list[float]) -> None:
    """The file `accelerate config default` writes on this machine (one process on CPU), launched as is; the
    recipe's global batch then needs micro 4 on one process."""
    config = runs / "default.yaml"
    subprocess.run([sys.executable, "-m", "accelerate.commands.accelerate_cli", "config", "default",
                    "--config_file", str(config)], check=True, env=run_env(), capture_output=True)
    out = runs / "default"
    trained(launch(config, out, "train.micro_batch_size=4"))
    assert losses(out) == pytest.approx(ddp_reference, rel=1e-4)


@pytest.mark.slow
def test_fsdp1_is_refused_before_loading(runs: Path) -> None:
    """FSDP1 (as `accelerate config` writes it): one error line naming fsdp_version: 2, first in the output and
    again as the root cause under the launcher's traceback; nothing loaded, nothing written."""
    out = runs / "fsdp1"
    proc = launch(write_config(runs, "fsdp1", FSDP1), out)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    lines = [line for line in output.splitlines() if line.strip()]
    assert lines[0].startswith("error: ") and "fsdp_version: 2" in lines[0], output[-3000:]
    root_cause = output[output.index("Root Cause"):]
    assert "traceback : error: " in root_cause and "fsdp_version: 2" in root_cause
    assert "loading" not in output and not out.exists()


# --- The same checks without a launch: what `accelerate launch` puts in the environment, read by the toolkit. ---

def test_fp8_and_fp16_on_cpu_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(ToolkitError, match=r"fp8 is not supported.*mixed_precision: bf16"):
        check_launch_config()
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    if not has_accelerator():
        with pytest.raises(ToolkitError, match="fp16 needs a GPU"):
            check_launch_config()


def test_deepspeed_json_precision_must_agree_with_the_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """accelerate refuses mixed_precision next to a JSON; the toolkit lifts that when the JSON says "auto" and
    refuses (naming both keys) when the JSON's explicit value disagrees."""
    ds_json = tmp_path / "ds.json"
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ds_json))
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    ds_json.write_text(json.dumps({"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}}))
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", "deepspeed_config_file,zero3_init_flag,mixed_precision")
    check_launch_config()
    assert os.environ["ACCELERATE_CONFIG_DS_FIELDS"] == "deepspeed_config_file,zero3_init_flag"
    ds_json.write_text(json.dumps({"bf16": {"enabled": False}, "zero_optimization": {"stage": 3}}))
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", "deepspeed_config_file,mixed_precision")
    with pytest.raises(ToolkitError, match=r"sets bf16\.enabled: false but the accelerate config sets "
                                           r"mixed_precision: bf16"):
        check_launch_config()
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", "deepspeed_config_file,gradient_accumulation_steps")
    with pytest.raises(ToolkitError, match=r"deepspeed_config\.gradient_accumulation_steps next to"):
        check_launch_config()


def test_recipe_owns_batch_accumulation_and_clipping() -> None:
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": "auto", "train_batch_size": 16,
           "gradient_clipping": 1.0, "zero_optimization": {"stage": 2}}
    notes = own_deepspeed_config(cfg, micro_batch_size=2, grad_accum=4, num_processes=2, max_grad_norm=1.0)
    assert notes == ["train_micro_batch_size_per_gpu 8 -> 2 (train.micro_batch_size)"]  # the others agree
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], cfg["train_batch_size"],
            cfg["gradient_clipping"]) == (2, 4, 16, 1.0)
    cfg = {"gradient_clipping": 1.0}
    assert own_deepspeed_config(cfg, micro_batch_size=1, grad_accum=1, num_processes=1, max_grad_norm=0) == [
        "gradient_clipping 1.0 -> 1000000000000.0 (optimizer.max_grad_norm)"]


@pytest.mark.parametrize("block", ["optimizer", "scheduler"])
def test_optimizer_and_scheduler_blocks(block: str) -> None:
    """All-"auto" blocks ask the trainer for its own: dropped. Explicit values would train another run: refused."""
    auto = {block: {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}}
    own_deepspeed_config(auto, micro_batch_size=1, grad_accum=1, num_processes=1, max_grad_norm=1.0)
    assert block not in auto
    explicit = {block: {"type": "AdamW", "params": {"lr": 3e-5, "weight_decay": "auto"}}}
    with pytest.raises(ToolkitError, match=f"'{block}' block .* Remove '{block}'"):
        own_deepspeed_config(explicit, micro_batch_size=1, grad_accum=1, num_processes=1, max_grad_norm=1.0)
    if block == "optimizer":
        with pytest.raises(ToolkitError, match="the optimizer is AdamW"):
            own_deepspeed_config({block: {"type": "Lamb", "params": {}}}, micro_batch_size=1, grad_accum=1,
                                 num_processes=1, max_grad_norm=1.0)


def test_fp16_overflow_step_is_reported_as_skipped() -> None:
    """accelerate's fp16 optimizer wrapper with a real GradScaler: an overflowing step is skipped by the scaler and
    `scaler_skipped` says so (the loop then does not count it as an update); a finite one is applied."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.state import AcceleratorState

    Accelerator(cpu=True)  # AcceleratedOptimizer reads the state; reset below so no other test sees it
    try:
        param = torch.nn.Parameter(torch.ones(2))
        scaler = torch.amp.GradScaler("cpu")
        optimizer = AcceleratedOptimizer(torch.optim.AdamW([param], lr=0.1), device_placement=False, scaler=scaler)
        for x, skipped in ((torch.tensor([float("inf"), 1.0]), True), (torch.tensor([1.0, 1.0]), False)):
            before = param.detach().clone()
            scaler.scale((param * x).sum()).backward()
            optimizer.step()
            optimizer.zero_grad()
            assert scaler_skipped(optimizer) is skipped
            assert torch.equal(param.detach(), before) is skipped
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_vetoed_fp16_step_leaves_the_scaler_ready() -> None:
    """The guard vetoes a step (NaN loss) after clipping unscaled it: `skip_update` closes it so the next step
    unscales and updates normally; without it the next unscale fails."""
    def vetoed_then_normal(close: bool) -> torch.Tensor:
        param = torch.nn.Parameter(torch.ones(2))
        optimizer = torch.optim.AdamW([param], lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(param.sum() * float("nan")).backward()
        scaler.unscale_(optimizer)  # what clip_grad_norm_ does before the verdict is acted on
        if close:
            skip_update(scaler)
        optimizer.zero_grad()
        scaler.scale(param.sum()).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        return param.detach()

    assert not torch.equal(vetoed_then_normal(close=True), torch.ones(2))
    with pytest.raises(RuntimeError, match="unscale_"):
        vetoed_then_normal(close=False)


@pytest.mark.parametrize(("config", "name"), [
    ("single", "single"), ("ddp", "ddp"), ("zero2", "zero2"), ("zero3", "zero3"), ("zero3_offload", "zero3_offload"),
    ("multinode_zero3", "zero3"), ("fsdp", "fsdp2")])
def test_shipped_configs_are_named(config: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped accelerate configs (and their DeepSpeed JSONs) get the names their runs record."""
    monkeypatch.chdir(REPO)  # their deepspeed_config_file paths are relative to the repository root
    assert strategy_of_config(Path(f"accelerate_configs/{config}.yaml"))[0] == name


def test_inline_and_json_deepspeed_settings_are_named_alike(tmp_path: Path) -> None:
    """ZeRO-2 with optimizer offload, inline or in a JSON: one name (the same table names a live run)."""
    inline = write_config(tmp_path, "inline", ZERO2_OFFLOAD)
    ds_json = tmp_path / "zero2_offload.json"
    ds_json.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    from_file = write_config(tmp_path, "file", {"distributed_type": "DEEPSPEED", "deepspeed_config": {
        "deepspeed_config_file": str(ds_json), "zero3_init_flag": False}})
    assert strategy_of_config(inline)[0] == strategy_of_config(from_file)[0] == "zero2_offload"
