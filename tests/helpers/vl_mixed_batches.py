"""Train the tiny Qwen2.5-VL for 3 steps where rank 0 only ever sees text-only batches and rank 1 image batches.

Run from the repository root (the accelerate configs name ds_configs/*.json relative to it):

    accelerate launch --num_processes 2 --mixed_precision no --config_file accelerate_configs/zero3.yaml \
        tests/helpers/vl_mixed_batches.py OUT_DIR [--no-dummy-image]

Under ZeRO-3 / FSDP every rank must run the vision tower each step (its parameters are gathered collectively);
`VLCollator` guarantees it by feeding text-only batches a masked dummy image. Each rank writes
OUT_DIR/rank{r}.json with its losses. `--no-dummy-image` disables the fix, to reproduce the hang.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # language model only: vision blocks use qkv / proj
STEPS = 3
MICRO_BATCH = 2


def vision_module_names(model: torch.nn.Module) -> dict[str, str]:
    """Name prefixes of the vision tower and its projector (patch merger) in a Qwen2.5-VL / Qwen3-VL `model`: they
    sit at `model.visual` and `model.visual.merger`; wrappers (PEFT, DeepSpeed) only add leading prefixes, which the
    returned names include."""
    modules = dict(model.named_modules())
    tower = next((n for n in modules if n == "visual" or n.endswith(".visual")), None)
    if tower is None or f"{tower}.merger" not in modules:
        raise ValueError(f"{type(model).__name__} has no Qwen-VL vision tower ('visual' with a 'merger').")
    return {"vision_tower": tower, "projector": f"{tower}.merger"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory for the tiny model, data and rank{r}.json")
    parser.add_argument("--no-dummy-image", action="store_true", help="disable the collator's dummy image")
    args = parser.parse_args(argv)

    from toolkit.runtime.process import build_accelerator
    from toolkit.strategies import strategy_name
    from toolkit.strategies.deepspeed import configure_deepspeed
    from toolkit.train.optimizer import build_optimizer

    accelerator = build_accelerator(grad_accum=1, timeout_minutes=3)  # before loading: enables ZeRO-3 init
    from accelerate.utils import set_seed
    from transformers import AutoModelForImageTextToText

    from toolkit.builtin.dummy_data import write_dummy_vl_data
    from toolkit.builtin.vl_model import write_tiny_qwen2_5_vl
    from toolkit.data.collate import VLCollator
    from toolkit.data.sources import iter_jsonl
    from toolkit.data.vision import encode_vl_row
    from toolkit.model.load import apply_lora, load_processor

    rank = accelerator.process_index
    model_dir, data_dir = args.out / "tiny-qwen2.5-vl", args.out / "data"
    with accelerator.main_process_first():
        if accelerator.is_main_process:
            write_tiny_qwen2_5_vl(model_dir)
            write_dummy_vl_data(data_dir, 16)
    set_seed(0)
    # Rank 1 did not build the model: it loads the processor as a run does (load_processor registers its class).
    processor = load_processor(str(model_dir), trust_remote_code=False, chat_template=None)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    model = apply_lora(model, r=4, alpha=8, dropout=0.0, target_modules=LORA_TARGETS, modules_to_save=[])
    names = vision_module_names(model)
    lora_in_vision = [n for n, _ in model.named_modules() if n.startswith(names["vision_tower"]) and "lora_" in n]
    assert not lora_in_vision, f"LoRA reached the vision tower: {lora_in_vision[:3]}"
    for n, p in model.named_parameters():  # the projector trains in full, the rest of the tower stays frozen
        if n.startswith(names["projector"] + "."):
            p.requires_grad_(True)

    configure_deepspeed(accelerator, model, MICRO_BATCH, 1.0)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(accelerator, params, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()

    path = data_dir / "vl_stage2.jsonl"
    want_images = rank % 2 == 1  # rank 0: text-only batches; rank 1: image batches
    samples = []
    for lineno, row in iter_jsonl(path):
        if bool(row.get("images")) == want_images:
            sample = encode_vl_row(row, processor, train_on="assistant", max_seq_len=512, overlength="error",
                                   base_dir=path.parent, where=f"{path}:{lineno}")
            if sample is not None:
                samples.append(sample)
    assert len(samples) >= MICRO_BATCH * STEPS, f"rank {rank}: only {len(samples)} rows"
    collate = VLCollator(processor, dummy_image=not args.no_dummy_image)

    losses = []
    for step in range(STEPS):
        batch = collate(samples[step * MICRO_BATCH:(step + 1) * MICRO_BATCH])
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        print(f"rank {rank} step {step} loss {losses[-1]:.4f} pixel_values={'pixel_values' in batch}", flush=True)

    result = {"rank": rank, "strategy": strategy_name(accelerator), "losses": losses,
              "finite": all(math.isfinite(x) for x in losses), "real_images": want_images}
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    from toolkit.runtime.process import exit_without_teardown

    exit_without_teardown(main())
