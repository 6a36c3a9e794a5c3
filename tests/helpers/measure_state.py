"""Measure what each rank holds after one real training step, for checking `toolkit.model.memory.estimate`.

Run from the repository root (the accelerate configs name ds_configs/*.json relative to it):

    accelerate launch --num_processes 2 --mixed_precision no --config_file accelerate_configs/zero3.yaml \
        tests/helpers/measure_state.py OUT.json [--lora]

Builds a small random Qwen3 (seed 0), optionally LoRA-wrapped, prepares it with AdamW through accelerate,
takes one optimizer step on random token ids and writes a JSON list with one record per rank (rank 0 writes).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

LORA_R = 8
SEQ_LEN = 32


def tiny_config():  # -> transformers.Qwen3Config (imported lazily: build_accelerator must patch first)
    """The measured model: big enough that every weight class (embeddings, layers, head) shows, still fast."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                       tie_word_embeddings=False, use_cache=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="JSON file rank 0 writes the per-rank measurements to")
    parser.add_argument("--lora", action="store_true", help=f"train LoRA adapters (r={LORA_R}, all-linear)")
    args = parser.parse_args(argv)

    from toolkit.runtime.process import build_accelerator
    from toolkit.strategies import optimizer_chain, strategy_name
    from toolkit.strategies.deepspeed import configure_deepspeed
    from toolkit.train.optimizer import build_optimizer

    accelerator = build_accelerator(grad_accum=1, timeout_minutes=10)
    from accelerate.utils import gather_object, set_seed
    from transformers import AutoModelForCausalLM

    from toolkit.strategies.measure import measure_rank_state_bytes

    set_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config())  # under ZeRO-3 init when the config asks for it
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=LORA_R, target_modules="all-linear", task_type="CAUSAL_LM"))
    configure_deepspeed(accelerator, model, micro_batch_size=1, max_grad_norm=1.0)
    # AdamW in the form the strategy needs (DeepSpeed's CPU Adam under optimizer offload), as in training.
    built = build_optimizer(accelerator, [p for p in model.parameters() if p.requires_grad], lr=1e-3,
                            weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    model, optimizer = accelerator.prepare(model, built)
    base = optimizer_chain(optimizer)[-1]  # the optimizer that updates the tensors

    ids = torch.randint(0, 1024, (1, SEQ_LEN), generator=torch.Generator().manual_seed(accelerator.process_index))
    ids = ids.to(accelerator.device)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)  # under DeepSpeed this also runs the optimizer step
    optimizer.step()
    measured = measure_rank_state_bytes(model, optimizer)
    optimizer.zero_grad()

    record = {"rank": accelerator.process_index, "world_size": accelerator.num_processes,
              "strategy": strategy_name(accelerator), "lora": args.lora, "loss": float(loss.detach()),
              "optimizer_kept": base is built, "decoupled_decay": getattr(base, "adam_w_mode", True), **measured}
    records = gather_object([record])
    if accelerator.is_main_process:
        args.out.write_text(json.dumps(records, indent=2))
    accelerator.wait_for_everyone()
    return 0


if __name__ == "__main__":
    from toolkit.runtime.process import exit_without_teardown

    exit_without_teardown(main())
