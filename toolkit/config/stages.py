"""Each stage's effective settings, resolved once from the recipe: its own value where it sets one, else the
recipe-wide default."""

from __future__ import annotations

from dataclasses import dataclass, replace

from toolkit.config.schema import (
    KTO_OBJECTIVES,
    LORA_KEYWORD,
    PREFERENCE_OBJECTIVES,
    RL_OBJECTIVES,
    AdvanceWhen,
    DataEntry,
    DifficultyConfig,
    DropConfig,
    GenerationEvalConfig,
    PacingConfig,
    PreferenceConfig,
    Recipe,
    RewardConfig,
    RlConfig,
)


@dataclass(frozen=True)
class ResolvedStage:
    """One stage's effective settings: its own value where the stage sets one, else the recipe-wide default.

    Resolved once (`resolve_stages`); every consumer (planning, data loading, preflight, evaluation, patience,
    the trainable sets) reads these, so a stage default is written in one place. `lr` is before lr_scaling (it
    depends on the global batch, known only at launch). `trainable` None is the built-in default: every parameter
    (full fine-tuning); a LoRA run's default is ('lora',).
    """

    index: int
    name: str
    paths: tuple[str, ...]
    entries: tuple[DataEntry, ...]  # paths with their split and column mapping
    weights: tuple[float, ...] | None
    mixture_replacement: bool
    order: str
    pacing: PacingConfig | None
    max_seq_len: int
    micro_batch_size: int
    epochs: float | None
    max_steps: int | None
    lr: float
    warmup_ratio: float
    min_lr_ratio: float
    schedule: str  # cosine | linear | constant | wsd | continue
    decay_ratio: float
    eval: tuple[str, ...]
    eval_micro_batch_size: int
    trainable: tuple[str, ...] | None
    trainable_key: str  # the recipe key `trainable` comes from, for error messages
    patience: int | None
    patience_min_delta: float
    generation: tuple[GenerationEvalConfig, ...] = ()
    advance_when: AdvanceWhen | None = None
    difficulty: DifficultyConfig | None = None  # None: the rows' `difficulty` when every row has one, else length
    drop: DropConfig | None = None
    objective: str = "sft"  # sft on rows, or dpo | orpo | simpo on preference pairs (PREFERENCE_OBJECTIVES)
    preference: PreferenceConfig | None = None  # a preference stage's loss and reference (None: the defaults)
    rl: RlConfig | None = None  # a grpo stage's settings (TRL's defaults when the recipe gives none)
    rewards: tuple[RewardConfig, ...] = ()  # a grpo stage's rewards

    @property
    def prompts(self) -> bool:
        """Whether the stage trains on prompts by RL (objective grpo): its rows are prompts with their columns."""
        return self.objective in RL_OBJECTIVES

    @property
    def kto(self) -> bool:
        """Whether the stage trains KTO on unpaired rows marked desirable or not (its rows carry a `label`): each row
        with its KL side, batched and referenced as pairs are (toolkit/data/plan.py KtoRows)."""
        return self.objective in KTO_OBJECTIVES

    @property
    def pairs(self) -> bool:
        """Whether the stage trains on preference pairs (its rows, and its eval rows, are pairs)."""
        return self.objective in PREFERENCE_OBJECTIVES


def resolve_stages(recipe: Recipe) -> list[ResolvedStage]:
    """Every stage's effective settings (see ResolvedStage)."""
    schedule, default_trainable = recipe.schedule, recipe.train.trainable
    if default_trainable is None and recipe.lora.enabled:
        default_trainable = [LORA_KEYWORD]
    resolved = []
    for i, stage in enumerate(recipe.stages):
        micro = stage.micro_batch_size or recipe.train.micro_batch_size
        trainable = stage.trainable or default_trainable
        resolved.append(ResolvedStage(
            index=i, name=stage.name, paths=tuple(stage.paths), entries=difficulty_entries(stage.entries,
                                                                                           stage.difficulty),
            weights=None if stage.weights is None else tuple(stage.weights),
            mixture_replacement=stage.mixture_replacement, order=stage.order, pacing=stage.pacing,
            max_seq_len=stage.max_seq_len or recipe.data.max_seq_len, micro_batch_size=micro,
            epochs=stage.epochs, max_steps=stage.max_steps, lr=stage.lr or recipe.optimizer.lr,
            warmup_ratio=schedule.warmup_ratio if stage.warmup_ratio is None else stage.warmup_ratio,
            min_lr_ratio=schedule.min_lr_ratio if stage.min_lr_ratio is None else stage.min_lr_ratio,
            schedule=stage.schedule or schedule.kind, decay_ratio=schedule.decay_ratio,
            eval=tuple(stage.eval if stage.eval is not None else recipe.eval.data),
            eval_micro_batch_size=recipe.eval.micro_batch_size or micro,
            trainable=None if trainable is None else tuple(trainable),
            trainable_key=f"stages.{i}.trainable" if stage.trainable else "train.trainable",
            patience=stage.patience, patience_min_delta=stage.patience_min_delta,
            generation=tuple(stage.generation if stage.generation is not None else recipe.eval.generation),
            advance_when=stage.advance_when, difficulty=stage.difficulty, drop=stage.drop,
            objective=stage.objective, preference=stage.preference,
            rl=(stage.rl or RlConfig()) if stage.objective in RL_OBJECTIVES else None,
            rewards=tuple(stage.rewards or ())))
    return resolved


def difficulty_entries(entries: list[DataEntry], difficulty: DifficultyConfig | None) -> tuple[DataEntry, ...]:
    """The stage's entries, each reading its difficulty from `difficulty.field` (by: field): the field is mapped
    to the row's `difficulty` as an entry's `columns` would map it, so the token store keeps it."""
    if difficulty is None or difficulty.by != "field" or difficulty.field == "difficulty":
        return tuple(entries)
    mapped = []
    for entry in entries:
        columns = dict(entry.columns)
        columns["difficulty"] = str(difficulty.field)
        mapped.append(replace(entry, columns=tuple(sorted(columns.items()))))
    return tuple(mapped)


def stage_metrics(stages: list[ResolvedStage], index: int, *, all_stages: bool) -> list[str]:
    """The eval metrics a stage's evaluations report, the names its gate may use: `eval_loss` (its eval files; a
    preference stage's `pref_accuracy` too), `<eval>.<score>` of its generation evals, and with eval.all_stages
    every stage's (`<stage>.eval_loss`, `<stage>.pref_accuracy`); an RL stage's reward (`rl_gate_metrics`)."""
    own = stages[index]
    names = ["eval_loss"] if own.eval else []
    if own.eval and own.pairs:  # its eval pairs: the share whose chosen reward beats the rejected one
        names.append("pref_accuracy")
    evaluated = stages if all_stages else [own]
    if all_stages:
        names += [f"{s.name}.eval_loss" for s in stages if s.eval]
        names += [f"{s.name}.pref_accuracy" for s in stages if s.eval and s.pairs]
    for stage in evaluated:
        names += [f"{g.name}.{scorer.metric}" for g in stage.generation for scorer in g.scorers]
    return list(dict.fromkeys(names + rl_gate_metrics(own)))


def rl_gate_metrics(stage: ResolvedStage) -> list[str]:
    """An RL stage's training metrics a gate may use, checked at every logged step (not at evaluations): `reward`
    and each reward's `rewards/<name>/mean`, means over the logging interval."""
    return ["reward", *(f"rewards/{r.metric}/mean" for r in stage.rewards)] if stage.prompts else []
