"""The recipe's typed schema (pydantic v2) for a whole run; toolkit/config/load.py reads it from YAML and overrides.

Every field has a type, a default where one makes sense and a one-line description. Unknown keys and wrong
types fail here, before any model or data is touched, with the key's full path and the closest valid names.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from toolkit.builtin.models import TINY_MODEL
from toolkit.templates import chat_template_problem

LORA_KEYWORD = "lora"
"""`trainable` entry meaning the LoRA adapters (and lora.modules_to_save)."""


class _Section(BaseModel):
    # allow_inf_nan=False: `lr: .inf` or `nan` in any float key is an error, not an all-NaN run.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelConfig(_Section):
    name_or_path: str = Field(TINY_MODEL, description="Local directory or hub id loaded with from_pretrained.")
    trust_remote_code: bool = Field(False, description="Allow custom modelling code from the model repo.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight dtype; auto = bfloat16 on a bf16-capable GPU, else float32."
    )
    attn_implementation: Literal["auto", "flash4", "flash_attention_2", "sdpa", "eager"] = Field(
        "auto", description="auto = the fastest exact kernel present: flash4 on an sm90 / sm100 GPU with flash-attn-4, "
        "else flash_attention_2 when flash-attn is installed and on CUDA, else sdpa (run as the toolkit's sdpa_packed: "
        "packed rows through torch's varlen kernel on CUDA, per sample span elsewhere, no T x T mask). flash4 = "
        "FlashAttention-4 for packed rows (the flash4 extra; toolkit/model/attention.py). A kernel that cannot run on "
        "the machine is refused."
    )
    gradient_checkpointing: bool | Annotated[int, Field(ge=1)] = Field(
        False, description="Recompute activations in backward (non-reentrant): true for every decoder layer, or N for "
        "the first N only (spare memory buys speed: `toolkit preflight` names the fewest that fit).")
    loss_head: Literal["auto", "chunked", "liger", "standard"] = Field(
        "auto", description="Loss head (training and eval): chunked = exact cross-entropy chunk by chunk over "
        "tokens, never the full [tokens x vocab] logits; liger = Liger-Kernel's fused one (CUDA, the liger extra); "
        "auto = liger where it can run, else chunked; standard = transformers' full logits.")
    loss_chunk_size: int | None = Field(None, gt=0, description="Tokens per chunk of the chunked head (default: "
                                        "~32 Mi logits per chunk, 220 tokens of a 151,936-token vocabulary).")
    fused_layers: Literal["auto", "liger", "none"] = Field(
        "auto", description="RMSNorm, rotary embedding and SwiGLU: liger = Liger-Kernel's fused Triton kernels (CUDA, "
        "the liger extra; +25% tokens/s and less activation memory for Qwen3-8B LoRA on an H100); auto = liger "
        "where it can run and Liger supports the model type, else none; none = the model's own layers.")


class LoraConfig(_Section):
    enabled: bool = Field(True, description="Train LoRA adapters (PEFT); false = full fine-tuning.")
    r: int = Field(16, gt=0, description="LoRA rank.")
    alpha: float = Field(32, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Module names to adapt, or 'all-linear' for every linear layer but the head."
    )
    modules_to_save: list[str] = Field(
        default_factory=list, description="Modules trained in full and saved with the adapter."
    )
    exclude_modules: list[str] | str | None = Field(
        None, description="Modules LoRA must not adapt (PEFT: a list of names, or one regex), e.g. "
        "'.*visual.*' to keep a vision tower free of adapters.")
    fused: Literal["auto", "on", "off"] = Field(
        "auto", description="LoRA Linear layers: on = the toolkit's fused layers (one autograd function per layer, "
        "q/k/v and gate/up grouped into one each; the adapter added in place, x @ A^T recomputed in backward; PEFT's "
        "numbers to rounding; needs dropout 0, else PEFT's run with a warning; refused under ZeRO-3); off = PEFT's; "
        "auto = PEFT's until a GPU measures them.")

    @field_validator("fused", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        """YAML reads a bare on / off as true / false: take them as the words they were written as."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _exclude_regex_compiles(self) -> LoraConfig:
        if isinstance(self.exclude_modules, str):
            try:
                re.compile(self.exclude_modules)
            except re.error as e:
                raise ValueError(f"exclude_modules is not a valid regular expression: {e}") from None
        return self


class VideoConfig(_Section):
    """How video rows' frames are sampled and resized, named and defaulted as qwen-vl-utils (Qwen's own) names them;
    None: Qwen's default. A video part's own settings win over a data entry's, an entry's over its stage's, a
    stage's over data.video."""

    fps: float | None = Field(None, gt=0, description="Frames sampled per second of video (default 2; not with "
                              "nframes).")
    nframes: int | None = Field(None, gt=0, description="A fixed number of frames per video (rounded to a "
                                "multiple of 2), instead of fps.")
    min_frames: int | None = Field(None, gt=0, description="Fewest frames sampled with fps (default 4).")
    max_frames: int | None = Field(None, gt=0, description="Most frames sampled with fps (default 768, at most the "
                                   "video's frames); the lever of a short-to-long curriculum.")
    min_pixels: int | None = Field(None, gt=0, description="Smallest frame area (default 128 tokens' pixels: "
                                   "128 x 28 x 28 for Qwen2.5-VL).")
    max_pixels: int | None = Field(None, gt=0, description="Largest frame area (default 768 tokens' pixels, or "
                                   "total_pixels / frames x 2 when less).")
    total_pixels: int | None = Field(None, gt=0, description="Pixel budget of a whole video (default 0.9 x "
                                     "128000 tokens' pixels).")
    sample_fps: float | None = Field(None, gt=0, description="The fps a frame list (a video given as images) "
                                     "stands for (default 2).")

    @model_validator(mode="after")
    def _fps_or_nframes(self) -> VideoConfig:
        if self.fps is not None and self.nframes is not None:
            raise ValueError("give fps or nframes, not both (qwen-vl-utils' rule)")
        return self

    def items(self) -> tuple[tuple[str, float], ...]:
        """The settings given, as sorted pairs (hashable, for a data entry)."""
        return tuple(sorted((k, v) for k, v in self.model_dump().items() if v is not None))


