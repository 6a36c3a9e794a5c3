"""final/README.md: the run's model card, in the form the Hugging Face Hub reads (YAML front matter + Markdown).

The front matter is huggingface_hub's `ModelCardData` (base_model, library_name, tags, pipeline_tag, datasets), so
`ModelCard.load` and the Hub's model page read it as they read any model card; the body says how the model was
trained: the base model, the recipe, the stages in order with their data, the chat template and the results.

The builder (`build_model_card`) takes plain values; `stage_results` and `final_results` read them from a run's
metrics.jsonl records, so the card of a run that was resumed says what the uninterrupted run's would (the records
after the resumed step are redone, not doubled); it holds no timestamps.

The card is documentation, not part of what training saved: final/checksums.json does not record it, and
`verify_final` does not check it, so a user who edits the card (as one does before publishing) leaves final/
loadable.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from toolkit.data.sources import HUB_ID
from toolkit.templates import CHATML_TEMPLATE, STOCK_FILES, VL_CHATML_TEMPLATE, is_jinja_text, stock_template

MODEL_CARD = "README.md"
"""The card's file name in final/ (the Hub's)."""
TOOLKIT_NAME = "curriculum-toolkit"
"""The toolkit's tag on the Hub (its package name)."""


@dataclass(frozen=True)
class StageCard:
    """One stage as the card describes it: its data (sources and mixture weights), what it trained on and for how
    long, what trained, its lr, and its last evaluation's metrics."""

    name: str
    data: list[tuple[str, float | None]]  # (source as the recipe names it, mixture weight or None)
    rows: int  # usable training rows (packed rows with packing)
    steps: int  # optimizer steps it trained (fewer than planned when it ended early)
    samples: int  # rows drawn: steps x global batch
    lr: float  # peak learning rate (after lr_scaling)
    trainable: list[str]  # 'lora' and / or module patterns; empty: every parameter
    trainable_params: int | None = None
    tokens: int | None = None  # tokens trained on in this stage (its stage_end record)
    ended_by: str | None = None  # planned_length | patience | gate
    evals: dict[str, float] = field(default_factory=dict)  # its last evaluation: eval_loss, <eval>.<score>, ...
    objective: str = "sft"  # sft, or a preference stage's objective with its settings ("dpo: sigmoid, beta 0.1, ...")


@dataclass(frozen=True)
class FinalResults:
    """The run's totals from metrics.jsonl."""

    steps: int
    skipped_steps: int
    tokens: int | None
    final_loss: float | None  # the last logged interval's mean training loss


ENDED_BY = {"planned_length": "its length", "patience": "eval patience", "gate": "advance_when"}
"""How the card says what ended a stage (its stage_end record's `ended_by`)."""
_EVAL_TIMINGS = ("eval_seconds", "eval_gen_seconds", "eval_tokens")
"""Eval record keys that are not results (times and counts differ run to run)."""


