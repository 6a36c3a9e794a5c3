"""bench/gpu_qwen3_8b.py --tiny, end to end on CPU (fast suite): the GPU benchmark's pipeline with the GPU run's
settings (bf16 base under bf16 mixed precision, LoRA, packed rows through the kernel `auto` picks, the chunked
loss head, MFU against a given peak by both counts), the default row and gradient checkpointing,
the rows that cannot run here skipped with why, metrics read back, the final losses checked against each other,
and every row's profiled window (bench/profile_step.py, operator CPU time standing in for the GPU's; with the
micro-batch copies in turn, --no-overlap), so that a first run on a GPU only measures. The `compile` row is left
to the GPU: inductor on a CPU compiles C++ for minutes; tests/model/test_compile.py covers train.compile itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, run_env


def test_gpu_benchmark_pipeline_runs_on_the_tiny_model(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_qwen3_8b.py"), "--tiny", "--steps", "2",
                           "--warmup", "1", "--peak-tflops", "1", "--out", str(tmp_path), "--profile",
                           "--no-overlap", "--variants", "default", "grad_ckpt", "fa4"], cwd=REPO,
                          env=run_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    summary = json.loads(proc.stdout)
    variants = summary["variants"]
    assert variants.pop("fa4")["status"] == "skipped"  # flash-attn-4 is not installed here (no CUDA)
    assert [v["gradient_checkpointing"] for v in variants.values()] == [False, True]
    assert summary["losses"]["agree"] and summary["losses"]["reference"] == "default"
    for result in variants.values():
        assert result["status"] == "ok" and result["timed_steps"] == 2
        assert result["attention"] == "sdpa_packed" and result["loss_head"] == "chunked"  # no flash-attn, no CUDA
        assert result["fused_layers"] == "none"  # auto: no CUDA here
        assert result["tokens_per_sec"] > 0 and result["peak_memory_gb"] > 0 and result["padding_fraction"] <= 0.02
        assert 0 < result["mfu"] < 1 and 0 < result["mfu_nemo"] < 1  # against the given 1 TFLOP/s
        assert result["mfu_nemo"] > result["mfu"]  # NeMo AutoModel charges 6N a token for LoRA, we charge 4N
        assert result["idle_share"] is None and result["profile"]["time_basis"].startswith("cpu")  # no GPU here
        assert not result["compiled"]
    profile = variants["default"]["profile"]  # two untimed steps after the timed ones
    assert profile["wall_s"] > 0 and len(profile["top_ops"]) == 15 and profile["vocab"] == 1024
    assert profile["device_idle_share"] is None and profile["copy_overlap"] is False  # no GPU; --no-overlap
    assert all(v["copy_overlap"] is False for v in variants.values())  # every row profiled, --no-overlap
    assert 0 < profile["loss_head_share"] < 1  # the head's matmuls and cross-entropy, found by the vocab width
    assert any("attention" in op["name"] for op in profile["attention_kernels"]), profile["attention_kernels"]
    assert Path(summary["results_file"]).parent == tmp_path and Path(summary["results_file"]).is_file()
    assert all(v["row_length"] == 256 and v["estimated_peak_gb"] > 0 for v in variants.values())
    assert proc.stderr.count("| sdpa_packed |") == 2  # the markdown rows for docs/benchmarks.md
    assert Path(summary["results_file"]).with_suffix(".md").read_text().count("| sdpa_packed |") == 2