class DataConfig(_Section):
    max_seq_len: int = Field(2048, gt=1, description="Longest tokenised sample, in tokens.")
    overlength: Literal["drop", "truncate", "error"] = Field(
        "drop", description="What to do with a sample longer than max_seq_len (counted and reported)."
    )
    train_on: Literal["assistant", "all"] = Field(
        "assistant", description="Which tokens carry loss: assistant turns only, or every token."
    )
    identical_pairs: Literal["error", "skip"] = Field(
        "error", description="A preference pair whose chosen and rejected sides render to the same tokens cannot "
        "teach (its loss is ln 2 with no gradient): error refuses it naming its row, skip drops such pairs and counts "
        "them in the stage's data line.")
    cache_dir: str | None = Field(None, description="Token stores, shared by runs and ranks (default <output_dir>/../"
                                  ".toolkit-cache/tokenized); 'none': every process tokenises into its own memory.")
    num_proc: int | None = Field(None, gt=0, description="Processes that tokenise a source (default: every core).")
    num_workers: int | None = Field(None, ge=0, description="DataLoader worker processes per rank that build "
                                    "batches (default: 1 for text, 2 for vision-language; 0 = in the training "
                                    "process).")
    group_by_length: bool = Field(False, description="Without packing: split each global batch into micro-batches "
                                  "of similar lengths (less padding; the step's samples are unchanged).")
    packing: bool = Field(False, description="Pack samples into rows of max_seq_len tokens (no padding, no "
                          "cross-sample attention); micro_batch_size then counts packed rows.")
    chat_template: str | None = Field(
        None, description="Override the model's chat template: a name (chatml, qwen2.5, qwen3, qwen2.5-vl, "
        "qwen3-vl), a path to a .jinja file or a tokenizer/model folder (from the cwd), or Jinja text; final/ saves "
        "the template text that trained."
    )
    thinking: Literal["auto", "empty", "none"] = Field(
        "auto", description="Think blocks of answers without reasoning: 'auto' trains what the chat template "
        "renders (Qwen3: an empty <think></think> block before the last answer, its non-thinking format; Qwen2.5: "
        "none); 'empty' gives the last answer an empty think block; 'none' trains answers with no think block."
    )
    renderer: Literal["auto", "jinja"] = Field(
        "auto", description="How chat rows are rendered: 'auto' writes the stock Qwen templates (qwen2.5, qwen3, "
        "qwen2.5-vl, qwen3-vl) directly in Python, byte for byte what their Jinja gives, and any other template "
        "through Jinja; 'jinja' renders every row through the Jinja template (its own token store).")
    completion_newline: bool = Field(
        False, description="Preference pairs in chat form: also train the newline the chat template writes after "
        "each completion's end token (<|im_end|>), as TRL's conversational DPO does. Default false: a completion "
        "ends at <|im_end|>, as an SFT turn does and as the model generates (docs/preference.md).")
    empty_answers: Literal["error", "skip"] = Field(
        "error", description="An assistant turn with no content (it would train a bare end-of-turn token): "
        "'error' refuses the row, naming it; 'skip' keeps the turn in the context untrained (a row left with nothing "
        "to train is skipped), and the stage's log counts the rows.")
    video: VideoConfig | None = Field(None, description="Vision models: how video rows' frames are sampled and "
                                      "resized (qwen-vl-utils' settings and defaults).")
    min_pixels: int | None = Field(None, gt=0, description="Vision models: smallest image area after resizing, "
                                   "in pixels (default: the processor's).")
    max_pixels: int | None = Field(None, gt=0, description="Vision models: largest image area after resizing, "
                                   "in pixels (bounds image tokens; default: the processor's).")
    image_cache: Literal["auto", "none"] = Field(
        "auto", description="Vision models: 'auto' caches each image's resized pixels (uint8, at the size the "
        "processor resizes to) by content in the frame store under data.cache_dir, so a second epoch, stage or "
        "relaunch decodes and resizes no image again (the batches are the same, bit for bit); 'none' decodes and "
        "resizes every image at every batch.")
    image_cache_gb: float = Field(20.0, gt=0, description="Vision models: the image cache's budget in GB (10^9 "
                                  "bytes); past it, further images are resized every time.")

    @field_validator("chat_template")
    @classmethod
    def _template_form(cls, value: str | None) -> str | None:
        if value is not None and (problem := chat_template_problem(value)) is not None:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _pixel_bounds(self) -> DataConfig:
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) is larger than max_pixels ({self.max_pixels})")
        return self


COLUMN_FIELDS = ("messages", "conversations", "prompt", "completion", "text", "instruction", "input", "output",
                 "reasoning", "system", "history", "tools", "images", "difficulty", "reference")
"""The row fields a data entry's `columns` may map to the source's own column names (`reference`: an RL stage's
prompt rows, toolkit/data/prompts.py; `reasoning`: the answer's thinking block, toolkit/data/roles.py)."""
TAG_KEYS = ("role_tag", "content_tag", "user_tag", "assistant_tag", "observation_tag", "function_tag", "system_tag")
"""Keys of a data entry's `tags` (LLaMA-Factory's names): the keys inside each message (`role_tag`, `content_tag`)
and the role names (`user_tag` ...) a source uses."""


