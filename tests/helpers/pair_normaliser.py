"""One rank of tests/train/test_preference.py::test_the_pair_loss_normaliser_is_the_global_batch_s_over_2_processes
(run as `python -m tests.helpers.pair_normaliser MODEL INPUT OUT` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
set: gloo on CPU). The ranks hold uneven shares of the global batch (rank 0 one pair, rank 1 three), each takes its
micro-batch's preference loss divided by the global normalisers (`global_normalisers`), and the LoRA gradients are
averaged over the ranks as DDP averages them; rank 0 saves them to OUT."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from toolkit.data.collate import padding_collator
from toolkit.model.loss_head import install_loss_head
from toolkit.runtime import process as distributed
from toolkit.train.preference import (
    PairLogps,
    PreferenceSettings,
    global_normalisers,
    pair_counts,
    policy_logps,
    preference_loss,
    preference_terms,
)

SHARES = {0: (0, 1), 1: (1, 4)}
"""Each rank's pairs of the global batch (as [start, end) pair indices): uneven, so a per-rank normaliser differs."""


def main(model_path: str, given: str, out: str) -> None:
    data = torch.load(given)
    accelerator = distributed.build_accelerator(1, 5)
    rank, world = accelerator.process_index, accelerator.num_processes
    assert world == 2, world
    start, end = SHARES[rank]
    mine = data["sequences"][2 * start:2 * end]
    base = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="sdpa", dtype=torch.float32)
    base.config.use_cache = False
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0))
    loaded = model.load_state_dict(data["lora"], strict=False)  # the test's adapter, nudged, as its pass trained
    assert not loaded.unexpected_keys and not [k for k in loaded.missing_keys if "lora_" in k], loaded
    install_loss_head(model, "chunked", chunk_tokens=7)
    model.train()
    batch = padding_collator(AutoTokenizer.from_pretrained(model_path))(mine)
    n, tokens = pair_counts(batch)
    pairs, chosen_tokens = global_normalisers(accelerator, n, tokens, divisor=world)
    settings = PreferenceSettings(("sigmoid", "sft"), (1.0, 0.5))
    chosen, rejected, c_tokens, r_tokens = policy_logps(model, batch, n, torch.device("cpu"))
    logps = PairLogps(chosen, rejected, data["ref_chosen"][start:end], data["ref_rejected"][start:end], c_tokens,
                      r_tokens)
    preference_loss(settings, preference_terms(settings, logps), pairs, chosen_tokens).backward()
    grads = {n.replace(".default", ""): p.grad.detach().clone() for n, p in model.named_parameters()
             if "lora_" in n and p.grad is not None}
    for grad in grads.values():  # DDP's average of the ranks' gradients
        dist.all_reduce(grad)
        grad /= world
    if rank == 0:
        torch.save(grads, Path(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
