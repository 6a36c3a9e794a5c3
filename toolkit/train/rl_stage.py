"""An RL stage (objective grpo) inside the run: what it refuses before anything heavy loads.

A grpo stage's global batch is `micro_batch_size x grad_accum x data-parallel replicas` completions, whole groups of
`rl.num_generations` completions of one prompt (TRL's rule: the global batch divides by num_generations). Its
rewards' user functions are imported before the data and the model load, so a module that does not import stops the
run in one line naming the reward's key.
"""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate.utils import gather_object
from transformers import GenerationConfig

from toolkit.config.schema import RlConfig, ScorerConfig
from toolkit.config.stages import ResolvedStage
from toolkit.curriculum.stages import Stage
from toolkit.data.batching import MicroBatch
from toolkit.errors import ToolkitError
from toolkit.evals.scorers import Scorer, build_scorer, importable_from
from toolkit.model.loss_head import loss_head_of
from toolkit.strategies.full_weights import full_weights_for_generation, shards_parameters
from toolkit.train import grpo


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
        rl = stage.rl
        for key, on, why in (("num_iterations", rl.num_iterations > 1, "one update per rollout batch"),
                             ("beta", rl.beta > 0, "no KL reference"),
                             ("dynamic_sampling", rl.dynamic_sampling, "every drawn group trains"),
                             ("prioritize", rl.prioritize is not None, "prompts drawn by the stage's order")):
            if on:
                raise ToolkitError(f"{where}: rl.{key} is {getattr(rl, key)}, which this build does not train yet; "
                                   f"remove it (the default: {why}).")
        g = stage.rl.num_generations
        batch = stage.micro_batch_size * grad_accum * replicas
        if batch % g:
            fits = [m for m in range(1, 4 * g + 1) if (m * grad_accum * replicas) % g == 0][:1]
            hint = f"set the stage's micro_batch_size to {fits[0]}, or " if fits else ""
            raise ToolkitError(f"{where}: rl.num_generations {g} does not divide the global batch of {batch} "
                               f"completions (micro_batch_size {stage.micro_batch_size} x grad_accum {grad_accum} x "
                               f"{replicas} process(es)); {hint}choose num_generations dividing {batch}.")


# ------------------------------------------------------------------------------------------------- rewards


@dataclass
class Reward:
    """One reward of a stage: its metric name, weight and function, called as TRL calls a reward function:
    fn(prompts=..., completions=..., completion_ids=..., reference=..., **columns) -> a list of floats (None: the
    sample is not scored by it)."""

    name: str
    weight: float
    key: str  # the recipe key (stages.N.rewards.M), for error lines
    fn: Callable[..., list[float | None]]


def _scorer_reward(scorer: Scorer) -> Callable[..., list[float | None]]:
    """A generation-eval scorer (fn(output, reference, row)) under TRL's reward contract."""
    def reward(*, completions: list[Any], reference: list[Any], **columns: list[Any]) -> list[float | None]:
        out: list[float | None] = []
        for i, completion in enumerate(completions):
            text = completion if isinstance(completion, str) else completion[-1]["content"]
            row = {k: v[i] for k, v in columns.items() if k not in ("prompts", "completion_ids")}
            out.append(scorer.fn(text, reference[i], row))
        return out

    return reward


def build_rewards(stage: ResolvedStage, recipe_dir: Path) -> list[Reward]:
    """The stage's rewards: the generation-eval scorers (exact, contains, regex, json_valid) and user functions
    (`module:function`, TRL's contract), imported before anything heavy from the recipe's folder
    (toolkit/evals/scorers.py `check_reward_imports`, so found here among the imported modules; `recipe_dir` is
    searched for one that is not). math, think_format and overlong are not available in this build."""
    out = []
    for j, spec in enumerate(stage.rewards):
        key = f"stages.{stage.index}.rewards.{j}"
        if ":" in spec.scorer:
            module_name, _, name = spec.scorer.partition(":")
            with importable_from(recipe_dir):
                fn = getattr(importlib.import_module(module_name), name)
        elif spec.scorer in ("exact", "contains", "regex", "json_valid"):
            fn = _scorer_reward(build_scorer(ScorerConfig(kind=spec.scorer, pattern=spec.pattern), key=key,
                                             recipe_dir=recipe_dir))
        else:
            raise ToolkitError(f"{key}: reward scorer {spec.scorer} is not available in this build yet; use exact, "
                               "contains, regex, json_valid or a module:function reward.")
        out.append(Reward(spec.metric, spec.weight, key, fn))
    return out