class DataSource(_Section):
    path: str | None = Field(None, min_length=1, description="Data file, folder, glob or hub dataset id (paths from "
                             "the cwd; dummy:NAME for generated data). Give a path or a dataset, not both.")
    dataset: str | None = Field(None, min_length=1, description="A dataset named in LLaMA-Factory's registry, "
                                "dataset_dir/dataset_info.json (read as LLaMA-Factory reads it: file_name, "
                                "formatting, columns, tags).")
    dataset_dir: str | None = Field(None, min_length=1, description="The folder of the registry and of the files "
                                    "its entries name, from the cwd (default data; only with dataset).")
    weight: float | None = Field(None, gt=0, description="Mixture weight (all or none of a stage's files).")
    split: str | None = Field(None, min_length=1, description="Split of a hub dataset or a save_to_disk "
                              "DatasetDict (default train).")
    columns: dict[str, str] | None = Field(None, description="The toolkit's row fields -> this source's column "
                                           "names, e.g. {messages: dialog}.")
    tags: dict[str, str] | None = Field(None, description="The keys and role names inside this source's messages, "
                                        "as LLaMA-Factory's tags: role_tag, content_tag (the keys), user_tag, "
                                        "assistant_tag, system_tag, observation_tag (tool results), function_tag "
                                        "(tool calls), e.g. {role_tag: speaker, content_tag: text, user_tag: "
                                        "customer, assistant_tag: agent}.")
    video: VideoConfig | None = Field(None, description="This entry's video settings (over its stage's and "
                                      "data.video).")
    ignore: list[str] | None = Field(None, description="Keys of this source's rows (and of their turns) to drop "
                                     "knowingly: a key that holds content (text, media, tools) and that no shape "
                                     "reads is refused unless listed here, e.g. [category, context].")
    threads: Literal["main", "all"] | None = Field(None, description="A message tree's threads (OASST's trees "
                                                   "export): main (the default) trains the best-ranked reply at "
                                                   "each turn; all trains every thread that ends with an answer, "
                                                   "one row each.")

    @field_validator("ignore")
    @classmethod
    def _ignore_keys(cls, value: list[str] | None) -> list[str] | None:
        for key in value or []:
            if not isinstance(key, str) or not key:
                raise ValueError("ignore: each key must be a non-empty string")
        return value

    @field_validator("columns")
    @classmethod
    def _known_fields(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key in value or {}:
            if key not in COLUMN_FIELDS:
                raise ValueError(f"columns: '{key}' is not a row field; the fields are {', '.join(COLUMN_FIELDS)}")
        return value

    @field_validator("tags")
    @classmethod
    def _known_tags(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key, name in (value or {}).items():
            if key not in TAG_KEYS:
                close = difflib.get_close_matches(key, TAG_KEYS, n=1)
                raise ValueError(f"tags: '{key}' is not a tag{f' (did you mean {close[0]}?)' if close else ''}; "
                                 f"the tags are {', '.join(TAG_KEYS)}")
            if not isinstance(name, str) or not name:
                raise ValueError(f"tags: {key} must be a non-empty string")
        return value

    @model_validator(mode="after")
    def _path_or_dataset(self) -> DataSource:
        if (self.path is None) == (self.dataset is None):
            raise ValueError("a data entry needs a path or a dataset (a name in dataset_dir/dataset_info.json), "
                             "not both")
        if self.dataset_dir is not None and self.dataset is None:
            raise ValueError("dataset_dir is the folder of a registry: give it with dataset")
        if self.dataset is not None and "," in self.dataset:
            names = [n.strip() for n in self.dataset.split(",")]
            raise ValueError(f"dataset '{self.dataset}' names {len(names)} datasets; list them as separate data "
                             f"entries ({', '.join(f'{{dataset: {n}}}' for n in names)}), each with its own weight")
        return self

    def entry(self) -> DataEntry:
        return DataEntry(self.path, self.split, tuple(sorted((self.columns or {}).items())),
                         tuple(sorted((self.tags or {}).items())), self.dataset,
                         (self.dataset_dir or "data") if self.dataset is not None else None,
                         tuple(sorted(set(self.ignore or ()))), self.threads,
                         self.video.items() if self.video else ())


@dataclass(frozen=True)
class DataEntry:
    """One data entry as the data layer reads it: a path (or hub id), or a dataset of a LLaMA-Factory registry
    (`dataset` in `dataset_dir`); a split, a column mapping (the toolkit's field -> the source's column) and the
    tags that name the keys and roles inside its messages."""

    path: str | None
    split: str | None = None
    columns: tuple[tuple[str, str], ...] = ()
    tags: tuple[tuple[str, str], ...] = ()
    dataset: str | None = None
    dataset_dir: str | None = None
    ignore: tuple[str, ...] = ()
    threads: str | None = None  # a message tree's threads: main (None) or all
    video: tuple[tuple[str, float], ...] = ()  # video settings (VideoConfig.items): its own, over its stage's

    @property
    def name(self) -> str:
        """How the recipe names it: the path, or `DIR/dataset_info.json:NAME`."""
        return self.path if self.path is not None else f"{self.dataset_dir}/dataset_info.json:{self.dataset}"


class PacingConfig(_Section):
    kind: Literal["linear", "sqrt"] = Field("linear", description="Competence growth (Platanios et al. 2019).")
    start_fraction: float = Field(0.2, gt=0, le=1, description="Share of the easiest data available at first.")


SCORER_KINDS = ("exact", "contains", "regex", "json_valid")
"""Built-in scorers of generation evals; a user function is given as `module:function`."""
RESERVED_METRICS = ("eval_loss", "eval_ppl", "eval_tokens")
"""Metric names of the loss evaluation: no scorer may take them."""
_NAME = r"^[A-Za-z0-9_-]+$"


class ScorerConfig(_Section):
    kind: Literal["exact", "contains", "regex", "json_valid", "function"] = Field(
        ..., description="exact / contains: the reference equals / is contained in the output (after the "
        "normalisation below); regex: with `pattern`, the pattern's match in the output (its first group if it has "
        "one) equals the reference, without, the reference is a regular expression the output must match; "
        "json_valid: the output parses as JSON; function: `function` is called.")
    name: str | None = Field(None, pattern=_NAME, description="Metric name (<eval name>.<name>); default the kind, "
                             "or the function's name.")
    strip: bool = Field(True, description="Compare with leading and trailing whitespace removed.")
    lower: bool = Field(False, description="Compare lower-cased.")
    whitespace: bool = Field(False, description="Compare with every run of whitespace made one space.")
    pattern: str | None = Field(None, description="regex: the pattern that extracts the answer from the output.")
    function: str | None = Field(None, description="function: `module:function`, imported from the recipe's folder "
                                 "or the installed packages, called as fn(output, reference, row) -> number.")

    @model_validator(mode="after")
    def _consistent(self) -> ScorerConfig:
        if self.pattern is not None:
            if self.kind != "regex":
                raise ValueError(f"pattern is for kind: regex, not {self.kind}")
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"pattern is not a valid regular expression: {e}") from None
        if (self.kind == "function") != (self.function is not None):
            raise ValueError("a function scorer needs function: module:function (and only a function scorer has one)")
        if self.function is not None and not re.fullmatch(r"[\w.]+:\w+", self.function):
            raise ValueError(f"function '{self.function}' is not of the form module:function (e.g. "
                             "my_scorers:cad_parses)")
        return self

    @property
    def metric(self) -> str:
        """The score's name in metrics (after the eval's name and a dot)."""
        if self.name is not None:
            return self.name
        return self.function.rpartition(":")[2] if self.function else self.kind


def _scorer_shorthand(value: Any) -> Any:
    """`exact` -> {kind: exact}; `module:function` -> {kind: function, function: ...}."""
    if not isinstance(value, str):
        return value
    if ":" in value:
        return {"kind": "function", "function": value}
    if value not in SCORER_KINDS:
        close = difflib.get_close_matches(value, SCORER_KINDS, n=1)
        raise ValueError(f"unknown scorer '{value}'{f' (did you mean {close[0]}?)' if close else ''}; the built-in "
                         f"scorers are {', '.join(SCORER_KINDS)}, or give a user function as module:function")
    return {"kind": value}


class GenerationEvalConfig(_Section):
    name: str = Field(..., pattern=_NAME, description="Eval name: its metrics are <name>.<scorer>.")
    data: list[str] = Field(..., min_length=1, description="JSONL files of prompts: {messages, reference} rows, or "
                            "chat rows whose last assistant turn is the reference (images for VL models).")
    scorers: list[ScorerConfig] = Field(..., min_length=1, description="exact, contains, regex, json_valid, "
                                        "module:function, or {kind, name, ...} mappings; each reports its mean.")
    max_new_tokens: int = Field(128, gt=0, description="Longest completion, in tokens.")
    temperature: float = Field(0.0, ge=0, description="0 = greedy (the default); above 0 samples, seeded per batch.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling (with temperature > 0).")
    batch_size: int = Field(8, gt=0, description="Prompts per generate call (left-padded); the same batches on any "
                            "number of processes.")
    enable_thinking: bool | None = Field(None, description="The chat template's enable_thinking (Qwen3); default: "
                                         "false unless data.thinking is none, the format the answers trained in.")

    @field_validator("data", mode="before")
    @classmethod
    def _one_file(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("scorers", mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return [_scorer_shorthand(v) for v in value] if isinstance(value, list) else value

    @model_validator(mode="after")
    def _unique_metrics(self) -> GenerationEvalConfig:
        names = [s.metric for s in self.scorers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"scorer names must be unique within an eval, repeated: {dupes} (give one a name:)")
        reserved = sorted(set(names) & set(RESERVED_METRICS))
        if reserved:
            raise ValueError(f"scorer name {reserved[0]} is the loss evaluation's; choose another name")
        return self


class AdvanceWhen(_Section):
    metric: str = Field(..., description="<eval name>.<score> of a generation eval, or eval_loss.")
    at_least: float | None = Field(None, description="Advance once the metric is at least this.")
    at_most: float | None = Field(None, description="Advance once the metric is at most this (a loss).")
    min_steps: int = Field(0, ge=0, description="Steps the stage trains before its gate may end it.")
    required: bool = Field(False, description="Stop the run when the stage reaches its length without meeting "
                           "the gate (default: move on and say so).")

    @model_validator(mode="after")
    def _one_threshold(self) -> AdvanceWhen:
        if (self.at_least is None) == (self.at_most is None):
            raise ValueError("advance_when needs exactly one of at_least and at_most")
        return self

    def met(self, value: float) -> bool:
        return value >= self.at_least if self.at_least is not None else value <= self.at_most  # type: ignore[operator]

    def describe(self) -> str:
        return (f"{self.metric} >= {self.at_least:g}" if self.at_least is not None
                else f"{self.metric} <= {self.at_most:g}")


PREFERENCE_OBJECTIVES = ("dpo", "orpo", "simpo")
"""Stage objectives that train on preference pairs (`stages[].objective`; the default, sft, trains on rows)."""
KTO_OBJECTIVES = ("kto",)
"""Stage objectives that train on unpaired feedback: TRL's `{prompt, completion, label}` rows (docs/preference.md)."""
PAIR_ONLY_KEYS = ("loss", "loss_weights", "label_smoothing", "simpo_gamma")
"""`preference` keys of pair losses, which a kto stage does not take."""


class PreferenceConfig(_Section):
    """A preference stage's loss and reference, named as TRL's DPOConfig names them (docs/preference.md)."""

    loss: list[Literal["sigmoid", "ipo", "hinge", "robust", "sft"]] = Field(
        ["sigmoid"], min_length=1, description="DPO pair losses (TRL's loss_type; sft adds the chosen NLL), one or "
        "a list; orpo and simpo stages name at most sft.")
    loss_weights: list[float] | None = Field(None, description="One weight per loss (default 1 each).")
    beta: float = Field(0.1, gt=0, description="Temperature of the log-ratio (TRL's beta).")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="Label noise of the robust loss, in [0, 0.5).")
    simpo_gamma: float = Field(0.5, ge=0, description="SimPO's target margin (simpo stages only).")
    reference: Literal["precompute", "base"] | None = Field(
        None, description="precompute (default for dpo and kto): the policy as it enters the stage; base: the model "
        "with the LoRA adapter off. orpo and simpo take none.")
    desirable_weight: float = Field(1.0, ge=0, description="kto: the weight of the desirable rows' losses "
                                    "(TRL's KTOConfig.desirable_weight).")
    undesirable_weight: float = Field(1.0, ge=0, description="kto: the weight of the undesirable rows' losses "
                                      "(TRL's KTOConfig.undesirable_weight).")

    @field_validator("loss", mode="before")
    @classmethod
    def _one_or_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _consistent(self) -> PreferenceConfig:
        if len(set(self.loss)) != len(self.loss):
            raise ValueError(f"loss names a loss twice ({self.loss}); name each once")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss):
            raise ValueError(f"loss_weights has {len(self.loss_weights)} weights for {len(self.loss)} losses; give "
                             "one weight per loss")
        if self.label_smoothing and "robust" not in self.loss:
            raise ValueError(f"label_smoothing is {self.label_smoothing} but only the robust loss uses it; add "
                             "robust to loss or remove label_smoothing")
        return self


RL_OBJECTIVES = ("grpo",)
"""Stage objectives that train on prompts by reinforcement learning with rewards (`stages[].objective`)."""

REWARD_KINDS = ("exact", "contains", "regex", "json_valid", "math", "think_format", "overlong")
"""Built-in rewards: the generation-eval scorers, a math verifier, a think-format reward and DAPO's soft overlong
punishment; a user function is given as `module:function`."""

REFERENCE_REWARDS = ("exact", "contains", "regex", "math")
"""Rewards that compare a completion with its row's reference (`columns: {reference: ...}`)."""


class RewardConfig(_Section):
    """One reward of an RL stage: a scorer of a completion, weighted into the sum the advantages are taken of
    (built by toolkit/evals/rewards.py, which checks a scorer's options)."""

    scorer: str | dict[str, Any] = Field(..., description="exact, contains, regex, json_valid, math, think_format, "
                                         "overlong, a user function as module:function (TRL's reward-function "
                                         "contract), or {kind: ..., options} (e.g. {kind: regex, pattern: ...}).")
    weight: float = Field(1.0, description="Its weight in the summed reward (TRL's reward_weights).")

    @field_validator("scorer")
    @classmethod
    def _known(cls, value: str | dict[str, Any]) -> str | dict[str, Any]:
        kind = value.get("kind") if isinstance(value, dict) else value
        if not isinstance(kind, str):
            raise ValueError("a reward scorer given as a mapping names its kind: {kind: regex, pattern: ...}")
        if ":" in kind:
            if not re.fullmatch(r"[\w.]+:\w+", kind):
                raise ValueError(f"reward scorer '{kind}' is not of the form module:function (e.g. "
                                 "my_rewards:accuracy)")
            return value
        if kind not in (*REWARD_KINDS, "function"):
            close = difflib.get_close_matches(kind, REWARD_KINDS, n=1)
            raise ValueError(f"unknown reward scorer '{kind}'{f' (did you mean {close[0]}?)' if close else ''}; "
                             f"the built-in rewards are {', '.join(REWARD_KINDS)}, or give a user function as "
                             "module:function")
        return value

    @property
    def kind(self) -> str:
        return str(self.scorer.get("kind") if isinstance(self.scorer, dict) else self.scorer)

    @property
    def metric(self) -> str:
        """Its metric's name (rewards/<name>/mean): the mapping's `name`, the function's name, or the kind."""
        if isinstance(self.scorer, dict) and self.scorer.get("name"):
            return str(self.scorer["name"])
        function = self.scorer.get("function") if isinstance(self.scorer, dict) else None
        ref = function if isinstance(function, str) else self.kind
        return ref.rsplit(":", 1)[1] if ":" in ref else ref

    @property
    def needs_reference(self) -> bool:
        return self.kind in REFERENCE_REWARDS


class RlConfig(_Section):
    """An RL stage's settings, named and defaulted as TRL 1.16's GRPOConfig (docs/rl.md)."""

    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = Field(
        "dapo", description="How the token losses are normalised: dapo (over the global batch's completion "
        "tokens, TRL's default), grpo (per sequence), bnpo (the local batch's tokens), dr_grpo (a constant "
        "max_completion_length per sequence).")
    num_generations: int = Field(8, ge=2, description="Completions per prompt (a group); the global batch "
                                 "(micro_batch_size x grad_accum x processes completions) must divide by it.")
    max_completion_length: int = Field(512, gt=0, description="Longest completion, in tokens (TRL's default).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the rollouts (and of the "
                               "log-probs the loss takes).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling of the rollouts.")
    beta: float = Field(0.0, ge=0, description="KL coefficient to the reference (0: no reference, TRL's default); "
                        "above 0 the reference is the LoRA adapter as the stage enters it.")
    epsilon: float = Field(0.2, ge=0, description="Lower (and, without epsilon_high, upper) clipping of the ratio.")
    epsilon_high: float | None = Field(None, ge=0, description="Upper clipping (DAPO's clip-higher: 0.28); default "
                                       "epsilon.")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Advantages divided by the group's (or the batch's) reward std, or not (none, as "
        "Dr. GRPO argues).")
    mask_truncated_completions: bool = Field(False, description="Completions cut at max_completion_length leave "
                                             "the loss (DAPO).")
    num_iterations: int = Field(1, ge=1, description="Updates per rollout batch (the clipped ratio against the "
                                "rollout's log-probs above 1).")
    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose correctness (the first reward above "
                                   "0.5) is all equal and draw prompts again, up to max_resample times, keeping the "
                                   "global batch size.")
    max_resample: int = Field(3, ge=0, description="Draws beyond the first per step under dynamic_sampling.")
    prioritize: Literal["failure_rate"] | None = Field(None, description="Sample prompts in proportion to 1 - "
                                                       "their running success rate (Kimi k1.5).")

    @model_validator(mode="after")
    def _consistent(self) -> RlConfig:
        # A changed max_resample without dynamic_sampling would be ignored: refused. Its default is accepted, so a
        # recipe as the run folder keeps it (every default written out) reads back.
        if self.max_resample != type(self).model_fields["max_resample"].default and not self.dynamic_sampling:
            raise ValueError("max_resample is read only with dynamic_sampling: true; set it or remove max_resample")
        return self


