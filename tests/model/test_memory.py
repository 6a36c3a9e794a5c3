"""Tests for the per-GPU memory estimate: hand-computed arithmetic, and real measurements under each strategy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config

from tests.conftest import REPO, launch_cmd, run_env, run_launch
from toolkit.errors import ToolkitError
from toolkit.model.memory import estimate, estimate_all, format_table, load_model_config, recommend
from toolkit.model.params import meta_parameter_counts
from toolkit.strategies.measure import measure_rank_state_bytes

# The builtin tiny Qwen3 (toolkit.builtin.text_model.write_tiny_qwen3 defaults; its tokenizer pads the vocabulary to
# 1024).
# Parameters: embeddings 1024*64 = 65536, LM head 65536, final norm 64, and per layer
#   q 64*64 = 4096, k 64*32 = 2048, v 2048, o 4096, gate/up/down 3 * 64*128 = 24576,
#   norms 64 + 64 (layer) + 16 + 16 (q_norm, k_norm) = 160                    -> 37024 per layer
# total = 65536 + 65536 + 64 + 2 * 37024 = 205184
TOTAL = 205184
HALF = 102592  # every tensor here splits evenly over 2 ranks: TOTAL / 2
# LoRA r=4 on all linear layers, r * (in + out) per layer:
#   q 4*128 + k 4*96 + v 4*96 + o 4*128 + gate 4*192 + up 4*192 + down 4*192 = 4096 per layer, 2 layers
LORA = 8192


@pytest.fixture(scope="module")
def tiny() -> Qwen3Config:
    return Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)


def _est(config: Qwen3Config, strategy: str, *, lora_r: int | None = None, param_bytes: int = 4,
         grad_ckpt: bool = False, loss_head: str = "chunked", adapter_input_copies: bool = False) -> dict[str, int]:
    return estimate(config, strategy=strategy, num_gpus=2, lora_r=lora_r, param_bytes=param_bytes,
                    micro_batch=2, seq_len=16, grad_ckpt=grad_ckpt, loss_head=loss_head,
                    adapter_input_copies=adapter_input_copies)


def test_meta_counts_are_exact(tiny: Qwen3Config) -> None:
    assert meta_parameter_counts(tiny, lora_r=None) == (TOTAL, TOTAL)
    assert meta_parameter_counts(tiny, lora_r=4) == (TOTAL + LORA, LORA)
    assert meta_parameter_counts(tiny, lora_r=4, lora_targets=["q_proj", "v_proj"]) == (
        TOTAL + 2 * (512 + 384), 2 * (512 + 384))


def test_full_finetune_sharding(tiny: Qwen3Config) -> None:
    ddp = _est(tiny, "ddp")
    assert (ddp["params"], ddp["grads"], ddp["optimizer"]) == (TOTAL * 4, TOTAL * 4, TOTAL * 8)
    assert ddp["buffers"] == TOTAL * 4  # DDP's reducer buckets: a second copy of the gradients
    zero2 = _est(tiny, "zero2")  # grads and optimizer sharded; DeepSpeed adds a 4-byte fp32 master
    assert (zero2["params"], zero2["grads"], zero2["optimizer"]) == (TOTAL * 4, HALF * 4, HALF * (8 + 4))
    zero3 = _est(tiny, "zero3")
    # Weights are sharded too, except the norms (<= 10 * hidden = 640 elements), which ZeRO-3 keeps whole
    # on every rank next to their partition: 2 * 160 + 64 = 384 elements whole plus 192 partitioned.
    assert zero3["params"] == (HALF - 192) * 4 + (384 + 192) * 4 == 411904
    assert (zero3["grads"], zero3["optimizer"]) == (HALF * 4, HALF * 12)
    fsdp = _est(tiny, "fsdp")  # sharded like ZeRO-3, but no persistent weights and no master copy
    assert (fsdp["params"], fsdp["grads"], fsdp["optimizer"]) == (HALF * 4, HALF * 4, HALF * 8)
    single = estimate(tiny, strategy="single", num_gpus=8, lora_r=None, param_bytes=4, micro_batch=2,
                      seq_len=16, grad_ckpt=False)
    assert (single["params"], single["optimizer"], single["buffers"]) == (TOTAL * 4, TOTAL * 8, 0)
    for est in (ddp, zero2, zero3, fsdp, single):
        assert est["total"] == sum(est[k] for k in ("params", "grads", "optimizer", "activations", "buffers"))
        assert est["cpu_offload"] == 0


def test_zero3_offload_moves_state_to_cpu(tiny: Qwen3Config) -> None:
    est = _est(tiny, "zero3_offload")
    assert (est["params"], est["grads"], est["optimizer"]) == ((384 + 192) * 4, 0, 0)
    # Per rank: weight partitions (409600 bytes) + gradient, master and Adam for 102592 elements; 2 ranks.
    assert est["cpu_offload"] == 2 * ((HALF - 192) * 4 + HALF * (4 + 4 + 8)) == 4102144


def test_lora_accounting(tiny: Qwen3Config) -> None:
    ddp = _est(tiny, "ddp", lora_r=4, param_bytes=2)
    # bf16 base, adapters in fp32 (PEFT upcasts them), grads and Adam only for the adapters
    assert (ddp["params"], ddp["grads"], ddp["optimizer"]) == (TOTAL * 2 + LORA * 4, LORA * 4, LORA * 8)
    zero2 = _est(tiny, "zero2", lora_r=4, param_bytes=2)
    # DeepSpeed bf16 casts the adapters to bf16 too, and keeps fp32 masters of its half of them
    assert (zero2["params"], zero2["grads"], zero2["optimizer"]) == ((TOTAL + LORA) * 2, LORA, LORA // 2 * 12)


def test_activations_formula(tiny: Qwen3Config) -> None:
    # One layer, per token (b = 2): (2*64 + 3*64 + 2*32 + 4*128) * 2 = 1792 bytes in the compute dtype, plus the
    # fp32 inputs of the two RMSNorms and Qwen3's q/k norms, (2*64 + 64 + 32) * 4 = 896: 2688 bytes. Shared: rotary
    # cos/sin 2*16*2 = 64 and the final norm's fp32 input 4*64 = 256. T = 2 * 16 = 32 tokens; logits:
    # 1024 * (2 + 8) = 10240 bytes per token.
    standard = {"loss_head": "standard"}
    assert _est(tiny, "ddp", **standard)["activations"] == 32 * (2 * 2688 + 320 + 10240) == 509952
    # checkpointed: each layer's input (64 * 2 bytes) and one recomputed layer
    assert _est(tiny, "ddp", grad_ckpt=True, **standard)["activations"] == 32 * (2 * 64 * 2 + 2688 + 320 + 10240)
    # The chunked head (default): one chunk of logits (here all 32 tokens fit in one) + fp32 hidden-state grads.
    assert _est(tiny, "ddp")["activations"] == 509952 + 32 * 64 * 4
    long = {"micro_batch": 1, "seq_len": 8192, "grad_ckpt": True}
    chunked = estimate(tiny, strategy="single", num_gpus=1, lora_r=None, param_bytes=4, loss_chunk_size=100, **long)
    assert chunked["activations"] == 8192 * (2 * 64 * 2 + 2688 + 320) + 100 * 10240 + 8192 * 64 * 4
    full = estimate(tiny, strategy="single", num_gpus=1, lora_r=None, param_bytes=4, loss_head="standard", **long)
    assert full["activations"] == 8192 * (2 * 64 * 2 + 2688 + 320 + 10240)
    # fp32 LoRA adapters on a bf16 base without autocast: each adapted Linear keeps an fp32 copy of its input,
    # (5*64 + 64 + 128) * 4 = 2048 bytes in place of the shared 16-bit inputs (2*64 + 64 + 128) * 2 = 640.
    copies = _est(tiny, "ddp", adapter_input_copies=True, **standard)["activations"]
    assert copies == 509952 + 32 * 2 * (2048 - 640)


def test_unknown_strategy(tiny: Qwen3Config) -> None:
    with pytest.raises(ToolkitError, match="zero3_offload"):
        _est(tiny, "zero4")


def test_table_and_recommendation(tiny: Qwen3Config) -> None:
    rows = estimate_all(tiny, num_gpus=2, lora_r=None, param_bytes=4, micro_batch=2, seq_len=16, grad_ckpt=False)
    assert list(rows) == ["ddp", "zero2", "zero2_offload", "zero3", "zero3_offload", "fsdp"]
    table = format_table(rows, gpu_memory_gb=80)
    assert "recommended: ddp" in table
    assert format_table(list(rows.items()), gpu_memory_gb=80) == table  # (strategy, estimate) pairs work too
    for name in rows:
        assert name in table
    assert "none fits" in format_table(rows, gpu_memory_gb=1e-6)
    # Just enough for ZeRO-2 but not DDP: the next cheapest in communication is chosen.
    budget_gb = rows["zero2"]["total"] / 1024**3 / 0.9
    assert rows["ddp"]["total"] > rows["zero2"]["total"]
    assert recommend(rows, budget_gb * 1.0001) == "zero2"
    # ZeRO-2 with optimizer offload is shown but never recommended: no config of ours selects it.
    assert all(recommend(rows, est["total"] / 1024**3 / 0.9 * 1.0001) != "zero2_offload" for est in rows.values())


def test_shipped_configs_load() -> None:
    qwen3 = load_model_config("Qwen/Qwen3-8B")
    assert (qwen3.model_type, qwen3.hidden_size, qwen3.num_hidden_layers, qwen3.head_dim) == ("qwen3", 4096, 36, 128)
    assert load_model_config("qwen3-8b").to_dict() == qwen3.to_dict()
    vl = load_model_config("Qwen/Qwen2.5-VL-7B-Instruct")
    assert type(vl).__name__ == "Qwen2_5_VLConfig"
    assert (vl.text_config.hidden_size, vl.text_config.num_key_value_heads, vl.vision_config.hidden_size,
            vl.vision_config.out_hidden_size) == (3584, 4, 1280, 3584)
    q3vl = load_model_config("qwen3-vl-8b")
    assert type(q3vl).__name__ == "Qwen3VLConfig"
    # Published sizes: 8.2B (Qwen3-8B), 8.29B (Qwen2.5-VL-7B), 8.77B (Qwen3-VL-8B).
    assert meta_parameter_counts(qwen3, lora_r=None)[0] == 8190735360
    assert meta_parameter_counts(vl, lora_r=None)[0] == pytest.approx(8.29e9, rel=0.005)
    assert meta_parameter_counts(q3vl, lora_r=None)[0] == pytest.approx(8.77e9, rel=0.005)


def test_local_dir_and_unknown_name(tmp_path: Path, tiny: Qwen3Config) -> None:
    tiny.save_pretrained(tmp_path)
    assert load_model_config(tmp_path).hidden_size == 64
    with pytest.raises(ToolkitError, match="qwen3-8b"):
        load_model_config("some/unknown-model")


def test_measure_plain_torch_after_a_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 32), torch.nn.Linear(32, 50))
    model[0].weight.requires_grad_(False)  # a frozen part: weights but no gradient or state
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model(torch.randint(0, 50, (4, 8))).sum().backward()
    optimizer.step()
    trainable = 16 * 32 + 32 + 32 * 50 + 50
    total = 50 * 16 + trainable
    expected = {"params": total * 4, "grads": trainable * 4,
                # exp_avg + exp_avg_sq in fp32, plus AdamW's fp32 scalar step per trainable tensor (4 tensors)
                "optimizer": trainable * 8 + 4 * 4, "cpu_offload": 0}
    assert measure_rank_state_bytes(model, optimizer) == expected

    class Wrapper:  # stands in for accelerate's AcceleratedOptimizer, which keeps the real one in .optimizer
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self.optimizer = inner

    # After zero_grad(set_to_none=True) the gradients' size is still reported: what the step needs.
    optimizer.zero_grad(set_to_none=True)
    assert measure_rank_state_bytes(model, Wrapper(optimizer)) == expected


def test_measure_counts_shared_storage_once() -> None:
    flat = torch.zeros(100)
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(flat[:60])  # views into one buffer, as DeepSpeed ZeRO-2 lays weights out
    model.b = torch.nn.Parameter(flat[40:])  # overlaps a by 20 elements
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert measure_rank_state_bytes(model, optimizer)["params"] == 100 * 4


CASES = [(s, lora) for s in ("ddp", "zero2", "zero3", "fsdp") for lora in (False, True)] + [
    ("zero3_offload", False), ("zero2_offload", False)]
# No shipped config selects ZeRO-2 with optimizer offload: the one `accelerate config` writes for it.
ZERO2_OFFLOAD = ("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
                 "  offload_optimizer_device: cpu\n  offload_param_device: none\n  zero_stage: 2\n"
                 "mixed_precision: 'no'\nnum_machines: 1\nnum_processes: 2\n")


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "lora"), CASES, ids=[f"{s}-{'lora' if lo else 'full'}" for s, lo in CASES])
def test_estimate_matches_measurement(strategy: str, lora: bool, tmp_path: Path) -> None:
    """Two real processes per strategy (gloo on CPU, fp32, no mixed precision): each rank's weights, gradients
    and optimizer state (and under offload the node's CPU RAM) must be within 10% of the estimate; the optimizer
    in use is the one the toolkit built."""
    from tests.helpers.measure_state import LORA_R, SEQ_LEN, tiny_config

    out = tmp_path / "measured.json"
    config: str | Path = strategy
    if strategy == "zero2_offload":
        config = tmp_path / "zero2_offload.yaml"
        config.write_text(ZERO2_OFFLOAD)
    cmd = [*launch_cmd(config, 2, mixed_precision="no"), str(REPO / "tests" / "helpers" / "measure_state.py"), str(out)]
    proc = run_launch([*cmd, *(["--lora"] if lora else [])])
    if proc.returncode != 0:
        pytest.fail(f"{strategy} failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    records = json.loads(out.read_text())
    assert [r["rank"] for r in records] == [0, 1]
    expected = estimate(tiny_config(), strategy=strategy, num_gpus=2, lora_r=LORA_R if lora else None,
                        param_bytes=4, micro_batch=1, seq_len=SEQ_LEN, grad_ckpt=False, activation_bytes=4)
    for rec in records:
        assert rec["strategy"].startswith(strategy)
        # The optimizer that trains is the one build_optimizer made: under offload, accelerate's prepare would
        # silently rebuild it as a CPU Adam with L2 decay in place of AdamW's decoupled decay.
        assert rec["optimizer_kept"] and rec["decoupled_decay"], rec
        for key in ("params", "grads", "optimizer"):
            assert rec[key] == pytest.approx(expected[key], rel=0.10), (
                f"{strategy} lora={lora} rank {rec['rank']} {key}: measured {rec[key]}, estimated {expected[key]}")
    node_cpu = sum(r["cpu_offload"] for r in records)
    assert node_cpu == pytest.approx(expected["cpu_offload"], rel=0.10, abs=0)


def test_loss_head_estimate_matches_the_cpu_measurement(tmp_path: Path) -> None:
    """bench/loss_head_memory.py --quick: one step of the tiny Qwen3 with the real 151,936-token vocabulary, each
    head in its own process. The step's measured working set (peak RSS - RSS before it) is within 15% of the
    activation estimate preflight uses, for both heads; the chunked head ran and needed less. (The benchmark's
    pipeline is tested here too; the full curve is in docs/benchmarks.md.)"""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "loss_head_memory.py"), "--quick", "--out",
                           str(tmp_path)], cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    summary = json.loads(proc.stdout)
    rows = {r["head"]: r for r in summary["rows"]}
    assert set(rows) == {"standard", "chunked"} and all(r["status"] == "ok" for r in rows.values()), rows
    for head, r in rows.items():
        assert r["step_gb"] == pytest.approx(r["estimate_step_gb"], rel=0.15), (head, r)
    assert rows["chunked"]["chunked_calls"] == 1 and rows["standard"]["chunked_calls"] == 0
    assert rows["chunked"]["loss"] == pytest.approx(rows["standard"]["loss"], rel=1e-5)
    assert rows["chunked"]["peak_gb"] < rows["standard"]["peak_gb"]
    assert Path(summary["results_file"]).is_file() and "| 512 | chunked |" in proc.stderr


def test_partial_checkpointing_and_sequence_parallel_slices(tiny: Qwen3Config) -> None:
    """N of L layers checkpointed: N inputs kept, L-N layers whole, one recomputed. Ulysses: each GPU's slice of
    the tokens, under DeepSpeed only (DDP and FSDP2 refuse sp_size at launch)."""
    standard = {"loss_head": "standard"}
    one = estimate(tiny, strategy="ddp", num_gpus=2, lora_r=None, param_bytes=4, micro_batch=2, seq_len=16,
                   grad_ckpt=1, **standard)["activations"]
    assert one == 32 * (64 * 2 + 2688 + 320 + 10240)  # the recomputed first layer comes after the second is freed
    assert one < _est(tiny, "ddp", **standard)["activations"]
    sliced = {s: estimate(tiny, strategy=s, num_gpus=2, lora_r=None, param_bytes=4, micro_batch=2, seq_len=16,
                          grad_ckpt=False, sp_size=2, **standard)["activations"] for s in ("zero3", "ddp")}
    assert sliced == {"zero3": 16 * (2 * 2688 + 320 + 10240), "ddp": _est(tiny, "ddp", **standard)["activations"]}


def test_kv_cache_estimate_is_the_formula_and_what_generate_holds(models: dict[str, str]) -> None:
    """The KV cache of a generate call (preflight's line for grpo stages): rows x positions x layers x 2 (k, v) x
    kv heads x head dim x bytes, equal to what transformers' cache holds after a real generate of the built-in tiny
    Qwen3 (2 layers, 2 kv heads of 16; the last new token's k/v are never computed), and Qwen3-8B's shape (36
    layers, 8 kv heads of 128): 8 completions of 2048 tokens in bf16 are 2.25 GiB."""
    from transformers import AutoModelForCausalLM

    from toolkit.model.memory import GIB, kv_cache_bytes

    model = AutoModelForCausalLM.from_pretrained(models["text"], dtype=torch.float32)
    config = model.config
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (2, 2, 16)
    assert kv_cache_bytes(config, sequences=3, tokens=10, dtype_bytes=4) == 3 * 10 * 2 * 2 * 2 * 16 * 4
    rows, width, new = 3, 5, 6
    ids = torch.randint(10, 100, (rows, width), generator=torch.Generator().manual_seed(0))
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, use_cache=True, return_dict_in_generate=True,
                         pad_token_id=0)
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in out.past_key_values.layers)
    assert held == kv_cache_bytes(config, sequences=rows, tokens=width + new - 1, dtype_bytes=4)
    qwen3 = load_model_config("Qwen/Qwen3-8B")
    assert kv_cache_bytes(qwen3, sequences=8, tokens=2048, dtype_bytes=2) == 8 * 2048 * 36 * 2 * 8 * 128 * 2
    assert kv_cache_bytes(qwen3, sequences=8, tokens=2048, dtype_bytes=2) / GIB == 2.25
