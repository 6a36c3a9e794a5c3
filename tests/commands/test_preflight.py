"""Preflight's memory estimate per stage: each stage at its own micro batch x max_seq_len, the worst one reported,
and the per-stage activation estimate checked against a measured training step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_env
from toolkit.commands.preflight import preflight, stage_estimates, worst_stage
from toolkit.config.load import load_recipe
from toolkit.config.stages import resolve_stages
from toolkit.model.memory import activation_memory, load_model_config

QWEN3_8B_RECIPE = REPO / "recipes" / "qwen3_8b_lora_curriculum.yaml"


def test_qwen3_8b_long_context_stage_is_estimated_at_its_own_batch_and_is_the_worst() -> None:
    recipe = load_recipe(QWEN3_8B_RECIPE)
    config = load_model_config(recipe.model.name_or_path)  # the shipped config: nothing is downloaded
    stages = resolve_stages(recipe)
    estimates = stage_estimates(recipe, config, stages, num_gpus=4, param_bytes=2)
    names = [s.name for s in stages]
    long = names.index("long_context")
    assert (stages[long].micro_batch_size, stages[long].max_seq_len) == (1, 8192)
    assert (recipe.train.micro_batch_size, recipe.data.max_seq_len) == (2, 2048)  # what it was estimated at
    own = activation_memory(config, tokens=1 * 8192, grad_ckpt=True, activation_bytes=2,
                            loss_head=recipe.model.loss_head)
    recipe_wide = activation_memory(config, tokens=2 * 2048, grad_ckpt=True, activation_bytes=2,
                                    loss_head=recipe.model.loss_head)
    assert own > 1.5 * recipe_wide
    assert all(row["activations"] == own for row in estimates[long].values())
    assert all(row["activations"] == recipe_wide for i in range(len(stages)) if i != long
               for row in estimates[i].values())
    assert worst_stage(estimates) == long
    report = preflight(recipe, REPO / "accelerate_configs" / "zero3.yaml", num_gpus=4, gpu_memory_gb=80,
                       scan_data=False)
    line = next(x for x in report.splitlines() if x.strip().startswith("long_context"))
    assert "micro batch 1 x 8192 tokens" in line and line.endswith("<- worst")
    assert "worst stage 'long_context' (micro batch 1 x 8192 tokens)" in report
    assert sum("<- worst" in x for x in report.splitlines()) == 1


@pytest.mark.parametrize(("config", "row"), [("zero3.yaml", "zero3"), ("fsdp.yaml", "fsdp"), ("ddp.yaml", "ddp"),
                                             ("zero3_offload.yaml", "zero3_offload"), ("zero2.yaml", "zero2")])
def test_per_stage_figures_are_the_selected_strategys(config: str, row: str) -> None:
    """The per-stage lines are the memory table's row of the strategy the accelerate config selects (a run names
    FSDP2 'fsdp2'; the table's row is 'fsdp'), not another strategy's."""
    recipe = load_recipe(QWEN3_8B_RECIPE)
    report = preflight(recipe, REPO / "accelerate_configs" / config, num_gpus=4, gpu_memory_gb=80, scan_data=False)
    assert f"GiB per GPU under {row}):" in report, report
    stages = resolve_stages(recipe)
    estimates = stage_estimates(recipe, load_model_config(recipe.model.name_or_path), stages, num_gpus=4,
                                param_bytes=2)
    line = next(x for x in report.splitlines() if x.strip().startswith("long_context"))
    assert f"peak {estimates[worst_stage(estimates)][row]['total'] / 2**30:.2f}" in line


def _accelerate_config(tmp_path: Path, name: str, deepspeed_config: str) -> Path:
    """A DeepSpeed accelerate config as `accelerate config` writes it."""
    config = tmp_path / f"{name}.yaml"
    config.write_text(f"compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
                      f"{deepspeed_config}mixed_precision: bf16\nnum_machines: 1\nnum_processes: 4\n")
    return config


def test_zero2_offload_is_estimated_with_its_offload(tmp_path: Path) -> None:
    """ZeRO-2 with optimizer offload, as `accelerate config` writes it: its own row, with the gradient
    partitions, masters and Adam state in CPU RAM, not on the GPU; never the recommendation (no config of ours)."""
    config = _accelerate_config(tmp_path, "zero2_offload", "  offload_optimizer_device: cpu\n"
                                "  offload_param_device: none\n  zero_stage: 2\n")
    recipe = load_recipe(QWEN3_8B_RECIPE).model_copy(deep=True)
    recipe.lora.enabled = False  # full fine-tuning: the offloaded state is what decides whether 8B fits
    report = preflight(recipe, config, num_gpus=None, gpu_memory_gb=80, scan_data=False)
    assert "selected by" in report and ": zero2_offload" in report
    assert "GiB per GPU under zero2_offload):" in report
    rows = stage_estimates(recipe, load_model_config(recipe.model.name_or_path), resolve_stages(recipe),
                           num_gpus=4, param_bytes=2)[0]
    on, off = rows["zero2"], rows["zero2_offload"]
    assert off["params"] == on["params"] and off["grads"] == off["optimizer"] == 0
    assert off["cpu_offload"] > 4 * (on["grads"] + on["optimizer"])  # + the fp32 gradient partition, per rank x 4
    assert "recommended: zero2_offload" not in report


def test_a_strategy_without_its_own_row_says_which_row_stands_for_it(tmp_path: Path) -> None:
    """ZeRO-1, as `accelerate config` writes it: shown as DDP and said to be an upper bound, not silently another
    strategy's figures."""
    config = _accelerate_config(tmp_path, "zero1", "  zero_stage: 1\n")
    report = preflight(load_recipe(QWEN3_8B_RECIPE), config, num_gpus=None, gpu_memory_gb=80, scan_data=False)
    assert "selected by" in report and ": zero1" in report
    assert "GiB per GPU under ddp (ZeRO-1 estimated as DDP: an upper bound)):" in report