ORDERED = ("easy_to_hard", "hard_to_easy")
"""The orders by difficulty; `hard_to_easy` is `easy_to_hard` over the negated difficulty (ties still by index)."""


MODEL_MEASURES = ("loss", "perplexity", "ifd")
"""Difficulty of a row scored by a model's forward pass (toolkit/evals/scoring.py, toolkit/train/stage_scores.py)."""


PAIR_MEASURES = ("margin", "chosen_loss")
"""Difficulty of a preference pair scored by a model (toolkit/train/stage_scores.py): margin, the chosen side's
summed log-prob minus the rejected side's (a large margin is easy), or chosen_loss, the chosen side's mean
per-token NLL (low is easy)."""


SCORED_MEASURES = MODEL_MEASURES + PAIR_MEASURES
"""Every difficulty a model scores by a forward pass (rows or pairs)."""


RL_MEASURES = ("pass_rate",)
"""Difficulty of a grpo stage's prompt measured by rollouts (toolkit/train/rl_stage.py `order_by_pass_rate`): the
share of `samples` completions its first reward finds wrong, drawn by the base or the current model."""


SCORERS = ("base", "current")
"""The `difficulty.model` values naming the run's own model; any other value names a separate scorer model."""


def scorer_path_problem(model: str) -> str | None:
    """What is wrong with `difficulty.model` as a separate scorer's folder or hub id, as far as the recipe alone
    tells (None: nothing yet; whether it holds a model is checked before the model loads,
    toolkit/train/scorer_model.py): a bare word that is not a folder here is a misspelt base / current, not a hub
    id (owner/name)."""
    if model.strip() != model or not model:
        return f"difficulty.model {model!r} has leading or trailing spaces"
    if model.startswith(("builtin:", ".", "/", "~")) or "/" in model or Path(model).exists():
        return None
    close = difflib.get_close_matches(model.lower(), SCORERS, n=1, cutoff=0.5)
    hint = f"Did you mean: {close[0]}? " if close else ""
    return (f"difficulty.model {model!r} is neither base, current, a model folder nor a hub id (owner/name). {hint}"
            "Use base, current, or the scorer model's folder or hub id")