def stage_results(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per stage name, from metrics.jsonl records: `tokens` and `ended_by` (its stage_end record) and `last_eval` (the
    metrics of its last evaluation: eval_loss, eval_ppl, `<eval>.<score>`, `<stage>.eval_loss`)."""
    out: dict[str, dict[str, Any]] = {}
    for record in records:
        stage = out.setdefault(record.get("stage", ""), {"tokens": None, "ended_by": None, "last_eval": {}})
        if record.get("event") == "stage_end":
            stage["tokens"], stage["ended_by"] = record.get("stage_tokens"), record.get("ended_by")
        elif "eval_seconds" in record:  # an evaluation (a generation-only one has no eval_loss)
            stage["last_eval"] = {k: v for k, v in record.items() if (k.startswith("eval_") or "." in k)
                              and k not in _EVAL_TIMINGS and isinstance(v, int | float)}
    return out


def final_results(records: list[dict[str, Any]]) -> FinalResults:
    """Steps, skipped steps, tokens and the last training loss, from metrics.jsonl records."""
    train = [r for r in records if "loss" in r]
    last = train[-1] if train else {}
    loss = last.get("loss")
    return FinalResults(steps=max((r["step"] for r in records), default=0),
                        skipped_steps=sum(r.get("skipped") or 0 for r in train), tokens=last.get("tokens"),
                        final_loss=loss if isinstance(loss, int | float) and math.isfinite(loss) else None)


def describe_chat_template(setting: str | None, text: str | None) -> str:
    """How the card names the chat template that trained: a stock one by name; otherwise custom, and where it came
    from (`setting` is data.chat_template; None is the base model's own, whose `text` may be a stock one)."""
    if setting is None:
        name = _stock_name(text)
        return f"{name} (the base model's own)" if name else "custom: the base model's own"
    if setting == "chatml" or setting in STOCK_FILES:
        return f"{setting} (data.chat_template)"
    if is_jinja_text(setting):
        return "custom: Jinja text in the recipe (data.chat_template)"
    return f"custom: from {setting} (data.chat_template)"


def _stock_name(text: str | None) -> str | None:
    if not text:
        return None
    if text.strip() in (CHATML_TEMPLATE, VL_CHATML_TEMPLATE):
        return "chatml"
    return next((name for name in STOCK_FILES if stock_template(name).strip() == text.strip()), None)


def is_hub_id(name: str) -> bool:
    """Whether a model name is a Hub repo id (owner/name), not a local folder or a built-in name: only those go
    into the front matter's base_model (the Hub links it, and refuses what is no repo id)."""
    return HUB_ID.match(name) is not None and not Path(name).expanduser().exists()


def portable_path(name: str, recipe_dir: Path) -> str:
    """A local path as the card records it: relative to the recipe's folder (`recipe_dir`), since a card travels
    with the model and this machine's absolute paths mean nothing elsewhere (and say who trained it where). A Hub id
    and a prefixed name (`builtin:`, `dummy:`) stay as they are; a relative path is read from the working directory,
    as the recipe's paths are."""
    if is_hub_id(name) or re.match(r"^[a-z][a-z0-9+.-]*:", name):
        return name
    path = Path(name).expanduser()
    return os.path.relpath(path if path.is_absolute() else Path.cwd() / path, recipe_dir.absolute())


def portable_tree(tree: Any, recipe_dir: Path) -> Any:
    """A recipe's dumped tree with every absolute path in it made relative to the recipe's folder (`portable_path`);
    the other values are kept (a relative string in a recipe need not be a path: a name, a template)."""
    if isinstance(tree, dict):
        return {k: portable_tree(v, recipe_dir) for k, v in tree.items()}
    if isinstance(tree, list):
        return [portable_tree(v, recipe_dir) for v in tree]
    if isinstance(tree, str) and tree.startswith(("/", "~/")) and "\n" not in tree:
        return portable_path(tree, recipe_dir)
    return tree


def build_model_card(*, title: str, base_model: str, lora: bool, vision: bool, stages: list[StageCard],
                     results: FinalResults, chat_template: str, recipe_source: str | None, recipe_yaml: str,
                     toolkit_version: str, datasets: list[str] | None = None) -> ModelCard:
    """The model card of a finished run (see the module docstring). `recipe_source` is the --config path (None:
    the embedded default recipe), `recipe_yaml` the resolved recipe; `datasets` the Hub dataset ids it trained on.
    A base model that is no Hub repo id (a local folder, a built-in) is named in the body only."""
    tags = [TOOLKIT_NAME, "curriculum-learning", *(["lora"] if lora else [])]
    data = ModelCardData(base_model=base_model if is_hub_id(base_model) else None,
                         library_name="peft" if lora else "transformers", tags=tags,
                         pipeline_tag="image-text-to-text" if vision else "text-generation",
                         datasets=sorted(set(datasets)) if datasets else None)
    body = _body(title=title, base_model=base_model, lora=lora, stages=stages, results=results,
                 chat_template=chat_template, recipe_source=recipe_source, recipe_yaml=recipe_yaml,
                 toolkit_version=toolkit_version)
    # The library writes the front matter (ModelCardData.to_yaml); the constructor parses it back, as load does.
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _body(*, title: str, base_model: str, lora: bool, stages: list[StageCard], results: FinalResults,
          chat_template: str, recipe_source: str | None, recipe_yaml: str, toolkit_version: str) -> str:
    what = "A LoRA adapter (PEFT) for" if lora else "A full fine-tune of"
    # A fence longer than any run of backticks in the recipe (a chat template's Jinja text may hold some).
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall("`+", recipe_yaml)), default=0))
    n = len(stages)
    lines = [f"# {title}", "",
             f"{what} `{base_model}`, trained with {TOOLKIT_NAME} {toolkit_version} through a {n}-stage "
             "curriculum.", "",
             "## Base model", "", f"`{base_model}`", "",
             "## Recipe", "",
             (f"Trained with the recipe `{recipe_source}`." if recipe_source else
              "Trained with the toolkit's embedded default recipe.")
             + " The resolved recipe (defaults and command-line overrides applied) is the run folder's "
               "`recipe.yaml`, and below; in this card, absolute local paths are written relative to the recipe's "
               "folder.", "",
             "<details><summary>Resolved recipe</summary>", "", f"{fence}yaml", recipe_yaml.rstrip("\n"), fence, "",
             "</details>", "",
             "## Curriculum", "",
             "| # | stage | objective | data | rows | steps | samples | tokens | trainable | peak lr | ended by |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, s in enumerate(stages, start=1):
        data = ", ".join(f"`{name}`" + ("" if weight is None else f" (weight {weight:g})") for name, weight in s.data)
        names = ", ".join(f"`{t}`" for t in s.trainable)
        if s.trainable_params is None:
            trainable = names or "all parameters"
        else:
            trainable = f"{names} ({s.trainable_params:,} parameters)" if names else \
                f"all {s.trainable_params:,} parameters"
        lines.append(f"| {i} | {s.name} | {s.objective} | {data} | {s.rows:,} | {s.steps:,} | {s.samples:,} "
                     f"| {_count(s.tokens)} | {trainable} | {s.lr:.3g} "
                     f"| {ENDED_BY.get(s.ended_by or '', s.ended_by or '-')} |")
    lines += ["", "## Chat template", "",
              f"{chat_template}. Its text is saved with the tokenizer (`chat_template.jinja`).", "",
              "## Results", "",
              f"- Steps: {results.steps:,} ({results.skipped_steps:,} skipped)",
              f"- Tokens trained: {_count(results.tokens)}",
              f"- Final training loss: {_number(results.final_loss)}"]
    names = list(dict.fromkeys(k for s in stages for k in s.evals))
    if names:
        lines += ["", "Each stage's last evaluation:", "",
                  "| stage | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        lines += [f"| {s.name} | " + " | ".join(_number(s.evals.get(k)) for k in names) + " |" for s in stages]
    lines += ["", "## Framework versions", "", f"- {TOOLKIT_NAME} {toolkit_version}", ""]
    return "\n".join(lines)
