"""The throughput benchmark (bench/throughput.py) runs end to end in quick mode and reports every contender.

Only that it works is checked, never the timings (they are noise at this size): every contender ran with a
positive throughput (the TRL ones may be skipped, with a reason, where TRL is not installed, as on CI), packing
leaves almost no padding, the padded contenders trained exactly the batches the toolkit's order predicts, and the
results file was written.

Fast tests (no multi-process launch), as tests/e2e/test_bench_gpu.py: each benchmark runs one process at a time
(one-process launches, workers, `datasets.map` with 2). In the slow run, one test at a time, they took over 3 minutes
of CI's time on about one of its 2 cores (2026-11-29); beside the fast run's other xdist worker both cores work.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, run_env

CONTENDERS = ("bare", "toolkit", "toolkit_packed", "trl", "trl_packed")
TRL_CONTENDERS = ("trl", "trl_packed")


def test_quick_benchmark_reports_every_contender(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "throughput.py"), "--quick", "--steps", "3",
                           "--out", str(tmp_path)], cwd=REPO, env=run_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    summary = json.loads(proc.stdout)  # stdout is the JSON summary and nothing else

    has_trl = importlib.util.find_spec("trl") is not None
    contenders = summary["contenders"]
    assert set(contenders) == set(CONTENDERS)
    for name in CONTENDERS:
        result = contenders[name]
        if name in TRL_CONTENDERS and not has_trl:
            assert result["status"] == "skipped" and "trl" in result["reason"], result
            continue
        assert result["status"] == "ok", result
        assert result["tokens_per_sec"] > 0 and result["mean_step_time_s"] > 0 and result["peak_memory_gb"] > 0
        assert result["timed_steps"] == 3 and 0.0 <= result["padding_fraction"] < 1.0
    for name in ("toolkit_packed", "trl_packed"):
        if contenders[name]["status"] == "ok":
            assert contenders[name]["padding_fraction"] <= 0.05, name
    assert contenders["toolkit"]["padding_fraction"] > 0.05  # the long-tailed data does pad when not packed
    assert False not in summary["checks"].values(), summary["checks"]
    assert set(summary["targets"]) == {"toolkit_overhead", "packing_padding", "packed_vs_trl", "packed_vs_trl_packed"}

    written = Path(summary["results_file"])
    assert written.parent == tmp_path and written.is_file()
    assert json.loads(written.read_text())["contenders"] == contenders


def test_data_scale_benchmark_runs_at_a_few_hundred_rows(tmp_path: Path) -> None:
    """bench/data_scale.py end to end at 300 rows (one process per launch, no tiny-data launch): the cold launch
    prepares every row, the warm one maps the store, both peer paths ran (the first with its memory sampled), the
    one-core comparison with a bare tokenizer call ran, the results file was written. Each launch's one training
    step is on a packed row of 1024 tokens (the rows are 152-644 tokens long), not the bench's 4096: through the
    151,936-row LM head on CPU that step took 12-21 s, now 4-6 s."""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "data_scale.py"), "--rows", "300", "--processes", "1",
                           "--steps", "1", "--max-seq-len", "1024", "--no-baseline", "--cores", "2",
                           "--ceiling-rows", "100", "--out", str(tmp_path), "--workdir", str(tmp_path / "work")],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    cold, warm = summary["cold"], summary["warm"]
    assert cold["prepared"]["rows"] == 300 and cold["prepared"]["tokens"] > 300 * 200 and "prepared" not in warm
    assert cold["data_s"] > 0 and warm["data_s"] > 0 and len(cold["rank_uss_gb"]) == len(warm["rank_uss_gb"]) == 1
    assert summary["peer"]["cold_s"] > 0 and summary["peer"]["warm_s"] > 0 and summary["peer"]["num_proc"] == 2
    assert summary["peer"]["main_uss_gb"] > 0.05 and summary["peer"]["worker_uss_gb"] > 0.05
    assert summary["peer_masks"]["mode"] == "masks" and summary["peer_masks"]["cold_s"] > 0  # the same masks' peer
    ceiling = summary["ceiling"]  # one core: the toolkit's preparation beside a bare tokenizer call
    assert ceiling["rows"] == 100 and ceiling["ours_rows_per_s"] > 0 and ceiling["bare_tokenizer_rows_per_s"] > 0
    assert ceiling["ours_vs_bare_tokenizer"] > 0 and ceiling["ours_vs_jinja"] > 0
    assert json.loads(Path(summary["results_file"]).read_text())["rows"] == 300


def test_data_scale_growth_is_per_rank() -> None:
    """A rank's growth is its own peak (over the cold and warm launches) less its own baseline. The bench used to
    sort each launch's peaks and take max less max: for the 1M-row run of 2026-11-25, [0.744, 0.872] -> [0.939, 0.95]
    said +0.078 GB, hiding a rank that may have grown by 0.195."""
    spec = importlib.util.spec_from_file_location("data_scale", REPO / "bench" / "data_scale.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.rank_growth([0.744, 0.872], [0.939, 0.95], [0.912, 0.934]) == 0.195
    assert bench.rank_growth([0.8, 0.5], [0.7, 0.9], [0.85, 0.6]) == 0.4  # the rank that grew most, by rank


def test_data_scale_prepare_only_times_the_store_checksum(tmp_path: Path) -> None:
    """`--prepare-only` times the cold preparation, the first warm open (the store's checksum checked), a warm open
    once the check is remembered, and the check alone in GB/s (issue 31's cost measurement)."""
    from toolkit.builtin.text_model import build_tokenizer

    spec = importlib.util.spec_from_file_location("data_scale", REPO / "bench" / "data_scale.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    data = bench.write_rows(tmp_path / "chat.jsonl", 50)
    out = bench.prepare_only(data, build_tokenizer(), tmp_path / "cache", 1)
    assert out["rows"] == 50 and out["checksum_s"] >= 0 and out["checksum_gb_per_s"] >= 0
    assert {"cold_s", "warm_s", "warm_remembered_s", "store_gb"} <= set(out)
    assert len(list((tmp_path / "cache" / "stores").glob("*/verified.json"))) == 1


def test_gpu_grpo_row_runs_on_the_tiny_model(tmp_path: Path) -> None:
    """bench/gpu_qwen3_8b.py's grpo row (issue 49) with --tiny: the GPU run's settings (bf16 base under bf16 mixed
    precision, LoRA) through a grpo stage on prompt rows; its rollout figures come from the run's own step log. The
    rollout runs under the launch's autocast: without it a bf16 base fed fp32 adapters and the row failed."""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_qwen3_8b.py"), "--tiny", "--steps", "2",
                           "--warmup", "1", "--peak-tflops", "1", "--out", str(tmp_path), "--variants", "grpo"],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    summary = json.loads(proc.stdout)
    row = summary["variants"]["grpo"]
    assert row["status"] == "ok" and row["timed_steps"] == 2 and row["profile"] is None, row
    assert row["tokens_per_sec"] > 0 and row["peak_memory_gb"] > 0 and row["mfu_nemo"] is None
    rollout = row["rollout"]
    assert rollout["completions_per_step"] == 32  # 4 prompts x 8 generations
    assert 0 < rollout["mean_completion_length"] <= 16  # --completion-length defaults to 16 with --tiny
    assert rollout["rollout_tokens_per_sec"] > 0 and rollout["generation_s"] > 0 and rollout["scoring_s"] > 0
    assert 0 < rollout["training_s"] < row["mean_step_time_s"]  # the step less its generation and scoring
    assert rollout["generation_s"] + rollout["scoring_s"] < row["mean_step_time_s"]
    assert 0 <= rollout["reward"] <= 1 and 0 <= rollout["clipped_ratio"] <= 1
    assert summary["losses"]["agree"] is None  # a grpo loss is not comparable with the sft rows'
    assert Path(summary["results_file"]).with_suffix(".md").read_text().count("| grpo | 32 |") == 1


def test_gpu_video_bench_runs_on_the_tiny_model(tmp_path: Path) -> None:
    """bench/gpu_qwen2_5_vl.py --tiny (issue 50): video rows written as MPEG-4 files, each frame cap a launch of
    train_curriculum.py with the GPU run's settings on the tiny Qwen2.5-VL. The video tokens per row (the
    encoder's count) grow with the frames sampled, and the run's own tokens per row exceed them by the same text
    in both rows: the run trained the frames the encoder says."""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_qwen2_5_vl.py"), "--tiny", "--steps", "2",
                           "--warmup", "1", "--out", str(tmp_path)],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    summary = json.loads(proc.stdout)
    short, long = summary["variants"]["frames8"], summary["variants"]["frames32"]
    for row in (short, long):
        assert row["status"] == "ok" and row["timed_steps"] == 2, row
        assert row["tokens_per_sec"] > 0 and row["mean_step_time_s"] > 0 and row["peak_memory_gb"] > 0
        assert row["video_tokens_per_row"] > 0 and row["final_loss"] > 0
    assert long["video_tokens_per_row"] == 4 * short["video_tokens_per_row"]  # 32 frames (16 s at 2 fps) against 8
    text = long["tokens_per_row"] - long["video_tokens_per_row"]
    assert text > 0 and short["tokens_per_row"] - short["video_tokens_per_row"] == text
    assert Path(summary["results_file"]).with_suffix(".md").read_text().count("| frames") == 2