class DifficultyConfig(_Section):
    by: Literal["length", "frames", "field", "loss", "perplexity", "ifd", "margin", "chosen_loss", "pass_rate"] = Field(
        ..., description="What a row's difficulty is: its token length, its videos' sampled frames (as the "
        "stage's video settings sample them: a short-to-long video curriculum), a number in the row's key `field`, "
        "or a "
        "model's score of it: loss (mean label-token cross-entropy), perplexity, ifd (loss given the prompt over "
        "the response's loss alone); of a preference pair: margin (chosen minus rejected summed log-prob, large "
        "is easy) or chosen_loss (the chosen side's mean per-token NLL, low is easy); of a grpo stage's prompt: "
        "pass_rate (the share of `samples` sampled completions its first reward finds right, high is easy).")
    field: str | None = Field(None, min_length=1, description="The row key holding the difficulty (by: field).")
    model: str | None = Field(None, min_length=1, description="The scorer of by: loss | perplexity | ifd: base "
                              "(the run's model before training), current (the policy as it enters the stage), or "
                              "a separate scorer: a local model folder or a hub id (owner/name) with the run's "
                              "tokenizer, loaded whole on every process for the scoring pass at step 0 and freed.")
    trust_remote_code: bool = Field(False, description="Allow a separate scorer's own Python code (its config's "
                                    "auto_map) to run. The scorer's own consent: model.trust_remote_code covers the "
                                    "policy only.")
    samples: int | None = Field(None, ge=1, description="by: pass_rate: completions drawn per prompt to measure it "
                                "(default: the stage's rl.num_generations).")

    @model_validator(mode="after")
    def _field_with_by_field(self) -> DifficultyConfig:
        if self.by == "field" and self.field is None:
            raise ValueError("difficulty.by is field: name the row key with difficulty.field")
        if self.by != "field" and self.field is not None:
            raise ValueError(f"difficulty.field is read only with by: field, not by: {self.by}")
        if self.by in MODEL_MEASURES and self.model is None:
            raise ValueError(f"difficulty.by is {self.by}: name the scorer with difficulty.model (base, current, or "
                             "a scorer model's folder or hub id)")
        if self.by in RL_MEASURES and self.model not in SCORERS:
            raise ValueError(f"difficulty.by is {self.by}: name the model whose rollouts measure it with "
                             "difficulty.model: base (the LoRA adapter off) or current (the policy as it enters the "
                             "stage)")
        if self.samples is not None and self.by not in RL_MEASURES:
            raise ValueError(f"difficulty.samples is read only with by: pass_rate, not by: {self.by}")
        if self.by in PAIR_MEASURES and self.model not in SCORERS:
            raise ValueError(f"difficulty.by is {self.by}: name the scorer with difficulty.model: base or current "
                             "(a pair's scores come from the run's own model)")
        if self.by not in SCORED_MEASURES + RL_MEASURES and self.model is not None:
            raise ValueError(f"difficulty.model scores rows only with by: loss, perplexity or ifd (pairs: margin or "
                             f"chosen_loss), not by: {self.by}")
        if self.model is not None and self.model not in SCORERS and scorer_path_problem(self.model) is not None:
            raise ValueError(scorer_path_problem(self.model))
        if self.trust_remote_code and (self.model is None or self.model in SCORERS):
            raise ValueError("difficulty.trust_remote_code is a separate scorer's own consent: the run's model (base, "
                             "current) runs its code under model.trust_remote_code")
        return self


class DropConfig(_Section):
    easiest: float = Field(0.0, ge=0, lt=1, description="Share of the stage's rows dropped from the easy end.")
    hardest: float = Field(0.0, ge=0, lt=1, description="Share of the stage's rows dropped from the hard end.")

    @model_validator(mode="after")
    def _something_left(self) -> DropConfig:
        if self.easiest + self.hardest >= 1:
            raise ValueError(f"drop.easiest + drop.hardest is {self.easiest + self.hardest:g}: nothing would be "
                             "left; keep their sum below 1")
        return self


def pair_losses(objective: str, pref: PreferenceConfig | None) -> tuple[tuple[str, ...], tuple[float, ...] | None]:
    """The losses a preference stage trains and their weights (None: 1 each): the one owner of the rules of each
    objective's `preference.loss`, which both the recipe's check (raising ValueError) and the stage's loss
    settings (toolkit/train/pair_stage.py `settings_of`) read.

    dpo: `preference.loss` as given (TRL's default, sigmoid), not sft alone. orpo / simpo: the pair loss is the
    objective itself, at weight 1; `preference.loss` may name sft only (the chosen NLL, TRL's ORPO / CPO term), and
    `loss_weights` (one weight) then weighs that sft term; no reference."""
    if objective not in ("orpo", "simpo"):
        if pref is None:
            return ("sigmoid",), None
        if pref.loss == ["sft"]:
            raise ValueError("preference.loss is only sft; add a pair loss (sigmoid, ipo, hinge, robust) or make the "
                             "stage's objective sft")
        return tuple(pref.loss), None if pref.loss_weights is None else tuple(pref.loss_weights)
    if pref is None:
        return (objective,), None
    named = "loss" in pref.model_fields_set
    if named and [name for name in pref.loss if name != "sft"]:
        raise ValueError(f"preference.loss names {pref.loss} but an {objective} stage's pair loss is {objective} "
                         "itself; name at most sft (the chosen NLL)")
    if pref.reference is not None:
        raise ValueError(f"preference.reference is {pref.reference} but {objective} takes no reference; remove it")
    sft = named and "sft" in pref.loss
    if pref.loss_weights is not None and not sft:
        raise ValueError(f"preference.loss_weights is set but an {objective} stage weighs only its sft term: name it "
                         "(loss: [sft], loss_weights: [w]) or remove loss_weights")
    names = (objective, "sft") if sft else (objective,)
    return names, None if pref.loss_weights is None else (1.0, *pref.loss_weights)


def describe_objective(objective: str, pref: PreferenceConfig | None, rl: RlConfig | None = None,
                       rewards: Sequence[RewardConfig] = ()) -> str:
    """A stage's objective as the model card and the run page name it: `sft`, e.g. `dpo (sigmoid; beta 0.1;
    reference: the policy at the stage's entry)` (its losses and weights by `pair_losses`, beta, label smoothing,
    gamma and reference), or e.g. `grpo (dapo; 8 generations; beta 0; rewards: math)`."""
    if objective == "sft":
        return "sft"
    if objective == "kto":
        pref = pref or PreferenceConfig()
        return (f"kto (beta {pref.beta:g}; desirable x{pref.desirable_weight:g}, undesirable "
                f"x{pref.undesirable_weight:g}; reference: "
                + ("the base model (adapter off))" if pref.reference == "base" else "the policy at the stage's entry)"))
    if objective == "grpo":
        rl = rl or RlConfig()
        named = ", ".join((r.scorer if isinstance(r.scorer, str) else str(r.scorer.get("kind")))
                          + (f" x{r.weight:g}" if r.weight != 1 else "") for r in rewards)
        return (f"grpo ({rl.loss_type}; {rl.num_generations} generations; beta {rl.beta:g}"
                + (f"; rewards: {named}" if named else "") + ")")
    names, weights = pair_losses(objective, pref)
    losses = ", ".join(f"{name} x{w:g}" if w != 1 else name
                       for name, w in zip(names, weights or (1.0,) * len(names), strict=True))
    beta = pref.beta if pref is not None else 0.1
    parts = [losses, f"beta {beta:g}"]
    if pref is not None and pref.label_smoothing:
        parts.append(f"label smoothing {pref.label_smoothing:g}")
    if objective == "simpo":
        parts.append(f"gamma {pref.simpo_gamma if pref is not None else 0.5:g}")
    if objective == "dpo":
        parts.append("reference: the base model (adapter off)" if pref is not None and pref.reference == "base"
                     else "reference: the policy at the stage's entry")
    return f"{objective} ({'; '.join(parts)})"


