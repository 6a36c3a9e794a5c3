"""model.fused_layers (toolkit/model/fused_layers.py): when Liger's fused RMSNorm, RoPE and SwiGLU replace the model's
own, what the memory estimate counts for them, and that the key keeps earlier checkpoints resumable.

Liger's RMSNorm and SwiGLU kernels do not run in Triton's CPU interpreter, so no forward runs here: these tests
check the wiring on a real tiny Qwen3 and Qwen2.5-VL (the modules and functions a forward would reach), and the
GPU runs recorded in docs/benchmarks.md check the numbers (the same loss, +24.6% tokens/s, the estimated peak)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, run_env
from tests.helpers.inprocess import toolkit_run
from toolkit.config.identity import resume_invariants
from toolkit.config.load import load_recipe
from toolkit.errors import ToolkitError
from toolkit.model import fused_layers
from toolkit.model.fused_layers import check_fused_layers, resolve_fused_layers
from toolkit.model.memory import layer_activation_bytes, load_model_config


def test_auto_is_none_without_cuda_and_liger_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_fused_layers("auto", "qwen3")[0] == "none"  # this machine: no CUDA
    assert resolve_fused_layers("none", "qwen3")[0] == "none"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_fused_layers("auto", "qwen3") == ("liger", "rope, rms_norm, swiglu; model.fused_layers: none "
                                                              "turns them off")
    assert resolve_fused_layers("liger", "qwen3")[0] == resolve_fused_layers("liger", "qwen2")[0] == "liger"
    for model_type in ("qwen2", "qwen2_5_vl", "qwen3_vl"):  # not measured on a GPU: auto leaves them alone
        runs, why = resolve_fused_layers("auto", model_type)
        assert runs == "none" and f"liger tries Liger's for '{model_type}'" in why
    for model_type in ("qwen2_5_vl", "qwen3_vl"):  # Liger 0.8.5's VL patches do not import with transformers 5.24
        try:
            resolved = resolve_fused_layers("liger", model_type)
        except ToolkitError as e:
            assert f"Liger-Kernel's layers for '{model_type}' do not load with this transformers" in str(e)
        else:  # a Liger release whose VL patches load: then liger is what runs, never a silent none
            assert resolved.runs == "liger", resolved

    def broken(name: str) -> None:
        raise ImportError("cannot import name 'LigerQwen3CausalLMOutput'")

    monkeypatch.setattr(fused_layers.importlib, "import_module", broken)  # whatever Liger release: the branch runs
    with pytest.raises(ToolkitError, match="Liger-Kernel's layers for 'qwen3' do not load with this transformers "
                                           r"\(cannot import name"):
        resolve_fused_layers("liger", "qwen3")
    assert resolve_fused_layers("auto", "qwen3").runs == "liger"  # auto does not import ahead: measured type
    runs, why = resolve_fused_layers("auto", "gpt2")
    assert runs == "none" and "no fused layers" not in why and "'gpt2'" in why
    with pytest.raises(ToolkitError, match="Liger-Kernel has no fused layers for model type 'gpt2'"):
        resolve_fused_layers("liger", "gpt2")
    monkeypatch.setattr(fused_layers, "liger_available", lambda: False)
    assert resolve_fused_layers("auto", "qwen3")[0] == "none"
    with pytest.raises(ToolkitError, match=re.escape("liger-kernel is not installed: pip install 'curriculum")):
        check_fused_layers("liger")


def test_liger_is_refused_without_a_gpu() -> None:
    with pytest.raises(ToolkitError, match=r"model\.fused_layers is liger but there is no CUDA device"):
        check_fused_layers("liger")
    with pytest.raises(ToolkitError, match="choose one of auto, liger, none"):
        check_fused_layers("fast")


INSTALL = """
import json, logging, sys
import torch
torch.cuda.is_available = lambda: True  # what the GPU would answer; no forward runs (see the module docstring)
from toolkit.model.fused_layers import install_fused_layers, resolve_fused_layers
from toolkit.model.load import load_model, setup_lora
from liger_kernel.transformers.rms_norm import LigerRMSNorm
from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
path, vision = sys.argv[1], sys.argv[2] == "vl"
model = load_model(path, dtype=torch.float32, attn_implementation="sdpa", trust_remote_code=False, vision=vision)
runs = install_fused_layers(model, resolve_fused_layers("auto", model.config.model_type))
model = setup_lora(model, r=4, alpha=8, dropout=0.0, target_modules="all-linear", modules_to_save=[],
                   exclude_modules=".*visual.*" if vision else None, stage_trainable=[None], trainable_keys=["t"])
