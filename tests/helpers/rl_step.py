"""One RL step's pieces in 1 or 2 processes (tests/evals/test_rollout.py): rollout, rewards, advantages and the
loss with its normaliser counted over the global batch; rank 0 writes what every process drew and the step's loss
and LoRA gradients to a JSON file.

Run as `python tests/helpers/rl_step.py MODEL OUT.json` (one process) or under `accelerate launch` with the DDP
config and 2 processes (gloo on CPU). The global batch is 4 prompts x 4 completions; rank r rolls out prompts
[2r, 2r + 2) of them, in batches of one prompt, with the full weights gathered as the run does. The loss of each rank
is its share of the global batch's (the token normaliser summed over ranks), times the world size because DDP
averages gradients: the gradients and the summed loss must equal the one-process ones.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from accelerate.utils import gather_object
from transformers import AutoTokenizer

from tests.helpers.seeded_lora import seeded_lora
from toolkit.evals.rewards import build_rewards, score_completions
from toolkit.evals.rollout import rollout
from toolkit.model.loss_head import install_loss_head
from toolkit.runtime import process as distributed
from toolkit.strategies.full_weights import full_weights_for_generation
from toolkit.train.grpo import (
    GrpoSettings,
    combined_rewards,
    completion_logps,
    group_advantages,
    grpo_loss,
    normaliser,
    policy_batch,
)

LETTERS, G, LENGTH = ("e", "o", "s", "m"), 4, 5


def main(model_path: str, out: str) -> None:
    accelerator = distributed.build_accelerator(1, 5)
    world, rank = accelerator.num_processes, accelerator.process_index
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = seeded_lora(model_path, use_cache=True)  # the policy tests/train/test_grpo.py compares with TRL's
    install_loss_head(model, "chunked", chunk_tokens=5)
    model = accelerator.prepare(model)
    settings = GrpoSettings(num_generations=G, max_completion_length=LENGTH, epsilon_high=0.28)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Write a word with the letter {c}."}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
               for c in LETTERS]
    share = len(LETTERS) // world
    mine = list(range(rank * share, (rank + 1) * share))
    with full_weights_for_generation(accelerator, model) as policy:
        drawn = rollout(policy, [prompts[i] for i in mine], mine, num_generations=G, max_completion_length=LENGTH,
                        temperature=settings.temperature, top_p=settings.top_p, seed=3, step=0,
                        eos_ids=[tokenizer.eos_token_id], pad_id=tokenizer.pad_token_id, prompts_per_batch=1,
                        rounds=share, lockstep=True)
    texts = tokenizer.batch_decode(drawn.completion_ids, skip_special_tokens=True)
    rewards = build_rewards([{"scorer": {"kind": "contains", "lower": True}}], key="rewards", recipe_dir=".",
                            max_completion_length=LENGTH)
    references = [LETTERS[i] for i in mine for _ in range(G)]
    asked = [f"Write a word with the letter {c}." for c in references]
    local, error = score_completions(rewards, asked, texts, drawn.completion_ids, {"reference": references},
                                     [f"prompt {i}" for i in mine for _ in range(G)])
    assert error is None, error
    table = torch.cat(gather_object([local]))
    advantages, _ = group_advantages(combined_rewards(table, [r.weight for r in rewards]), G, "group")
    local_advantages = advantages[rank * share * G:(rank + 1) * share * G]

    t = drawn.tensors(tokenizer.pad_token_id)
    mask = t["completion_mask"]
    tokens = mask.sum().to(torch.float64)
    if world > 1:
        dist.all_reduce(tokens)
    divisor = normaliser(settings.loss_type, tokens=float(tokens), sequences=len(LETTERS) * G,
                         max_completion_length=LENGTH)
    logps, _ = completion_logps(model, policy_batch(t["prompt_ids"], t["prompt_mask"], t["completion_ids"], mask),
                                mask, settings.temperature)
    loss, _ = grpo_loss(logps, mask, local_advantages, settings, divisor=divisor)
    accelerator.backward(loss * world)  # DDP averages the ranks' gradients; the batch's loss is their sum
    total = loss.detach().to(torch.float64)
    if world > 1:
        dist.all_reduce(total)
    completions = gather_object(drawn.completion_ids)
    grads = {n.replace("module.", ""): p.grad.tolist() for n, p in model.named_parameters()
             if "lora_" in n and p.grad is not None}
    if accelerator.is_main_process:
        with open(out, "w") as f:
            json.dump({"completions": completions, "rewards": table.tolist(), "loss": float(total),
                       "advantages": advantages.tolist(), "grads": grads}, f)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