def score(rewards: list[Reward], samples: list[dict[str, Any]], completions: list[Any],
          completion_ids: list[list[int]]) -> tuple[np.ndarray, str | None]:
    """``[N, R]`` float64 rewards of this rank's completions (NaN where a reward returned None), and the first error
    (a reward that raised or returned the wrong number of values), carried to every rank rather than raised here."""
    out = np.full((len(completions), len(rewards)), np.nan)
    columns: dict[str, list[Any]] = {}
    for key in sorted({k for s in samples for k in s["columns"]}):
        columns[key] = [s["columns"].get(key) for s in samples]
    for r, reward in enumerate(rewards):
        try:
            values = reward.fn(prompts=[s["prompt"] for s in samples], completions=completions,
                               completion_ids=completion_ids, reference=[s["reference"] for s in samples], **columns)
            values = list(values)
            if len(values) != len(completions):
                raise ValueError(f"returned {len(values)} values for {len(completions)} completions")
            for i, v in enumerate(values):
                out[i, r] = np.nan if v is None else float(v)
        except Exception as e:  # a user's function: its error becomes one line naming it and the rows
            where = ", ".join(dict.fromkeys(s["where"] for s in samples))
            return out, (f"reward {reward.key} ('{reward.name}') raised {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''} (on the completions of {where}).")
    return out, None


# ------------------------------------------------------------------------------------------------- rollouts


def slots_of(rank: int, world: int, accum: int, micro: int) -> list[list[int]]:
    """Rank `rank`'s completion slots of a step, one list per micro-step: micro-step j of rank r holds the global
    batch's slots [(j * world + r) * micro, ... + micro), as the data loader places rows (toolkit/data/batching.py).
    Slot c is sample c mod G of the step's prompt c // G (G = rl.num_generations)."""
    return [list(range((j * world + rank) * micro, (j * world + rank + 1) * micro)) for j in range(accum)]


def sample_seed(seed: int, stage: int, step: int, prompt: int, sample: int) -> int:
    """The sampling seed of one completion: a function of the run's seed and (stage, step in stage, prompt's row,
    sample index) alone, so a completion is the same whichever rank draws it and however the batch is split."""
    return ((((seed * 1_000_003 + stage) * 1_000_003 + step) * 1_000_003 + prompt) * 1_000_003 + sample) % 2**63


def rollout_config(model: Any, tokenizer: Any, rl: RlConfig) -> GenerationConfig:
    """Sampling at rl.temperature and rl.top_p alone (no top-k, min-p or repetition penalty inherited from the
    model's generation_config: TRL's defaults), up to rl.max_completion_length tokens, stopping at the end tokens."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids.append(tokenizer.eos_token_id)
    return GenerationConfig(max_new_tokens=rl.max_completion_length, do_sample=True, num_beams=1,
                            temperature=rl.temperature, top_p=rl.top_p, top_k=0, min_p=0.0, typical_p=1.0,
                            repetition_penalty=1.0, no_repeat_ngram_size=0, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=eos_ids, use_cache=True)


@torch.no_grad()
def generate_completions(accelerator: Any, model: Any, tokenizer: Any, rl: RlConfig,
                         jobs: list[tuple[list[int], int]]) -> list[list[int]]:
    """The completion token ids (up to and including the first end token) of `jobs` ((prompt ids, seed) pairs),
    with the policy's full weights gathered once for all of them (toolkit/strategies/full_weights.py). Each
    completion is drawn alone from its own seed (a batch of one: no padding, no other row's draws), so it does not
    depend on which rank draws it or beside what. Every rank runs as many generate calls (the same number of jobs)
    and, with sharded weights, each call steps until every rank's is done (`synced_gpus`)."""
    lockstep = shards_parameters(accelerator) and accelerator.num_processes > 1
    was_training = model.training
    model.eval()
    out = []
    try:
        with full_weights_for_generation(accelerator, model) as unwrapped:
            settings = rollout_config(unwrapped, tokenizer, rl)
            stops = set(settings.eos_token_id)
            for ids, seed in jobs:
                devices = [accelerator.device] if accelerator.device.type == "cuda" else []
                with torch.random.fork_rng(devices=devices):
                    torch.manual_seed(seed)
                    prompt = torch.tensor([ids], device=accelerator.device)
                    sequences = unwrapped.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                                   generation_config=settings, synced_gpus=lockstep)
                new = sequences[0, len(ids):].tolist()
                end = next((i for i, t in enumerate(new) if t in stops), None)
                out.append(new if end is None else new[:end + 1])
    finally:
        model.train(was_training)
    return out


