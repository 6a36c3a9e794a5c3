"""An RL stage (objective grpo) inside the run: the grpo objective of the loop (toolkit/train/objectives.py).

Before anything heavy loads, `check_rl_stages` refuses what a grpo stage cannot train (a global batch of
`micro_batch_size x grad_accum x data-parallel replicas` completions that is not whole groups of
`rl.num_generations`, TRL's rule; vision prompts; Ulysses); the rewards are
built, and user modules imported, with the generation evals' scorers (toolkit/evals/evaluator.py `import_scorers`).

Each step (`rollout_step`): the stage sampler's prompts (with rl.prioritize, drawn by failure rate; with
rl.dynamic_sampling, drawn again while groups are all right or all wrong) are completed by whole groups, prompt p by
rank p mod world, under the run's strategy with the full weights gathered once a draw (toolkit/evals/rollout.py),
and scored on the rank that drew them (toolkit/evals/rewards.py); one gather gives every rank the global batch, its
group advantages (toolkit/train/grpo.py) and its own micro-batches; the loss runs through the loss head's per-token
log-probs, normalised over the global batch (`_GrpoLoss`); TRL's metrics and the step's generation and scoring time
go to the step record, the completions with their rewards to `<output_dir>/rollouts/<stage>.jsonl`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate.utils import gather_object

from toolkit.config.schema import ORDERED, RL_MEASURES
from toolkit.config.stages import ResolvedStage
from toolkit.curriculum.pass_rates import SuccessRates, pass_rate_buckets
from toolkit.curriculum.stages import Stage
from toolkit.data.batching import MicroBatch
from toolkit.data.plan import kept_by_rank
from toolkit.errors import ToolkitError
from toolkit.evals.rewards import Reward, build_rewards, score_completions
from toolkit.evals.rollout import rollout
from toolkit.evals.scoring import RowSums, ScoreCache, score_key
from toolkit.model.loss_head import loss_head_of
from toolkit.runtime import process as distributed
from toolkit.runtime.run_dir import RunLayout
from toolkit.strategies.full_weights import full_weights_for_generation, shards_parameters
from toolkit.train import grpo
from toolkit.train.preference import adapter_disabled
from toolkit.train.rl_reference import entry_reference, reference_logps
from toolkit.train.stage_scores import ScoringStopped, scorer_identity, stop_for_signal

log = logging.getLogger("toolkit")


def check_rl_stages(stages: list[ResolvedStage], *, grad_accum: int, place: Any, vision: bool) -> None:
    """Refuse, in one line each, what a grpo stage cannot train: a global batch that is not whole groups of
    `rl.num_generations` completions, vision-language prompts (not proven yet), Ulysses sequence parallelism
    (`place`: toolkit.strategies.sequence_parallel.layout; a completion's log-probs would be split)."""
    replicas = place.dp_size
    for stage in stages:
        if not stage.prompts or stage.rl is None:
            continue
        where = f"stages.{stage.index} ('{stage.name}')"
        if place.sequence_parallel:
            raise ToolkitError(f"{where}: objective grpo under Ulysses sequence parallelism is not supported yet (a "
                               "completion's per-token log-probs would be split across the group's slices); launch "
                               "it with zero3.yaml (or any config without parallelism_config_sp_size).")
        if vision:
            raise ToolkitError(f"{where}: objective grpo on a vision-language model is not supported yet (its image "
                               "prompts' rollouts are not proven); train this stage on a text model, or make it sft "
                               "or dpo.")
        g = stage.rl.num_generations
        batch = stage.micro_batch_size * grad_accum * replicas
        if batch % g:
            fits = [m for m in range(1, 4 * g + 1) if (m * grad_accum * replicas) % g == 0][:1]
            hint = f"set the stage's micro_batch_size to {fits[0]}, or " if fits else ""
            raise ToolkitError(f"{where}: rl.num_generations {g} does not divide the global batch of {batch} "
                               f"completions (micro_batch_size {stage.micro_batch_size} x grad_accum {grad_accum} x "
                               f"{replicas} process(es)); {hint}choose num_generations dividing {batch}.")


# ------------------------------------------------------------------------------------------------- rollouts


def slots_of(rank: int, world: int, accum: int, micro: int) -> list[list[int]]:
    """Rank `rank`'s completion slots of a step, one list per micro-step: micro-step j of rank r holds the global
    batch's slots [(j * world + r) * micro, ... + micro), as the data loader places rows (toolkit/data/batching.py).
    Slot c is sample c mod G of the step's prompt c // G (G = rl.num_generations)."""
    return [list(range((j * world + rank) * micro, (j * world + rank + 1) * micro)) for j in range(accum)]


def stage_rewards(stage: ResolvedStage, recipe_dir: Path) -> list[Reward]:
    """The stage's rewards, built by toolkit/evals/rewards.py from its `rewards:` entries."""
    assert stage.rl is not None
    return build_rewards([r.model_dump() for r in stage.rewards], key=f"stages.{stage.index}.rewards",
                         recipe_dir=recipe_dir, max_completion_length=stage.rl.max_completion_length)


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """The end tokens a completion stops at: the model's generation config's and the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


# ------------------------------------------------------------------------------------------------- the objective


@dataclass
class StepRollout:
    """One step's rollouts on this rank: its micro-batches (the forward's inputs) with each row's advantage and
    completion mask, the step's global metrics (rank 0 adds them to the all-reduce) and the completions' records
    (rank 0 writes them)."""

    micro: list[MicroBatch]
    advantages: list[torch.Tensor]
    masks: list[torch.Tensor]
    tokens: float  # the global batch's completion tokens in the loss (after mask_truncated_completions)
    sequences: int
    metrics: dict[str, float]
    records: list[dict[str, Any]]
    old_logps: list[torch.Tensor] = field(default_factory=list)  # per micro-batch: the rollout's, [B, C]
    ref_logps: list[torch.Tensor] = field(default_factory=list)  # per micro-batch: the KL reference's (rl.beta > 0)


@dataclass
class RlState:
    """The run's RL stages: their rewards (built at a stage's entry), this step's rollout, and the metric values
    of the logging interval not yet written (a checkpoint keeps them: `RunState.pending_rl`), name -> [sum of the
    steps' values, steps]."""

    rewards: dict[int, list[Reward]] = field(default_factory=dict)
    current: StepRollout | None = None
    names: list[str] = field(default_factory=list)  # the current step's sums, in order
    pending: dict[str, list[float]] = field(default_factory=dict)
    recipe_dir: Path = field(default_factory=Path.cwd)  # where `module:function` rewards not yet imported are
    tokenizer: Any = None  # the run's tokenizer: renders nothing, decodes completions and pads the policy batch
    rates: dict[int, SuccessRates] = field(default_factory=dict)  # rl.prioritize stages' success rates
    saved_rates: dict[str, Any] = field(default_factory=dict)  # a checkpoint's rates, loaded at the stage's first step
    references: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # rl.beta > 0: the entry's values

    def rates_of(self, stage: Stage) -> SuccessRates:
        """The stage's success rates (rl.prioritize), from the checkpoint when the run resumed inside the stage."""
        if stage.index not in self.rates:
            rates = SuccessRates(len(stage.data.samples))
            saved = self.saved_rates.pop(str(stage.index), None)
            if saved is not None:
                rates.load_state_dict(saved)
            self.rates[stage.index] = rates
        return self.rates[stage.index]

    def rates_state(self) -> dict[str, Any] | None:
        """Every prioritised stage's rates for the checkpoint (None: no such stage ran)."""
        out = {**self.saved_rates, **{str(i): r.state_dict() for i, r in self.rates.items()}}
        return out or None

    def add(self, name: str, value: float) -> None:
        if value == value:  # NaN: not computed this step
            got = self.pending.setdefault(name, [0.0, 0.0])
            got[0] += value
            got[1] += 1

    def record(self) -> dict[str, float]:
        out = {name: total / n for name, (total, n) in self.pending.items() if n}
        self.pending = {}
        return out


TOKEN_METRICS = grpo.METRICS


def correctness(table: torch.Tensor) -> torch.Tensor:
    """Each completion's binary correctness: its score by the stage's first reward above 0.5 (a reward that
    returned None counts as wrong). What rl.prioritize's success rates and rl.dynamic_sampling's filter read."""
    first = table[:, 0]
    return (first.nan_to_num(0.0) > 0.5).to(torch.float64)


def draw_prompts(stage: Stage, rates: SuccessRates | None, count: int, *, seed: int, step: int, step_in_stage: int,
                 draw: int) -> list[int]:
    """A step's `count` prompts (stage row indices) for its `draw`-th draw: the stage sampler's batch first, then
    (dynamic sampling's later draws) `count` prompts uniformly from a generator of (seed, step, draw); with
    rl.prioritize, in proportion to 1 - success rate (`SuccessRates.sample`, by chunks of the stage's size when a
    step asks more prompts than it has). Only prompts a `drop` keeps are drawn. The same on every rank and after a
    resume."""
    kept = stage.sampler.kept
    n = len(stage.data.samples) if kept is None else len(kept)
    if rates is not None:
        out: list[int] = []
        while len(out) < count:
            part = len(out) // n
            out += rates.sample(min(n, count - len(out)), seed=seed, step=step, draw=draw + part * 1_000_003,
                                among=kept).tolist()
        return [int(i) for i in out]
    if draw == 0:
        return [int(i) for i in stage.sampler.batch(step_in_stage)]
    rng = np.random.default_rng([seed, step, draw])
    picked = rng.choice(n, size=count, replace=count > n)
    return [int(i) for i in (picked if kept is None else kept[picked])]


@dataclass
class _Drawn:
    """One draw's completions, by global slot (prompt p's sample j at p * G + j), and their reward table."""

    completion_ids: list[list[int]]
    texts: list[str]
    truncated: list[bool]
    logps: list[list[float]]  # each completion token's log-prob at the sampling temperature (the old policy's)
    table: torch.Tensor
    generation: float  # seconds
    scoring: float


def _draw(run: Any, stage: Stage, rows: list[dict[str, Any]], keys: list[int], step: int, *,
          num_generations: int | None = None, base: bool = False, prompts_per_batch: int = 1) -> _Drawn:
    """Complete and score `rows` by whole groups (of `num_generations`, default rl.num_generations), prompt p by
    rank p mod world (`keys[p]` seeds its samples), `prompts_per_batch` groups a generate call, and gather the
    completions and rewards to every rank. `base`: drawn with the LoRA adapter off. Collective."""
    acc, rl, tokenizer = run.accelerator, stage.resolved.rl, run.rl.tokenizer
    g, world, rank = num_generations or rl.num_generations, acc.num_processes, acc.process_index
    mine = list(range(rank, len(rows), world))
    lockstep = shards_parameters(acc) and world > 1
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rewards = run.rl.rewards[stage.index]
    drawn, scored, error = None, None, None
    started = time.perf_counter()
    if mine or lockstep:  # a rank with no prompt keeps the others company under sharded weights
        # Under the launch's mixed precision, as the training forward runs: `generate` calls the unwrapped model,
        # outside the autocast accelerate wraps the prepared forward in, and the adapters' input casts are off for
        # the run (`skip_adapter_input_casts`), so a 16-bit base would feed its hidden states to fp32 adapters.
        with acc.autocast(), full_weights_for_generation(acc, run.model) as policy, \
                adapter_disabled(policy) if base else contextlib.nullcontext():
            stops = eos_ids(policy, tokenizer)
            asked = mine or [0]
            drawn = rollout(policy, [rows[p]["prompt_ids"] for p in asked], [keys[p] for p in asked],
                            num_generations=g, max_completion_length=rl.max_completion_length,
                            temperature=rl.temperature, top_p=rl.top_p, seed=run.recipe.train.seed, step=step,
                            eos_ids=stops, pad_id=pad, prompts_per_batch=prompts_per_batch,
                            rounds=math.ceil(math.ceil(len(rows) / world) / prompts_per_batch),
                            lockstep=lockstep)
    generated = time.perf_counter()
    texts: list[str] = []
    if mine and drawn is not None:
        texts = tokenizer.batch_decode(drawn.completion_ids, skip_special_tokens=True)
        owners = [rows[p] for p in mine for _ in range(g)]
        completions = [t if isinstance(o["prompt"], str) else [{"role": "assistant", "content": t}]
                       for o, t in zip(owners, texts, strict=True)]
        columns = {k: [o["columns"].get(k) for o in owners] for k in sorted({k for o in owners for k in o["columns"]})}
        columns["reference"] = [o["reference"] for o in owners]
        scored, error = score_completions(rewards, [o["prompt"] for o in owners], completions, drawn.completion_ids,
                                          columns, [o["where"] for o in owners])
    scoring = time.perf_counter() - generated
    local = {"prompts": mine, "error": error,
             "completion_ids": drawn.completion_ids if mine and drawn else [], "texts": texts,
             "truncated": drawn.truncated if mine and drawn else [],
             "logps": drawn.logps if mine and drawn else [],
             "rewards": scored.tolist() if scored is not None else []}
    parts = gather_object([local])
    failed = next((part["error"] for part in parts if part["error"] is not None), None)
    if failed is not None:
        raise ToolkitError(failed)  # on every rank: the error was gathered to all
    completion_ids: list[list[int]] = [[] for _ in range(len(rows) * g)]
    texts_all, truncated = [""] * len(completion_ids), [False] * len(completion_ids)
    logps: list[list[float]] = [[] for _ in completion_ids]
    table = torch.full((len(completion_ids), len(rewards)), float("nan"), dtype=torch.float64)
    for part in parts:
        for n, p in enumerate(part["prompts"]):
            for j in range(g):
                c, k = p * g + j, n * g + j
                completion_ids[c], texts_all[c] = part["completion_ids"][k], part["texts"][k]
                truncated[c], logps[c] = part["truncated"][k], part["logps"][k]
                table[c] = torch.tensor(part["rewards"][k], dtype=torch.float64)
    return _Drawn(completion_ids, texts_all, truncated, logps, table, generated - started, scoring)


def rollout_step(run: Any, stage: Stage, step_in_stage: int, step: int) -> StepRollout:
    """The step's rollouts. Its prompts (the stage sampler's global batch; with rl.prioritize, drawn in proportion
    to 1 - their success rates) are drawn by whole groups, prompt p by rank p mod world (toolkit/evals/rollout.py:
    batched with the KV cache, one prompt's rl.num_generations rows a batch, each completion seeded by (run seed,
    step, draw x prompts + p, sample index), so it is the same on any number of processes), and scored there
    (toolkit/evals/rewards.py); the completions and rewards are then gathered to every rank (one object gather).
    With rl.dynamic_sampling, groups whose correctness is all equal are set aside and prompts drawn again, up to
    rl.max_resample more draws, until the batch is whole (DAPO); set-aside groups fill what is still missing, in
    draw order. Every rank then takes the group advantages (`grpo.group_advantages`) and builds its own
    micro-batches (`grpo.policy_batch`: slots as the data loader places rows, `slots_of`)."""
    acc, rl, tokenizer = run.accelerator, stage.resolved.rl, run.rl.tokenizer
    g, world, rank = rl.num_generations, acc.num_processes, acc.process_index
    accum, micro = run.recipe.train.grad_accum, stage.plan.micro_batch
    seed = run.recipe.train.seed
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rewards = run.rl.rewards[stage.index]
    rates = run.rl.rates_of(stage) if rl.prioritize == "failure_rate" else None
    count = len(stage.sampler.batch(step_in_stage))
    useful: list[tuple[int, _Drawn, int]] = []  # (prompt, its draw, its place there), in draw order
    spare: list[tuple[int, _Drawn, int]] = []
    all_correct: list[torch.Tensor] = []
    for draw in range(1 + (rl.max_resample if rl.dynamic_sampling else 0)):
        chosen = draw_prompts(stage, rates, count, seed=seed, step=step, step_in_stage=step_in_stage, draw=draw)
        drawn = _draw(run, stage, [stage.data.samples[i] for i in chosen],
                      [draw * count + p for p in range(count)], step)
        correct = correctness(drawn.table)
        all_correct.append(correct)
        if rates is not None:  # the global batch's outcomes, the same on every rank
            rates.record([chosen[c // g] for c in range(len(correct))], correct.tolist())
        keep = (grpo.informative_groups(correct, g).tolist() if rl.dynamic_sampling else [True] * count)
        for p in range(count):
            (useful if keep[p] else spare).append((chosen[p], drawn, p))
        if len(useful) >= count:
            break
    batch = (useful + spare)[:count]
    chosen = [prompt for prompt, _, _ in batch]
    rows = [stage.data.samples[i] for i in chosen]
    completion_ids = [d.completion_ids[p * g + j] for _, d, p in batch for j in range(g)]
    texts_all = [d.texts[p * g + j] for _, d, p in batch for j in range(g)]
    truncated = [d.truncated[p * g + j] for _, d, p in batch for j in range(g)]
    old_logps = [d.logps[p * g + j] for _, d, p in batch for j in range(g)]
    table = torch.cat([d.table[p * g:(p + 1) * g] for _, d, p in batch])
    mine = list(range(rank, len(rows), world))
    drawn_ones = list({id(d): d for _, d, _ in useful + spare}.values())
    generation, scoring = sum(d.generation for d in drawn_ones), sum(d.scoring for d in drawn_ones)
    combined = grpo.combined_rewards(table, [r.weight for r in rewards])
    advantages, zero_std = grpo.group_advantages(combined, g, rl.scale_rewards)
    lengths = torch.tensor([len(ids) for ids in completion_ids], dtype=torch.float64)
    cut = torch.tensor(truncated)
    kept = lengths.masked_fill(cut, 0.0) if rl.mask_truncated_completions else lengths
    std = (grpo.nanstd(combined.view(-1, g), dim=1) if rl.scale_rewards != "batch"
           else grpo.nanstd(combined).expand(len(rows)))
    metrics = {"reward": float(torch.nanmean(combined)), "reward_std": float(torch.nanmean(std)),
               "frac_reward_zero_std": float(zero_std.double().mean()),
               **{f"rewards/{r.name}/mean": float(torch.nanmean(table[:, i])) for i, r in enumerate(rewards)},
               "completions/mean_length": float(lengths.mean()),
               "completions/clipped_ratio": float(cut.double().mean()),
               "time/generation": generation, "time/scoring": scoring}
    if rl.dynamic_sampling or rates is not None:
        drawn_all = torch.cat(all_correct)
        metrics.update({"rl/drawn": float(len(drawn_all) // g), "rl/dropped": float(len(spare)),
                        "rl/filled": float(max(0, count - len(useful))), **pass_rate_buckets(drawn_all.tolist(), g)})
    micro_batches, advs, masks, olds = [], [], [], []
    for js in slots_of(rank, world, accum, micro):
        p_ids, p_mask = _pad([rows[c // g]["prompt_ids"] for c in js], pad, left=True)
        c_ids, c_mask = _pad([completion_ids[c] for c in js], pad, left=False)
        if rl.mask_truncated_completions:
            c_mask = grpo.mask_truncated(c_mask, cut[js])
        batch = grpo.policy_batch(p_ids, p_mask, c_ids, c_mask)
        micro_batches.append(MicroBatch(batch, [int(p_mask[i].sum() + c_mask[i].sum()) for i in range(len(js))],
                                        int(c_mask.sum())))
        advs.append(advantages[js].to(torch.float32))
        masks.append(c_mask)
        olds.append(_pad_logps([old_logps[c] for c in js], c_mask.shape[1]))
    records = [{"step": step + 1, "stage": stage.name, "slot": p * g + j, "prompt": int(chosen[p]), "sample": j,
                "where": rows[p]["where"], "completion": texts_all[p * g + j], "rewards": table[p * g + j].tolist(),
                "advantage": float(advantages[p * g + j]), "truncated": truncated[p * g + j],
                **({"prompt_text": tokenizer.decode(rows[p]["prompt_ids"]), "reference": rows[p]["reference"]}
                   if j == 0 else {})}  # the group's first completion carries its prompt for the run page
               for p in mine for j in range(g)]
    refs = (reference_logps(run, run.rl.references[stage.index], [mb.batch for mb in micro_batches], masks,
                            rl.temperature) if rl.beta > 0 else [])
    return StepRollout(micro_batches, advs, masks, float(kept.sum()), len(completion_ids), metrics, records, olds,
                       refs)


def _pad_logps(rows: list[list[float]], width: int) -> torch.Tensor:
    """Completions' per-token log-probs on the `[B, width]` completion grid (right-padded with 0, masked out)."""
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


def _pad(rows: list[list[int]], pad: int, *, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows padded to one width (left: prompts, right: completions), with their masks."""
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            span = slice(width - len(r), width) if left else slice(0, len(r))
            ids[i, span], mask[i, span] = torch.tensor(r, dtype=torch.long), 1
    return ids, mask


class _GrpoLoss:
    """A grpo stage's step: the loss of its micro-batches, normalised over the global batch as rl.loss_type says
    (`grpo.normaliser`), through the loss head's per-token log-probs (no full-vocabulary logits)."""

    dtype = torch.float32

    def __init__(self, run: Any, stage: Stage, divisor: int) -> None:
        self.run, self.stage, self.rollout = run, stage, run.rl.current
        rl = stage.resolved.rl
        self.settings = grpo.GrpoSettings(
            loss_type=rl.loss_type, num_generations=rl.num_generations,
            max_completion_length=rl.max_completion_length, temperature=rl.temperature, top_p=rl.top_p,
            beta=rl.beta, epsilon=rl.epsilon, epsilon_high=rl.epsilon_high, scale_rewards=rl.scale_rewards,
            mask_truncated_completions=rl.mask_truncated_completions, num_iterations=rl.num_iterations)
        norm = grpo.normaliser(rl.loss_type, tokens=self.rollout.tokens, sequences=self.rollout.sequences,
                               max_completion_length=rl.max_completion_length)
        self.divisor = norm / divisor
        # The step's global metrics (the same on every rank) are added by rank 0 alone; the token metrics' sums
        # are every rank's micro-batches' (kl only with beta > 0, as TRL logs it).
        self.picked = [i for i, m in enumerate(TOKEN_METRICS) if m != "kl" or rl.beta > 0] + [len(TOKEN_METRICS)]
        run.rl.names = [*self.rollout.metrics, *(f"token/{TOKEN_METRICS[i]}" for i in self.picked[:-1]),
                        "token/count"]
        head = [v if run.accelerator.is_main_process else 0.0 for v in self.rollout.metrics.values()]
        self.sums = torch.tensor([*head, *[0.0] * len(self.picked)], dtype=torch.float64,
                                 device=run.accelerator.device)
        self.width = len(head)

    def micro(self, model: Any, j: int, batch: dict[str, Any]) -> torch.Tensor:
        device = self.run.accelerator.device
        head = loss_head_of(model)
        if head is None:
            raise ToolkitError("objective grpo needs the chunked loss head (model.loss_head: chunked or auto).")
        with head.per_token(self.settings.temperature, entropy=True) as tokens:
            out = model(**batch, num_items_in_batch=1)
        mask = self.rollout.masks[j].to(device)
        logps = grpo.tokens_to_grid(tokens.logps, mask)
        entropies = grpo.tokens_to_grid(tokens.entropies, mask) if tokens.entropies is not None else None
        advantages = self.rollout.advantages[j].to(device)
        # num_iterations > 1: the ratio against the rollout's per-token log-probs, kept for the batch's updates
        old = self.rollout.old_logps[j].to(device) if self.settings.num_iterations > 1 else None
        ref = self.rollout.ref_logps[j].to(device) if self.settings.beta > 0 else None  # the policy at the entry
        loss, terms = grpo.grpo_loss(logps, mask, advantages, self.settings, divisor=self.divisor, old_logps=old,
                                     ref_logps=ref)
        sums = grpo.metric_sums(terms, advantages, mask, self.settings, entropies)
        self.sums[self.width:] += sums[self.picked].to(self.sums.dtype)
        return loss + 0.0 * out.loss  # the backward passes through the model's output (ZeRO-3 opens it there)


class GrpoObjective:
    """GRPO / DAPO / Dr. GRPO on prompts with rewards (objective grpo; rl.loss_type)."""

    name = "grpo"

    def enter(self, run: Any, stage: Stage, step: int) -> None:
        if stage.resolved.prompts and stage.index not in run.rl.rewards:
            run.rl.rewards[stage.index] = stage_rewards(stage.resolved, run.rl.recipe_dir)
        order_by_pass_rate(run, stage, step)  # difficulty by pass_rate: the sampler, before the stage's first step
        rl = stage.resolved.rl
        if rl is not None and rl.beta > 0 and stage.index not in run.rl.references:
            run.rl.references[stage.index] = entry_reference(run, stage, step)  # the policy as it enters

    def micro_batches(self, run: Any, stage: Stage, step_in_stage: int, step: int) -> list[MicroBatch]:
        """The step's micro-batches: a new rollout every rl.num_iterations steps of the stage, trained that many
        times (TRL's GRPOTrainer: a generation's batch is reused for num_iterations optimizer steps, so the stage's
        steps count updates and its prompt batches are the sampler's batch step_in_stage // num_iterations)."""
        iterations = stage.resolved.rl.num_iterations
        if step_in_stage % iterations:
            if run.rl.current is None:  # resumed inside the updates of a batch the checkpoint does not keep
                raise ToolkitError(
                    f"stages.{stage.index} ('{stage.name}'): the checkpoint is at step {step_in_stage} of the stage, "
                    f"inside the {iterations} updates (rl.num_iterations) of one rollout batch, which checkpoints do "
                    f"not keep; resume from a checkpoint whose stage step is a multiple of {iterations}.")
            return run.rl.current.micro
        run.rl.current = rollout_step(run, stage, step_in_stage // iterations, step)
        write_rollouts(run, stage, run.rl.current.records)
        return run.rl.current.micro

    def begin(self, run: Any, stage: Stage, batches: Any, divisor: int, *, whole: Any) -> _GrpoLoss:
        return _GrpoLoss(run, stage, divisor)

    def add_sums(self, run: Any, summed: Any) -> None:
        values = dict(zip(run.rl.names, summed, strict=True))
        count = values.pop("token/count")
        for name, value in values.items():
            if name.startswith("token/"):
                run.rl.add(name.removeprefix("token/"), value / count if count else float("nan"))
            else:
                run.rl.add(name, value)

    def record(self, run: Any) -> dict[str, float]:
        return run.rl.record()

    def evaluate(self, run: Any, model: Any, stage: Stage) -> dict[str, Any] | None:
        return None


# ------------------------------------------------------------------------------------ the pass-rate curriculum


PASS_RATE_BLOCK = 8
"""Prompts per process in one block of the pass-rate pass (kept in the run folder as each block ends)."""
PASS_RATE_KEYS = 1 << 40
"""Prompt i's samples in the pass-rate pass are seeded by key PASS_RATE_KEYS + i: apart from the training draws'."""


def pass_rate_key(run: Any, stage: Stage, scorer: str, samples: int) -> str:
    """What decides a stage's pass rates: its prompts (token ids and references), the model (`base`, or the run's
    state at the stage's first step), the completions drawn (samples, temperature, top-p, length, seed) and the
    reward that judges them (the stage's first)."""
    rl = stage.resolved.rl
    assert rl is not None
    prompts = hashlib.sha256(json.dumps([[s["prompt_ids"], s["reference"]] for s in stage.data.samples],
                                        default=str).encode()).hexdigest()
    return score_key(rows=prompts, scorer=scorer_identity(run.identity, scorer, stage.plan.start_step,
                                                          precision=run.accelerator.mixed_precision),
                     render="pass_rate", samples=samples, reward=stage.resolved.rewards[0].model_dump(),
                     sampling=[rl.temperature, rl.top_p, rl.max_completion_length, run.recipe.train.seed])


def order_by_pass_rate(run: Any, stage: Stage, step: int) -> np.ndarray | None:
    """`difficulty: {by: pass_rate}`: each prompt's failure rate (the share of `difficulty.samples` completions,
    default rl.num_generations, that the stage's first reward finds wrong, `correctness`), drawn at the stage's
    entry by the current policy or the base (`model: base`: the LoRA adapter off), prompt p by rank p mod world
    under the run's strategy as a training rollout is (`_draw`), each seeded by (run seed, the stage's first step
    for current or 0 for base, PASS_RATE_KEYS + p, sample index): the same on any process count. The stage's
    sampler is then ordered by it (`easy_to_hard`: the most solved first) and a `drop` leaves out the most and least
    solved prompts. Kept in `<output_dir>/scores/scores-<key>.npz` block by block as the loss scores are
    (toolkit/evals/scoring.py `ScoreCache`: failures as `loss`, samples as `tokens`): a pass stopped by a signal
    goes on at the relaunch, a resume reads them back, and a resume past the current policy's entry whose file is
    gone is refused in one line. Returns the failure rates, or None for a stage not so ordered. Collective."""
    how, rl = stage.resolved.difficulty, stage.resolved.rl
    if how is None or how.by not in RL_MEASURES or rl is None:
        return None
    if stage.resolved.order not in ORDERED and stage.resolved.drop is None:
        return None
    acc = run.accelerator
    scorer = str(how.model)
    k = how.samples or rl.num_generations
    samples = stage.data.samples
    key = pass_rate_key(run, stage, scorer, k)
    folder = Path(run.recipe.output_dir) / "scores"
    cache = ScoreCache(folder, key, len(samples), writer=acc.is_main_process)
    if not cache.complete and run.resumed_from is not None:
        theirs = ScoreCache(RunLayout.of_checkpoint(Path(run.resumed_from)).scores, key, len(samples), writer=False)
        if theirs.complete and theirs.path != cache.path:
            cache.record(np.arange(len(samples)), theirs.sums)
    cache.sums, cache.done = distributed.broadcast_from_main(acc, (cache.sums, cache.done))
    what = f"stage '{stage.name}' pass rates ({k} completions a prompt by the {scorer} model)"
    base = scorer == "base"
    at = 0 if base else stage.plan.start_step
    if not cache.complete and not base and step != at:
        raise ToolkitError(f"{what}: {cache.path} is missing or incomplete, and this launch resumes past the stage's "
                           f"first step {at}, where they were measured; measuring now would use a later policy. "
                           "Restore the file, or resume from a checkpoint at or before that step.")
    preemption = getattr(run, "preemption", None)
    stop = stop_for_signal(run, step) if preemption is not None and preemption.started else None
    todo = np.flatnonzero(~cache.done)
    if len(todo):
        log.info("%s: %d of %d prompts to measure", what, len(todo), len(samples))
    block = PASS_RATE_BLOCK * acc.num_processes
    for start in range(0, len(todo), block):
        index = todo[start:start + block]
        drawn = _draw(run, stage, [samples[int(i)] for i in index], [PASS_RATE_KEYS + int(i) for i in index], at,
                      num_generations=k, base=base, prompts_per_batch=PASS_RATE_BLOCK)
        wrong = k - correctness(drawn.table).view(-1, k).sum(dim=1).numpy()
        cache.record(index, RowSums(wrong.astype(np.float64), np.full(len(index), k, dtype=np.int64)))
        if stop is not None and stop():
            raise ScoringStopped(what)
    failure = cache.sums.loss / np.maximum(cache.sums.tokens, 1)
    keep = None
    if stage.data.dropped_by_score is not None:
        keep = kept_by_rank(failure, *stage.data.dropped_by_score)
        easy, hard = stage.data.dropped_by_score
        log.info("stage '%s': dropped the %d most and the %d least solved of its %d prompts (%d kept)", stage.name,
                 easy, hard, len(failure), int(keep.sum()))
    stage.data.difficulty = failure
    stage.sampler = stage.sampler.with_difficulty(failure, keep)
    log.info("%s: solved %.3g on average; %d never, %d always", what, float(1 - failure.mean()),
             int((failure == 1).sum()), int((failure == 0).sum()))
    return failure


ROLLOUTS = "rollouts"
"""The run folder's subfolder of RL stages' completions, `<stage>.jsonl` each (cut back to the step on a resume;
`RunLayout.rollouts`)."""


def write_rollouts(run: Any, stage: Stage, records: list[dict[str, Any]]) -> None:
    """The step's completions with their rewards and advantages, gathered to rank 0 and appended to
    `<output_dir>/rollouts/<stage>.jsonl` (one line per completion, in slot order; a group's first carries its
    prompt as the rollout fed it, `prompt_text`, and the row's `reference`, for the run page). Collective."""
    everything = gather_object(records)
    if not run.accelerator.is_main_process:
        return
    path = RunLayout(Path(run.recipe.output_dir)).rollouts / f"{stage.name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = sorted(everything, key=lambda r: r["slot"])
    with path.open("a", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
