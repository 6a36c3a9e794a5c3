"""The KL reference of an RL stage with `rl.beta > 0`: the policy as it entered the stage.

What "reference" means here. TRL's GRPOTrainer takes the model as GRPO training starts (for a PEFT model, the base
with the adapter disabled, since TRL's run starts from a fresh adapter). In one launch of `[sft, grpo]` the policy
entering the grpo stage is the SFT-trained one; anchoring the KL to the base model would pull the stage back
towards what the SFT stage trained away from. So the reference is the policy at the stage's entry, as for our dpo
stages (toolkit/train/pair_stage.py), which is TRL's choice for a run that starts where the grpo stage starts.

No second model. Only the parameters the stage trains (`requires_grad`: with LoRA the adapter, plus any
`modules_to_save`) move during the stage; every other weight of the reference is the policy's own. At the stage's
entry those trainable values are copied once, whole (gathered under ZeRO-3 / FSDP2), to host memory: a frozen copy
of the adapter (tens of MB for an 8B LoRA). A reference forward swaps them into the policy's gathered weights,
scores the step's micro-batches without gradients, and swaps the current values back (`reference_logps`), inside
the one full-weights block of toolkit/strategies/full_weights.py, so that it works the same under every strategy.
It is a plain tensor swap rather than a second PEFT adapter (`add_adapter` + `set_adapter`) because PEFT's
`set_adapter` marks the active adapter trainable, and a parameter added after `accelerator.prepare` would not be
sharded or wrapped like the others.

The copy is written to `<output_dir>/scores/reference-<key>.safetensors` (main process), the key binding it to
the run's state at the stage's first step as the stage scores' keys do (toolkit/train/stage_scores.py
`scorer_identity`): a resume inside the stage reads it back (from the checkpoint's run folder when resuming into a
new output_dir, copied into the new one) and never takes a later policy for the reference; a resume whose file is
gone is refused in one line.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from toolkit.curriculum.stages import Stage
from toolkit.errors import ToolkitError
from toolkit.evals.scoring import score_key
from toolkit.runtime import process as distributed
from toolkit.runtime.run_dir import RunLayout
from toolkit.strategies.full_weights import full_weights_for_generation, swapped_in, trainable_values
from toolkit.train.grpo import completion_logps
from toolkit.train.stage_scores import scorer_identity


def reference_key(run: Any, stage: Stage) -> str:
    """What decides the stage's reference: the run's state at the stage's first step."""
    return score_key(scorer=scorer_identity(run.identity, "current", stage.plan.start_step), render="rl-reference",
                     stage=stage.index)


def entry_reference(run: Any, stage: Stage, step: int) -> dict[str, torch.Tensor]:
    """The stage's reference values: taken now from the prepared policy when the run stands at the stage's first
    step (and written to the run folder), else read back. Collective."""
    acc = run.accelerator
    name = f"reference-{reference_key(run, stage)}.safetensors"
    path = Path(run.recipe.output_dir) / "scores" / name
    if step == stage.plan.start_step:
        with full_weights_for_generation(acc, run.model) as policy:
            values = trainable_values(policy)
        if acc.is_main_process:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".partial")
            save_file(values, str(partial))
            partial.replace(path)
        return values
    found = None
    if acc.is_main_process:
        places = [path]
        if run.resumed_from is not None:
            places.append(RunLayout.of_checkpoint(Path(run.resumed_from)).scores / name)
        found = next((p for p in places if p.is_file()), None)
        if found is not None and found != path:  # taken over into this run's folder, for its own later resumes
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".partial")
            shutil.copyfile(found, partial)
            partial.replace(path)
            found = path
    found = distributed.broadcast_from_main(acc, None if found is None else str(found))
    if found is None:
        raise ToolkitError(f"stage '{stage.name}' (rl.beta {stage.resolved.rl.beta:g}): its KL reference, the policy "
                           f"at the stage's first step {stage.plan.start_step}, is missing ({path}), and this launch "
                           "resumes past that step; restore the file, or resume from a checkpoint at or before the "
                           "stage's first step.")
    return load_file(found)


@torch.no_grad()
def reference_logps(run: Any, values: dict[str, torch.Tensor], batches: Sequence[dict[str, torch.Tensor]],
                    masks: Sequence[torch.Tensor], temperature: float) -> list[torch.Tensor]:
    """Per micro-batch, the reference's per-token log-probs (`[B, C]`, host float32) of its completions at the
    sampling temperature: the policy with the entry `values` swapped in, in eval mode (no dropout: the same
    reference on every rank and resume), through the loss head as the training forward. Collective under ZeRO-3 /
    FSDP2 (every rank has the same number of micro-batches)."""
    acc = run.accelerator
    out: list[torch.Tensor] = []
    with full_weights_for_generation(acc, run.model) as policy, swapped_in(policy, values):
        was_training = policy.training
        policy.eval()
        try:
            for batch, mask in zip(batches, masks, strict=True):
                on_device = {k: v.to(acc.device) for k, v in batch.items()}
                logps, _ = completion_logps(policy, on_device, mask.to(acc.device), temperature)
                out.append(logps.float().cpu())
        finally:
            policy.train(was_training)
    return out