def _left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids, mask


def _right_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return ids, mask


# ------------------------------------------------------------------------------------------------- the objective


@dataclass
class Rollout:
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


@dataclass
class RlState:
    """The run's RL stages: their rewards (built at a stage's entry), this step's rollout, and the metric values
    of the logging interval not yet written (a checkpoint keeps them: `RunState.pending_rl`), name -> [sum of the
    steps' values, steps]."""

    rewards: dict[int, list[Reward]] = field(default_factory=dict)
    current: Rollout | None = None
    names: list[str] = field(default_factory=list)  # the current step's sums, in order
    pending: dict[str, list[float]] = field(default_factory=dict)
    recipe_dir: Path = field(default_factory=Path.cwd)  # where `module:function` rewards not yet imported are
    tokenizer: Any = None  # the run's tokenizer: renders nothing, decodes completions and pads the policy batch

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


def rollout_step(run: Any, stage: Stage, step_in_stage: int, step: int) -> Rollout:
    """The step's rollouts on this rank: its prompts (the stage sampler's global batch, each completed
    rl.num_generations times), its completions drawn (`generate_completions`), scored by the stage's rewards, the
    global batch's rewards gathered to every rank (one all-gather) for the group advantages (TRL's
    `group_advantages`), and its micro-batches built (`grpo.policy_batch`)."""
    acc, rl = run.accelerator, stage.resolved.rl
    tokenizer = run.rl.tokenizer
    g, world, accum, micro = rl.num_generations, acc.num_processes, run.recipe.train.grad_accum, stage.plan.micro_batch
    prompts = stage.sampler.batch(step_in_stage)
    slots = slots_of(acc.process_index, world, accum, micro)
    mine = [c for js in slots for c in js]
    samples = [stage.data.samples[prompts[c // g]] for c in mine]
    jobs = [(s["prompt_ids"], sample_seed(run.recipe.train.seed, stage.index, step_in_stage, prompts[c // g], c % g))
            for s, c in zip(samples, mine, strict=True)]
    started = time.perf_counter()
    completion_ids = generate_completions(acc, run.model, tokenizer, rl, jobs)
    generated = time.perf_counter()
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    completions: list[Any] = [t if isinstance(s["prompt"], str) else [{"role": "assistant", "content": t}]
                              for s, t in zip(samples, texts, strict=True)]
    per_reward, error = score(run.rl.rewards[stage.index], samples, completions, completion_ids)
    stops = set(rollout_config(acc.unwrap_model(run.model), tokenizer, rl).eos_token_id)
    cut = grpo.truncated(completion_ids, sorted(stops))
    local = np.concatenate([per_reward, np.array([[len(ids), float(t), float(error is not None)]
                                                  for ids, t in zip(completion_ids, cut, strict=True)])], axis=1)
    gathered = acc.gather(torch.as_tensor(local, dtype=torch.float64, device=acc.device)).cpu().numpy()
    if gathered[:, -1].any():
        messages = gather_object([error])
        raise ToolkitError(next(m for m in messages if m is not None))
    # Rank r's rows of the gather are its slots in order: put the global batch in slot order.
    order = np.concatenate([np.concatenate(slots_of(r, world, accum, micro)) for r in range(world)])
    table = np.empty_like(gathered)
    table[order] = gathered
    rewards_all = torch.as_tensor(table[:, :-3])
    lengths, truncated = table[:, -3], table[:, -2].astype(bool)
    weights = [r.weight for r in run.rl.rewards[stage.index]]
    combined = grpo.combined_rewards(rewards_all, weights)
    advantages, zero_std = grpo.group_advantages(combined, g, rl.scale_rewards)
    scored = time.perf_counter()
    kept = np.where(truncated, 0, lengths) if rl.mask_truncated_completions else lengths
    grouped = combined.view(-1, g)
    std = grpo.nanstd(grouped, dim=1) if rl.scale_rewards != "batch" else grpo.nanstd(combined).expand(len(grouped))
    metrics = {"reward": float(torch.nanmean(combined)), "reward_std": float(torch.nanmean(std)),
               "frac_reward_zero_std": float(zero_std.double().mean()),
               **{f"rewards/{r.name}/mean": float(torch.nanmean(rewards_all[:, i]))
                  for i, r in enumerate(run.rl.rewards[stage.index])},
               "completions/mean_length": float(lengths.mean()),
               "completions/clipped_ratio": float(truncated.mean()),
               "time/generation": generated - started, "time/scoring": scored - generated}
    micro_batches, advs, masks = [], [], []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for js in slots:
        rows = [mine.index(c) for c in js]
        p_ids, p_mask = _left_pad([samples[i]["prompt_ids"] for i in rows], pad)
        c_ids, c_mask = _right_pad([completion_ids[i] for i in rows], pad)
        if rl.mask_truncated_completions:
            c_mask = grpo.mask_truncated(c_mask, torch.as_tensor(truncated[js]))
        batch = grpo.policy_batch(p_ids, p_mask, c_ids, c_mask)
        lengths_j = [int(p_mask[i].sum() + c_mask[i].sum()) for i in range(len(rows))]
        micro_batches.append(MicroBatch(batch, lengths_j, int(c_mask.sum())))
        advs.append(advantages[js].to(torch.float32))
        masks.append(c_mask)
    records = [{"step": step + 1, "stage": stage.name, "slot": c, "prompt": int(prompts[c // g]), "sample": c % g,
                "where": samples[i]["where"], "completion": texts[i], "rewards": per_reward[i].tolist(),
                "advantage": float(advantages[c]), "truncated": bool(cut[i])} for i, c in enumerate(mine)]
    return Rollout(micro_batches, advs, masks, float(kept.sum()), len(table), metrics, records)


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
        loss, terms = grpo.grpo_loss(logps, mask, advantages, self.settings, divisor=self.divisor)
        sums = grpo.metric_sums(terms, advantages, mask, self.settings, entropies)
        self.sums[self.width:] += sums[self.picked].to(self.sums.dtype)
        return loss + 0.0 * out.loss  # the backward passes through the model's output (ZeRO-3 opens it there)


class GrpoObjective:
    """GRPO / DAPO / Dr. GRPO on prompts with rewards (objective grpo; rl.loss_type)."""

    name = "grpo"

    def enter(self, run: Any, stage: Stage, step: int) -> None:
        if stage.resolved.prompts and stage.index not in run.rl.rewards:
            run.rl.rewards[stage.index] = build_rewards(stage.resolved, run.rl.recipe_dir)

    def micro_batches(self, run: Any, stage: Stage, step_in_stage: int, step: int) -> list[MicroBatch]:
        run.rl.current = rollout_step(run, stage, step_in_stage, step)
        write_rollouts(run, stage, run.rl.current.records)
        return run.rl.current.micro

    def begin(self, run: Any, stage: Stage, batches: Any, divisor: int) -> _GrpoLoss:
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


ROLLOUTS = "rollouts"
"""The run folder's subfolder of RL stages' completions, `<stage>.jsonl` each (cut back to the step on a resume)."""


def write_rollouts(run: Any, stage: Stage, records: list[dict[str, Any]]) -> None:
    """The step's completions with their rewards and advantages, gathered to rank 0 and appended to
    `<output_dir>/rollouts/<stage>.jsonl` (one line per completion, in slot order). Collective."""
    everything = gather_object(records)
    if not run.accelerator.is_main_process:
        return
    path = Path(run.recipe.output_dir) / ROLLOUTS / f"{stage.name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = sorted(everything, key=lambda r: r["slot"])
    with path.open("a", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