class StageConfig(_Section):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True, allow_inf_nan=False)

    name: str = Field(..., min_length=1, description="Stage name, used in logs and metrics.jsonl.")
    data: list[str | DataSource] = Field(..., min_length=1, validation_alias=AliasChoices("data", "datasets"),
                                         description="Data files, folders, globs or hub ids (or {path, weight, split, "
                                         "columns}; weights make a seeded mixture).")
    video: VideoConfig | None = Field(None, description="This stage's video settings (over data.video; an entry's "
                                      "win), e.g. {max_frames: 8} in a first stage and 32 in the next.")
    mixture_replacement: bool = Field(False, description="Mixture draws with replacement (else each file is "
                                      "used without repeats until exhausted).")
    order: Literal["shuffle", "sequential", "easy_to_hard", "hard_to_easy"] = Field(
        "shuffle", description="Sample order; easy_to_hard / hard_to_easy sort by the rows' difficulty (see "
        "difficulty; by default the rows' `difficulty` key when every row has one, else token length).")
    difficulty: DifficultyConfig | None = Field(None, description="What orders the rows (order easy_to_hard / "
                                                "hard_to_easy) and what drop ranks by: {by: length | frames | field | "
                                                "loss | perplexity | ifd, field: NAME, model: base | current | "
                                                "a scorer's folder or hub id}.")
    drop: DropConfig | None = Field(None, description="Drop the easiest / hardest shares of the stage's rows by "
                                    "difficulty before training: {easiest: f, hardest: f}; by a model's score, the "
                                    "shares of the stage's rows (packed rows with packing, ranked by their hardest "
                                    "sample) once the scores exist.")
    pacing: PacingConfig | None = Field(None, description="Competence pacing for easy_to_hard / hard_to_easy.")
    schedule: Literal["cosine", "linear", "constant", "wsd", "continue"] | None = Field(
        None, description="LR schedule of this stage (default schedule.kind); continue = carry the previous one.")
    max_seq_len: int | None = Field(None, gt=1, description="Override data.max_seq_len (short-to-long).")
    micro_batch_size: int | None = Field(None, gt=0, description="Override train.micro_batch_size.")
    epochs: float | None = Field(None, gt=0, description="Passes over the stage data (default 1).")
    max_steps: int | None = Field(None, gt=0, description="Optimizer steps in this stage (instead of epochs).")
    lr: float | None = Field(None, gt=0, description="Peak learning rate of this stage (default optimizer.lr).")
    warmup_ratio: float | None = Field(None, ge=0, lt=1, description="Override schedule.warmup_ratio.")
    min_lr_ratio: float | None = Field(None, ge=0, le=1, description="Override schedule.min_lr_ratio.")
    eval: list[str] | None = Field(None, description="Eval JSONL files of this stage (default: eval.data).")
    trainable: list[str] | None = Field(
        None, min_length=1, description="What trains in this stage: 'lora' and/or module / parameter name "
        "patterns (dotted names or globs); default train.trainable.")
    patience: int | None = Field(None, gt=0, description="End the stage early once eval_loss has not improved "
                                 "for this many evaluations (needs eval data and eval.every_steps).")
    patience_min_delta: float = Field(0.0, ge=0, description="Smallest eval_loss decrease that counts as an "
                                      "improvement for patience.")
    generation: list[GenerationEvalConfig] | None = Field(None, description="Generation evals of this stage "
                                                          "(default: eval.generation).")
    advance_when: AdvanceWhen | None = Field(None, description="Mastery gate: end the stage once an eval metric "
                                             "reaches a threshold (max_steps / epochs stay the ceiling).")
    objective: Literal["sft", "dpo", "orpo", "simpo", "kto", "grpo"] = Field(
        "sft", description="What the stage trains: sft on rows, dpo / orpo / simpo on preference pairs, kto on "
        "unpaired rows marked desirable or not (TRL's prompt, completion, label), or grpo "
        "(GRPO / DAPO / Dr. GRPO by rl.loss_type) on prompts with rewards.")
    rl: RlConfig | None = Field(None, description="A grpo stage's settings, TRL's GRPOConfig names and defaults.")
    rewards: list[RewardConfig] | None = Field(None, description="A grpo stage's rewards: [{scorer, weight}], "
                                               "summed with their weights.")
    preference: PreferenceConfig | None = Field(None, description="A dpo / orpo / simpo / kto stage's loss and "
                                                "reference (default: sigmoid, beta 0.1, reference precompute).")

    @model_validator(mode="after")
    def _consistent(self) -> StageConfig:
        if self.epochs is not None and self.max_steps is not None:
            raise ValueError("set either epochs or max_steps, not both")
        weighted = [isinstance(d, DataSource) and d.weight is not None for d in self.data]
        if any(weighted) and not all(weighted):
            raise ValueError("give a weight to every data file of the stage, or to none")
        if self.pacing is not None and self.order != "easy_to_hard":
            raise ValueError("pacing needs order: easy_to_hard")
        if self.objective != "grpo" and (self.rl is not None or self.rewards is not None):
            raise ValueError(f"{'rl' if self.rl is not None else 'rewards'} is set but the stage's objective is "
                             f"{self.objective}; set objective: grpo or remove it")
        if self.objective == "grpo":
            if not self.rewards:
                raise ValueError("a grpo stage needs rewards: [{scorer: ..., weight: ...}] (e.g. math, "
                                 "think_format, or module:function)")
            if self.preference is not None:
                raise ValueError("preference is set but the stage's objective is grpo; its settings are rl:")
            names = [r.metric for r in self.rewards]
            if dupes := sorted({n for n in names if names.count(n) > 1}):
                raise ValueError(f"reward names must be unique, repeated: {dupes} (give one a name:)")
            by = self.difficulty.by if self.difficulty is not None else None
            if by in SCORED_MEASURES:
                raise ValueError(f"difficulty.by {by} scores rows with responses, and a grpo stage's rows are prompts; "
                                 "order them by the model's rollouts: difficulty: {by: pass_rate, model: current}")
            if by == "frames":
                raise ValueError("difficulty.by frames orders video rows, and a grpo stage's prompts hold no video "
                                 "(vision prompts are refused there); use by: pass_rate, length or field")
            if self.drop is not None and by not in RL_MEASURES:
                raise ValueError("drop on a grpo stage ranks its prompts by their pass rate only; set difficulty: "
                                 "{by: pass_rate, model: current} or remove drop")
        elif self.difficulty is not None and self.difficulty.by in RL_MEASURES:
            raise ValueError(f"difficulty.by pass_rate measures prompts by rollouts, and this stage's objective is "
                             f"{self.objective}; use it on an objective: grpo stage, or order rows by loss, "
                             "perplexity, ifd (pairs: margin, chosen_loss), length or a field")
        if self.objective == "sft" and self.preference is not None:
            raise ValueError("preference is set but the stage's objective is sft; set objective: dpo (or orpo, "
                             "simpo, kto) or remove preference")
        pref = self.preference
        if pref is not None and self.objective == "kto":
            given = [k for k in PAIR_ONLY_KEYS if k in pref.model_fields_set]
            if given:
                raise ValueError(f"preference.{given[0]} is set but a kto stage's loss is KTO's (TRL's KTOTrainer, "
                                 "loss_type kto): it takes beta, desirable_weight, undesirable_weight and reference; "
                                 f"remove {given[0]}")
        elif pref is not None:
            given = [k for k in ("desirable_weight", "undesirable_weight") if k in pref.model_fields_set]
            if given:
                raise ValueError(f"preference.{given[0]} is set but the stage's objective is {self.objective}; only "
                                 "kto stages weigh desirable and undesirable rows")
        if self.objective not in ("sft", "kto"):
            pair_losses(self.objective, pref)  # raises on a loss list the objective does not take
        if pref is not None and "simpo_gamma" in pref.model_fields_set and self.objective != "simpo":
            raise ValueError(f"preference.simpo_gamma is set but the stage's objective is {self.objective}; only "
                             "simpo stages use it")
        if self.pacing is not None and self.order not in ORDERED:
            raise ValueError("pacing needs order: easy_to_hard or hard_to_easy")
        for d in self.data:
            mapped = isinstance(d, DataSource) and (d.columns or {}).get("difficulty")
            if self.difficulty is not None and self.difficulty.by == "field" and mapped \
                    and mapped != self.difficulty.field:
                raise ValueError(f"difficulty.field is {self.difficulty.field} but data entry {d.entry().name} maps "
                                 f"difficulty to column {mapped}: keep one of them")
        if self.difficulty is not None and self.order not in ORDERED and self.drop is None:
            raise ValueError(f"difficulty orders rows only with order easy_to_hard or hard_to_easy (or ranks them "
                             f"for drop); with order {self.order} it would change nothing: remove it or set order")
        return self

    @property
    def paths(self) -> list[str]:
        return [d if isinstance(d, str) else d.entry().name for d in self.data]

    @property
    def entries(self) -> list[DataEntry]:
        """The stage's entries, each with its video settings over the stage's (`video`)."""
        entries = [DataEntry(d) if isinstance(d, str) else d.entry() for d in self.data]
        if self.video is None:
            return entries
        return [dataclasses.replace(e, video=tuple(sorted({**dict(self.video.items()), **dict(e.video)}.items())))
                for e in entries]

    @property
    def weights(self) -> list[float] | None:
        ws = [d.weight for d in self.data if isinstance(d, DataSource) and d.weight is not None]
        return ws if len(ws) == len(self.data) else None