def test_stage_activation_estimates_match_measured_steps(tmp_path: Path) -> None:
    """Two stages of a recipe, 4 x 128 and 1 x 1024 tokens, on bench/loss_head_memory.py's model (the real
    151,936-token vocabulary, standard head: the head's logits dominate and grow with the stage's tokens). One
    real training step of each stage's micro-batch shape, each in its own process: the step's measured working set
    (peak RSS - RSS before it) is within 15% of preflight's per-stage activation estimate (fp32 on CPU)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from loss_head_memory import model_config
    finally:
        sys.path.remove(str(REPO / "bench"))
    recipe = load_recipe(None, [f"output_dir={tmp_path / 'run'}", "model.loss_head=standard", "lora.r=8",
                                "train.micro_batch_size=4", "data.max_seq_len=128",
                                "stages.1.micro_batch_size=1", "stages.1.max_seq_len=1024"])
    stages = resolve_stages(recipe)
    estimates = stage_estimates(recipe, model_config(), stages, num_gpus=1, param_bytes=4, activation_bytes=4)
    assert worst_stage(estimates) == 1
    for stage, rows in zip(stages, estimates, strict=True):
        proc = subprocess.run([sys.executable, str(REPO / "bench" / "loss_head_memory.py"), "--worker", "standard",
                               str(stage.max_seq_len), str(stage.micro_batch_size)], cwd=REPO, env=run_env(),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stderr[-4000:]}"
        measured = json.loads(proc.stdout.strip().splitlines()[-1])["step_gb"] * 1e9
        assert measured == pytest.approx(rows["single"]["activations"], rel=0.15), (stage.name, measured)


def test_the_long_recipe_under_ulysses_is_estimated_per_slice_and_names_the_fewest_checkpointed_layers() -> None:
    """recipes/qwen3_8b_long.yaml with accelerate_configs/zero3_sp2.yaml: each GPU's activations are those of half
    of every 32k-token row, and the report names the fewest checkpointed layers that fit (each one fewer saves a
    forward pass in backward); on 1 GPU without Ulysses more layers are needed."""
    recipe = load_recipe(REPO / "recipes" / "qwen3_8b_long.yaml")
    config = load_model_config(recipe.model.name_or_path)
    stages = resolve_stages(recipe)
    report = preflight(recipe, REPO / "accelerate_configs" / "zero3_sp2.yaml", num_gpus=None, gpu_memory_gb=80,
                       scan_data=False)
    assert "selected by " in report and "zero3 + Ulysses sp_size 2" in report
    sliced = stage_estimates(recipe, config, stages, num_gpus=2, param_bytes=2, sp_size=2)[0]["zero3"]
    whole = stage_estimates(recipe, config, stages, num_gpus=2, param_bytes=2)[0]["zero3"]
    assert sliced["activations"] < 0.55 * whole["activations"]
    assert f"peak {sliced['total'] / 2**30:.2f}" in report
    proposal = next(x for x in report.splitlines() if x.startswith("gradient checkpointing: the fewest"))
    fewest = int(proposal.split(": ")[2].split(" of ")[0])
    assert 0 < fewest < 36 and f"(model.gradient_checkpointing: {fewest})" in proposal
    budget = 80 * 2**30 * 0.9
    fits = [stage_estimates(recipe, config, stages, num_gpus=2, param_bytes=2, sp_size=2, grad_ckpt=n)[0]["zero3"]
            ["total"] <= budget for n in (fewest - 1, fewest)]
    assert fits == [False, True]
    single = preflight(recipe, REPO / "accelerate_configs" / "zero3.yaml", num_gpus=1, gpu_memory_gb=80,
                       scan_data=False)
    assert int(next(x for x in single.splitlines() if x.startswith("gradient checkpointing: the fewest"))
               .split(": ")[2].split(" of ")[0]) > fewest


def test_a_stage_ordered_by_a_model_has_its_scoring_pass_estimated(tmp_path: Path) -> None:
    recipe = load_recipe(REPO / "recipes" / "smoke_curriculum_scored.yaml",
                         [f"output_dir={tmp_path / 'run'}", "stages.1.difficulty.by=ifd"])
    report = preflight(recipe, REPO / "accelerate_configs" / "ddp.yaml", num_gpus=2, gpu_memory_gb=80,
                       scan_data=False)
    lines = report.split("scoring passes (difficulty by a model's score")[1].splitlines()
    assert lines[2].startswith("  scored: ifd of the current model, at the stage's first step: two no-grad forwards")
    assert lines[1].startswith("  sft: loss of the scorer builtin:tiny-qwen3, before the first step: one no-grad "
                               "forward of the scorer")  # a separate scorer, loaded whole


def test_a_dpo_stage_counts_two_sequences_a_pair_and_its_reference_pass(tmp_path: Path) -> None:
    """A preference stage's micro-batch of pairs holds twice as many sequences, and its reference pass is costed
    with the other scoring passes; its pairs are scanned as pairs."""
    recipe = load_recipe(REPO / "recipes" / "qwen3_8b_sft_then_dpo.yaml", [f"output_dir={tmp_path / 'run'}"])
    report = preflight(recipe, REPO / "accelerate_configs" / "zero3.yaml", num_gpus=4, gpu_memory_gb=80,
                       scan_data=False)
    assert "  dpo  micro batch 2 pairs (4 sequences) x 2048 tokens: activations" in report
    sft_only = load_recipe(REPO / "recipes" / "qwen3_8b_sft_then_dpo.yaml",
                           [f"output_dir={tmp_path / 'run'}", "stages.1.objective=sft", "stages.1.preference=null",
                            "stages.1.micro_batch_size=4"])
    as_rows = preflight(sft_only, REPO / "accelerate_configs" / "zero3.yaml", num_gpus=4, gpu_memory_gb=80,
                        scan_data=False)
    activations = [float(line.split("activations ")[1].split(",")[0]) for text in (report, as_rows)
                   for line in text.splitlines() if line.startswith("  dpo  micro batch")]
    assert activations[0] == activations[1]  # 2 pairs: the 4 rows of an sft stage
    lines = report.split("scoring passes (difficulty by a model's score, a dpo stage's reference")[1].splitlines()
    assert lines[1].startswith("  dpo: dpo reference of the policy as it enters the stage, at the stage's first step")
    assert "16 bytes per pair" in lines[1]


def test_a_dpo_stage_s_pairs_are_scanned_as_pairs(tmp_path: Path) -> None:
    from toolkit.builtin.dummy_data import write_dummy_files

    run = tmp_path / "run"
    write_dummy_files(run / "dummy_data", 16, seed=0, vision=False)
    recipe = load_recipe(REPO / "recipes" / "sft_then_dpo.yaml", [f"output_dir={run}"])
    report = preflight(recipe, REPO / "accelerate_configs" / "zero3.yaml", num_gpus=2, gpu_memory_gb=80)
    lines = report.split("stage data (tokens per row):")[1].splitlines()
    assert lines[1].startswith("  sft: 16 rows, p50")
    assert lines[2].startswith("  dpo: 16 pairs, each two sequences (below, the sides'); its reference pass runs")
    assert lines[3].startswith("  dpo: 32 sequences, p50")


def test_the_sft_dpo_grpo_recipe_s_header_lines_name_it_and_it_is_estimated(tmp_path: Path) -> None:
    """recipes/qwen3_8b_sft_dpo_grpo.yaml's header: its preflight and launch lines name the recipe and a shipped
    config, and preflight (as its first line runs it, the data unscanned) estimates every stage, the grpo one too."""
    path = REPO / "recipes" / "qwen3_8b_sft_dpo_grpo.yaml"
    header = [line.lstrip("# ").rstrip(" \\") for line in path.read_text().splitlines() if line.startswith("#   ")]
    assert header[0] == ("toolkit preflight --config recipes/qwen3_8b_sft_dpo_grpo.yaml --accelerate-config "
                         "accelerate_configs/zero3.yaml")
    assert header[1] == "accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 4"
    assert header[2] == "train_curriculum.py --config recipes/qwen3_8b_sft_dpo_grpo.yaml"
    recipe = load_recipe(path, [f"output_dir={tmp_path / 'run'}"])
    report = preflight(recipe, REPO / "accelerate_configs" / "zero3.yaml", num_gpus=4, gpu_memory_gb=80,
                       scan_data=False)
    assert "  grpo  micro batch 8 x 2048 tokens: activations" in report and "  dpo   micro batch 2 pairs" in report
    # Its rollouts' KV cache, Qwen3-8B's shape in bf16 (tests/model/test_memory.py checks the formula on a real cache).
    assert ("  grpo: a step's rollout: 1 prompt x rl.num_generations 8 = 8 sequences x 2048 tokens x 36 layers x 2 "
            "(k, v) x 8 kv heads x 128 x 2 bytes: 2.25 GiB") in report
    pass_rate = load_recipe(path, [f"output_dir={tmp_path / 'run'}",
                                   "stages.2.difficulty={by: pass_rate, model: current, samples: 4}",
                                   "stages.2.order=easy_to_hard"])
    report = preflight(pass_rate, REPO / "accelerate_configs" / "zero3.yaml", num_gpus=4, gpu_memory_gb=80,
                       scan_data=False)
    assert ("  grpo: its pass-rate pass: 8 prompts x 4 samples = 32 sequences x 2048 tokens x 36 layers x 2 (k, v) x "
            "8 kv heads x 128 x 2 bytes: 9.00 GiB") in report


def test_a_video_curriculum_s_stages_count_their_video_tokens_and_a_budget_over_a_stage_is_refused(
        tmp_path: Path) -> None:
    """Preflight reads a video recipe's stages as training does: each stage's data line with its video tokens,
    and its largest video row's frames, tokens and memory (the frames its own caps sample: 4, then 8, of 56x56 px:
    4 tokens and 2 x 16 patches a frame pair). A first stage of 64 tokens given every frame (8 fps) is refused in
    one line naming the row and the max_frames that fits; with it, preflight runs."""
    import re

    import yaml

    from tests.helpers.video_files import video_recipe, write_video_dataset
    from toolkit.errors import ToolkitError

    tree = video_recipe(write_video_dataset(tmp_path / "data", 8), tmp_path / "run")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(tree))
    config = REPO / "accelerate_configs" / "ddp.yaml"
    report = preflight(load_recipe(tmp_path / "r.yaml"), config, num_gpus=1, gpu_memory_gb=80)
    lines = report.split("stage data (the rows training reads; videos:")[1].splitlines()[1:]
    assert lines[0].startswith("  stage 'short' data: 8 rows, 8 kept") and lines[0].endswith(
        "; 48 video tokens (24 frames) in its kept rows")
    patch = 3 * 2 * 14 * 14 * 4  # a patch's fp32 pixel values: 3 channels x 2 frames x 14 x 14
    for line, frames in zip(lines[1::2], (4, 8), strict=True):
        pairs = frames // 2
        assert re.search(rf"largest video row .*videos.jsonl:1: {frames} frames, {4 * pairs} video tokens of its "
                         rf"\d+ \(max_seq_len 384\); {16 * pairs} patches: pixel values "
                         rf"{16 * pairs * patch / 1024:.1f} KiB, vision tower hidden states [\d.]+ KiB a block "
                         r"\(2 blocks\)$", line), line

    tree["stages"][0].update(max_seq_len=64, video={"fps": 8})  # every frame: the 5 s clip's 40 are 80 tokens
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(tree))
    with pytest.raises(ToolkitError, match=r"videos.jsonl:2: its video frames alone are 80 tokens .* over stage "
                                           r"'short''s max_seq_len \(64\); set video.max_frames to at most (\d+)"
                       ) as refused:
        preflight(load_recipe(tmp_path / "r.yaml"), config, num_gpus=1, gpu_memory_gb=80)
    assert "\n" not in str(refused.value)
    tree["stages"][0]["video"]["max_frames"] = int(re.search(r"at most (\d+)", str(refused.value)).group(1))
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(tree))
    again = preflight(load_recipe(tmp_path / "r.yaml"), config, num_gpus=1, gpu_memory_gb=80)
    assert "  stage 'short' data: 8 rows" in again  # the videos fit; rows over 64 tokens in all are dropped as usual


def test_a_kto_stage_is_scanned_with_its_labels_and_counts_each_row_s_kl_side(tmp_path: Path) -> None:
    """A kto stage's rows carry a true/false label (read as a kto stage reads them, not refused as rows), its
    micro-batch holds each row and its KL side, and its reference pass is costed."""
    from toolkit.builtin.dummy_data import write_dummy_files

    run = tmp_path / "run"
    write_dummy_files(run / "dummy_data", 16, seed=0, vision=False)
    recipe = load_recipe(REPO / "recipes" / "sft_then_kto.yaml", [f"output_dir={run}"])
    report = preflight(recipe, REPO / "accelerate_configs" / "zero3.yaml", num_gpus=2, gpu_memory_gb=80)
    lines = report.split("stage data (tokens per row):")[1].splitlines()
    assert lines[2].startswith("  kto: 16 rows, p50"), lines
    assert "  kto: kto reference of the policy as it enters the stage, at the stage's first step" in report
    assert "  kto  micro batch 2 rows (4 sequences with their KL sides) x 96 tokens" in report, report