norms = [m for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm") and "visual" not in n]
mlps = [m for n, m in model.named_modules() if n.endswith(".mlp") and "visual" not in n]
rope = sys.modules[type(model.get_base_model()).__module__].__dict__
print(json.dumps({
    "runs": runs,
    "norms": len(norms), "mlps": len(mlps),
    "liger_norms": sum(getattr(m.forward, "__func__", None) is LigerRMSNorm.forward for m in norms),
    "liger_mlps": sum(getattr(m.forward, "__func__", None) is LigerSwiGLUMLP.forward for m in mlps),
    "rope": [k for k, v in rope.items() if "rotary_pos_emb" in k and getattr(v, "__module__", "").startswith("liger")],
    "lora_on_mlp": sum("lora_A" in n and ".mlp." in n for n, _ in model.named_parameters()),
    "head": type(model.get_base_model().get_output_embeddings()).__name__,
}))
"""


def test_auto_on_cuda_fuses_the_norms_rope_and_swiglu_under_lora(models: dict[str, str]) -> None:
    """On CUDA (answered by the test) `auto` hands every decoder RMSNorm of a Qwen3 (its q/k norms included) and
    every MLP to Liger's kernels, and the model's rotary function to Liger's; LoRA still wraps the MLP's
    projections, which the fused MLP calls, and the LM head stays the toolkit's loss head's. Run in its own
    process: Liger patches the modelling module for the whole process."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(INSTALL), models["text"], "text"], cwd=REPO,
                          env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["runs"] == "liger" and "fused layers: liger (rope, rms_norm, swiglu" in proc.stderr
    assert got["norms"] > 0 and got["liger_norms"] == got["norms"], got
    assert got["mlps"] > 0 and got["liger_mlps"] == got["mlps"], got
    assert got["rope"] == ["apply_rotary_pos_emb"], got
    assert got["lora_on_mlp"] == 3 * got["mlps"] and got["head"] == "Linear"  # gate, up, down; no fused head


def test_the_estimate_counts_what_liger_keeps() -> None:
    """Per token and layer, the fused layers keep the norms' inputs in 16-bit instead of fp32 and SwiGLU's gate
    and up without silu(gate): 51,200 bytes less for Qwen3-8B, which over 36 layers x 4096 tokens is the 7.03 GiB
    the H100 measured as 7.16 GiB (43.84 -> 36.68 GiB peak; docs/benchmarks.md)."""
    config = load_model_config("qwen3-8b")
    stock = layer_activation_bytes(config, activation_bytes=2)
    fused = layer_activation_bytes(config, activation_bytes=2, fused_layers=True)
    h, inter, qk = 4096, 12288, (32 + 8) * 128
    assert stock - fused == (2 * h + qk) * (4 - 2) + inter * 2 == 51_200


def test_preflight_counts_fused_layers_as_training_would(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {name_or_path: qwen3-8b}\nstages: [{name: s, data: [dummy:stage1], max_steps: 1}]\n")
    lines = {}
    for value in ("auto", "liger", "none"):  # `toolkit preflight`, its main called in this process
        proc = toolkit_run(["preflight", "--config", str(recipe), "--no-data", "--accelerate-config",
                            "accelerate_configs/single.yaml", "--num-gpus", "1", f"model.fused_layers={value}"],
                           monkeypatch, capsys)
        assert proc.returncode == 0, proc.stderr[-2000:]
        lines[value] = proc.stdout + proc.stderr
    assert "fused layers none" in lines["auto"] and "fused layers none" in lines["none"]  # no CUDA here
    assert "fused layers liger" in lines["liger"]  # named: counted wherever preflight runs (a GPU job's estimate)

    def peak(text: str) -> float:
        return float(text.split("peak ")[1].split()[0])

    assert peak(lines["liger"]) < peak(lines["none"]) == peak(lines["auto"])


def test_the_default_keeps_earlier_checkpoints_resumable(tmp_path: Path) -> None:
    """`auto` (the default) leaves the resume invariants as they were before the key existed; another value is a
    recipe change a resume names (exactness differs: Liger's kernels round differently)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("stages: [{name: s, data: [dummy:stage1], max_steps: 1}]\n")
    assert "fused_layers" not in resume_invariants(load_recipe(recipe))["model"]
    assert resume_invariants(load_recipe(recipe, ["model.fused_layers=none"]))["model"]["fused_layers"] == "none"