class OptimizerConfig(_Section):
    lr: float = Field(2e-4, gt=0, description="Peak learning rate (before lr_scaling).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float = Field(1.0, ge=0, description="Clip the global gradient norm to this (0 = off).")
    lr_scaling: Literal["none", "linear", "sqrt"] = Field(
        "none", description="Scale each stage's lr by its global batch / reference batch (linear: Goyal et al. "
        "2017)."
    )
    reference_batch_size: int | None = Field(
        None, gt=0, description="Effective batch size the lr was tuned for (needed by lr_scaling)."
    )

    @model_validator(mode="after")
    def _scaling_needs_reference(self) -> OptimizerConfig:
        if self.lr_scaling != "none" and self.reference_batch_size is None:
            raise ValueError("lr_scaling needs optimizer.reference_batch_size")
        return self


class ScheduleConfig(_Section):
    kind: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine", description="LR decay after warmup (transformers' schedules), per stage; wsd = warmup-stable-decay.")
    decay_ratio: float = Field(0.1, gt=0, le=1, description="wsd: fraction of a stage's steps spent decaying.")
    warmup_ratio: float = Field(0.03, ge=0, lt=1, description="Fraction of each stage's steps spent warming up.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine floor as a fraction of the peak lr.")


class TrainConfig(_Section):
    micro_batch_size: int = Field(1, gt=0, description="Samples per process per forward pass.")
    grad_accum: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    seed: int = Field(42, ge=0, lt=2**32, description="One seed for the run; each rank derives its own from it.")
    trainable: list[str] | None = Field(
        None, min_length=1, description="Default of stages[].trainable: 'lora' and/or name patterns (default: "
        "['lora'] with LoRA, every parameter without).")
    compile: bool = Field(False, description="torch.compile each decoder layer (regional, dynamic token count; "
                          "packed rows get fixed varlen boundaries so a run compiles once). Opt-in until measured "
                          "on a GPU (docs/benchmarks.md).")


class CheckpointConfig(_Section):
    save_steps: int | None = Field(None, gt=0, description="Save every N optimizer steps.")
    save_minutes: float | None = Field(None, gt=0, description="Save when this many minutes passed since the last.")
    save_on_stage_end: bool = Field(True, description="Save at the end of every stage.")
    keep_last: int = Field(2, ge=1, description="Committed checkpoints kept (the best one is kept on top).")
    best_metric: str | None = Field("eval_loss", description="Metric that picks the best checkpoint (never deleted).")
    best_mode: Literal["min", "max"] = Field("min", description="Whether a lower or higher best_metric is better.")
    resume: str = Field("auto", description="auto (newest committed in output_dir), none, or a checkpoint path.")
    resume_force: bool = Field(False, description="Resume even if training-relevant recipe settings changed.")
    portable: bool = Field(True, description="LoRA: also save adapter + Adam state in a strategy-free form.")


class LoggingConfig(_Section):
    logging_steps: int = Field(1, gt=0, description="Write metrics every N optimizer steps.")
    progress_bar: bool = Field(True, description="Show a progress bar on rank 0.")
    trackers: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = Field(
        default_factory=lambda: ["tensorboard"], description="Experiment trackers (through accelerate); wandb, "
        "mlflow and trackio need the toolkit's extra of that name.")
    peak_tflops: float | None = Field(None, gt=0, description="Accelerator peak TFLOP/s for MFU (default: "
                                      "looked up from the device name).")


class EvalConfig(_Section):
    data: list[str] = Field(default_factory=list, description="Global eval JSONL files (a stage's eval: wins).")
    every_steps: int | None = Field(None, gt=0, description="Evaluate every N optimizer steps (and at stage ends).")
    micro_batch_size: int | None = Field(None, gt=0, description="Eval batch per process (default: the stage's "
                                            "training micro batch).")
    generation: list[GenerationEvalConfig] = Field(default_factory=list, description="Generation evals of every "
                                                   "stage (a stage's generation: wins).")
    all_stages: bool = Field(False, description="Every eval evaluates every stage's eval sets (loss and generation): "
                             "the forgetting matrix, evals/matrix.jsonl.")


class StabilityConfig(_Section):
    loss_spike_factor: float | None = Field(None, gt=1, description="Skip a step whose loss exceeds this times "
                                            "the mean of recent good steps (off when unset).")
    loss_spike_window: int = Field(50, ge=2, description="Recent good steps the spike rule averages.")
    max_consecutive_skips: int = Field(5, ge=1, description="Stop the run once this many steps in a row were "
                                       "skipped (1 = at the first skipped step).")


class DistributedConfig(_Section):
    timeout_minutes: float = Field(30, gt=0, description="Collective timeout, so a dead rank fails the job.")


def path_component(name: str) -> str:
    """A stage, run or eval name as one path component: every character but letters, digits, `_`, `.` and `-`
    becomes `_`, as does a leading dot, so `../../mine` is `_._.._mine`, never a step out of its folder, and
    never a hidden file. The one function through which any name of the recipe becomes part of a path (evals/,
    scores/, trackers/; toolkit/runtime/run_dir.py); here, below the run folder, so that a recipe whose stage names
    clean to one component is refused at load (`Recipe`)."""
    return re.sub(r"[^\w.-]|^\.", "_", name) or "_"


class Recipe(_Section):
    output_dir: str = Field("outputs/run", description="Where metrics, checkpoints and the final model go (not "
                            "empty: that would write into the current directory).")
    run_name: str | None = Field(None, description="Name for logs and trackers (default: start time, from rank 0): a "
                                 "plain name, as TensorBoard writes a folder of it inside output_dir.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Base model.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters or full fine-tuning.")
    data: DataConfig = Field(default_factory=DataConfig, description="Formatting and length policy.")
    stages: list[StageConfig] = Field(..., min_length=1, description="Ordered training stages.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="AdamW settings.")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, description="LR schedule per stage.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Batching and seed.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    stability: StabilityConfig = Field(default_factory=StabilityConfig, description="Skipping bad steps.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Saving and resuming.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Metrics and progress.")
    distributed: DistributedConfig = Field(default_factory=DistributedConfig, description="Collectives.")

    @field_validator("output_dir")
    @classmethod
    def _output_dir_named(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("output_dir is empty, which would write the run into the current directory; name a "
                             "folder, e.g. outputs/my-run")
        if Path(value).expanduser().resolve() == Path(Path.cwd().anchor):
            raise ValueError(f"output_dir {value!r} is the filesystem root, which would write the run into it; name "
                             "a folder, e.g. outputs/my-run")
        return value

    @field_validator("run_name")
    @classmethod
    def _run_name_plain(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or value in (".", "..") or "/" in value or "\\" in value):
            raise ValueError(f"run_name {value!r} must be a plain name (no '/', not '.' or '..'): TensorBoard "
                             "writes a folder of that name inside output_dir, which a path would leave")
        return value

    @model_validator(mode="after")
    def _unique_stage_names(self) -> Recipe:
        names = [s.name for s in self.stages]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"stage names must be unique, repeated: {dupes}")
        components: dict[str, str] = {}
        for name in names:  # each becomes a folder and a file name (evals/<stage>/, scores/<stage>.parquet)
            other = components.setdefault(path_component(name), name)
            if other != name:
                raise ValueError(f"stages '{other}' and '{name}' would share the folder and scores file "
                                 f"'{path_component(name)}' (a name becomes a path component with every character "
                                 "but letters, digits, '_', '.' and '-' made '_'); rename one")
        if self.stages[0].schedule == "continue":
            raise ValueError("the first stage has no schedule to continue")
        # deferred: stages.py resolves stages of this schema; the recipe checks what they resolve to
        from toolkit.config.stages import resolve_stages

        for i, stage in enumerate(resolve_stages(self)):
            where = f"stages.{i} ('{stage.name}')"
            if LORA_KEYWORD in (stage.trainable or []) and not self.lora.enabled:
                raise ValueError(f"{where}: trainable names 'lora' but lora.enabled is false")
            if stage.patience is None:
                continue
            if not stage.eval or not self.eval.every_steps:
                raise ValueError(f"{where}: patience needs eval data (stages[].eval or eval.data) and "
                                 "eval.every_steps")
            if i + 1 < len(self.stages) and self.stages[i + 1].schedule == "continue":
                raise ValueError(f"{where}: patience may end the stage early, which would cut the LR schedule "
                                 f"that stage '{self.stages[i + 1].name}' continues; give that stage its own "
                                 "schedule")
        return self

    @model_validator(mode="after")
    def _preference_stages(self) -> Recipe:
        """A `reference: base` needs a LoRA adapter to switch off; a preference stage's rows are pairs, which a
        model ranks by its margin or chosen_loss (by loss, perplexity or ifd score rows; length and a row field rank
        pairs too: each pair takes its source row's value), which no other stage has;
        data.completion_newline shapes pairs only, so a recipe without a preference stage refuses it."""
        if self.data.completion_newline and all(stage.objective == "sft" for stage in self.stages):
            raise ValueError("data.completion_newline is true but no stage trains on preference pairs (it shapes "
                             "their completions only); remove it or give a stage objective: dpo, orpo, simpo or kto")
        for i, stage in enumerate(self.stages):
            where = f"stages.{i} ('{stage.name}')"
            how = stage.difficulty
            if how is not None and how.by in RL_MEASURES and how.model == "base" and not self.lora.enabled:
                raise ValueError(f"{where}: difficulty.model is base for by: pass_rate, which rolls out the model with "
                                 "its LoRA adapter off, but lora.enabled is false; use model: current")
            if stage.objective == "grpo" and stage.rl is not None and stage.rl.beta > 0 and not self.lora.enabled:
                raise ValueError(f"{where}: rl.beta is {stage.rl.beta:g} but lora.enabled is false: the KL reference "
                                 "is a frozen copy of the LoRA adapter at the stage's entry, and a second copy of a "
                                 "fully fine-tuned model is not built; set rl.beta: 0 (TRL's default) or enable lora")
            if stage.objective in KTO_OBJECTIVES:
                if (stage.micro_batch_size or self.train.micro_batch_size) < 2:
                    raise ValueError(f"{where}: a kto stage's micro_batch_size is 1, so each row's KL side would be "
                                     "the row itself (the KL baseline its own reward; TRL refuses it too): give the "
                                     "stage micro_batch_size: 2 or more")
                if stage.preference is not None and stage.preference.reference == "base" and not self.lora.enabled:
                    raise ValueError(f"{where}: preference.reference is base (the model with its LoRA adapter off) "
                                     "but lora.enabled is false; use reference: precompute")
                if stage.difficulty is not None and stage.difficulty.by in SCORED_MEASURES:
                    raise ValueError(f"{where}: difficulty.by {stage.difficulty.by} on a kto stage is not supported "
                                     "(a model's scores of its rows are not built for kto); order its rows by length "
                                     "or a row field")
                continue
            if stage.objective not in PREFERENCE_OBJECTIVES:
                if stage.difficulty is not None and stage.difficulty.by in PAIR_MEASURES:
                    raise ValueError(f"{where}: difficulty.by {stage.difficulty.by} scores preference pairs, and "
                                     f"this objective {stage.objective} stage has none: order its rows by loss, "
                                     "perplexity or ifd (difficulty: {by: loss, model: current}), length or a field")
                continue
            if stage.preference is not None and stage.preference.reference == "base" and not self.lora.enabled:
                raise ValueError(f"{where}: preference.reference is base (the model with its LoRA adapter off) but "
                                 "lora.enabled is false; use reference: precompute")
            how = stage.difficulty
            if how is not None and how.by in MODEL_MEASURES:
                raise ValueError(f"{where}: difficulty.by {how.by} on an objective {stage.objective} stage is not "
                                 "supported (its rows are pairs, and by loss, perplexity or ifd scores a row): order "
                                 "pairs by the model's margin or chosen_loss (difficulty: {by: margin, model: "
                                 "current}), by length or by a row field")
        return self

    @model_validator(mode="after")
    def _generation_evals_and_gates(self) -> Recipe:
        """Generation eval names are unique; a gate names a metric its stage evaluates, every eval.every_steps."""
        defined = [(g.name, "eval.generation") for g in self.eval.generation] + [
            (g.name, f"stages.{i}.generation") for i, s in enumerate(self.stages) for g in s.generation or []]
        names = [n for n, _ in defined]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"generation eval names must be unique, repeated: {dupes} "
                             f"({', '.join(k for n, k in defined if n == dupes[0])})")
        # deferred: stages.py resolves stages of this schema; the recipe checks what they resolve to
        from toolkit.config.stages import resolve_stages, rl_gate_metrics, stage_metrics

        resolved = resolve_stages(self)
        for i, stage in enumerate(resolved):
            gate = stage.advance_when
            if gate is None:
                continue
            where = f"stages.{i} ('{stage.name}')"
            metrics = stage_metrics(resolved, i, all_stages=self.eval.all_stages)
            if not metrics:
                raise ValueError(f"{where}: advance_when needs an eval of this stage to decide on: eval files "
                                 "(stages[].eval or eval.data) or generation evals (stages[].generation or "
                                 "eval.generation)")
            if gate.metric not in metrics:
                close = difflib.get_close_matches(gate.metric, metrics, n=1, cutoff=0.5)
                raise ValueError(f"{where}: advance_when.metric '{gate.metric}' is not a metric this stage "
                                 f"evaluates{f' (did you mean {close[0]}?)' if close else ''}; its metrics: "
                                 f"{', '.join(metrics)}")
            if not self.eval.every_steps and gate.metric not in rl_gate_metrics(stage):
                raise ValueError(f"{where}: advance_when needs eval.every_steps (a gate is checked at each eval)")
            if i + 1 < len(self.stages) and self.stages[i + 1].schedule == "continue":
                raise ValueError(f"{where}: advance_when may end the stage early, which would cut the LR schedule "
                                 f"that stage '{self.stages[i + 1].name}' continues; give that stage its own "
                                 "schedule")
        return self


