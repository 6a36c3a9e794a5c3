"""final/README.md, the run's model card (toolkit/checkpoint/model_card.py): built from plain values, it loads with
huggingface_hub's ModelCard as the Hub reads it, and says the base model, the recipe, every stage with its data,
the chat template and the results. End-to-end checks on a real run's final/ are in tests/e2e/test_nothing_lost.py
(`test_final_holds_a_model_card_that_loads`) and tests/test_templates.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from toolkit.checkpoint.model_card import (
    MODEL_CARD,
    FinalResults,
    StageCard,
    build_model_card,
    describe_chat_template,
    final_results,
    is_hub_id,
    stage_results,
)
from toolkit.templates import CHATML_TEMPLATE, stock_template

STAGES = [
    StageCard(name="warmup_short", data=[("data/easy.jsonl", 0.7), ("org/hub-chat", 0.3)], rows=1200, steps=40,
              samples=640, lr=1e-4, trainable=["lora"], trainable_params=1_081_344, tokens=81_920,
              ended_by="planned_length", evals={"eval_loss": 1.5, "eval_ppl": math.exp(1.5)}),
    StageCard(name="long_reasoning", data=[("data/hard.parquet", None)], rows=300, steps=12, samples=192, lr=5e-5,
              trainable=["lora", "model.embed_tokens"], trainable_params=2_000_000, tokens=40_000,
              ended_by="gate", evals={"eval_loss": 1.25, "math.exact": 0.625}),
]
RESULTS = FinalResults(steps=52, skipped_steps=1, tokens=121_920, final_loss=1.1875)
RECIPE_YAML = "output_dir: outputs/my-run\nmodel:\n  name_or_path: Qwen/Qwen3-0.6B\n"


def _card(**overrides: object) -> ModelCard:
    args: dict[str, object] = dict(
        title="my-run", base_model="Qwen/Qwen3-0.6B", lora=True, vision=False, stages=STAGES, results=RESULTS,
        chat_template="qwen3 (the base model's own)", recipe_source="recipes/my.yaml", recipe_yaml=RECIPE_YAML,
        toolkit_version="9.8.7", datasets=["org/hub-chat"])
    return build_model_card(**(args | overrides))  # type: ignore[arg-type]


def _saved(card: ModelCard, tmp_path: Path) -> ModelCard:
    """The card written as final/ holds it, and read back the way the Hub's tools read a model card."""
    path = tmp_path / MODEL_CARD
    path.write_text(str(card), encoding="utf-8")
    return ModelCard.load(path)


def test_a_lora_card_loads_with_the_hubs_front_matter_and_names_every_stage(tmp_path: Path) -> None:
    card = _saved(_card(), tmp_path)
    assert card.data.base_model == "Qwen/Qwen3-0.6B"
    assert card.data.library_name == "peft"
    assert card.data.tags == ["curriculum-toolkit", "curriculum-learning", "lora"]
    assert card.data.pipeline_tag == "text-generation"
    assert card.data.datasets == ["org/hub-chat"]
    body = card.text
    assert body.lstrip().startswith("# my-run\n") and "A LoRA adapter (PEFT) for `Qwen/Qwen3-0.6B`" in body
    # the stages in order, each with its data (and mixture weights), rows, steps, tokens, what trained, lr
    assert body.index("| 1 | warmup_short |") < body.index("| 2 | long_reasoning |")
    assert ("| 1 | warmup_short | sft | `data/easy.jsonl` (weight 0.7), `org/hub-chat` (weight 0.3) | 1,200 | 40 | 640 "
            "| 81,920 | `lora` (1,081,344 parameters) | 0.0001 | its length |") in body
    assert ("| 2 | long_reasoning | sft | `data/hard.parquet` | 300 | 12 | 192 | 40,000 | `lora`, `model.embed_tokens` "
            "(2,000,000 parameters) | 5e-05 | advance_when |") in body
    # the recipe: its path, and the resolved recipe in a details block
    assert "Trained with the recipe `recipes/my.yaml`." in body
    assert f"<details><summary>Resolved recipe</summary>\n\n```yaml\n{RECIPE_YAML}```" in body
    assert "## Chat template\n\nqwen3 (the base model's own)." in body
    # the results: totals, and each stage's last evaluation (loss and generation scores)
    assert "- Steps: 52 (1 skipped)\n- Tokens trained: 121,920\n- Final training loss: 1.188" in body
    assert "| stage | eval_loss | eval_ppl | math.exact |" in body
    assert "| warmup_short | 1.5 | 4.482 | - |" in body and "| long_reasoning | 1.25 | - | 0.625 |" in body
    assert "- curriculum-toolkit 9.8.7" in body


def test_a_full_vision_language_fine_tune_from_a_local_folder(tmp_path: Path) -> None:
    """Full fine-tuning is a transformers model; a VL one an image-text-to-text one; a base model that is a local
    folder or a built-in is no Hub id, so it is named in the body only (the Hub would refuse it as base_model)."""
    local = tmp_path / "my/base"
    local.mkdir(parents=True)
    for base in (str(local), "builtin:tiny-qwen2.5-vl"):
        card = _saved(_card(base_model=base, lora=False, vision=True, datasets=None, recipe_source=None,
                            stages=[StageCard(name="s", data=[("dummy:stage1", None)], rows=8, steps=2, samples=8,
                                              lr=1e-3, trainable=[]),
                                    StageCard(name="t", data=[("dummy:stage2", None)], rows=8, steps=1, samples=4,
                                              lr=1e-3, trainable=[], trainable_params=5000)],
                            results=FinalResults(steps=2, skipped_steps=0, tokens=None, final_loss=None)), tmp_path)
        assert card.data.base_model is None and card.data.datasets is None
        assert card.data.library_name == "transformers" and card.data.pipeline_tag == "image-text-to-text"
        assert card.data.tags == ["curriculum-toolkit", "curriculum-learning"]
        assert f"A full fine-tune of `{base}`" in card.text and f"## Base model\n\n`{base}`" in card.text
        assert "Trained with the toolkit's embedded default recipe." in card.text
        assert "| 1 | s | sft | `dummy:stage1` | 8 | 2 | 8 | - | all parameters | 0.001 | - |" in card.text
        assert "| 2 | t | sft | `dummy:stage2` | 8 | 1 | 4 | - | all 5,000 parameters | 0.001 | - |" in card.text
        assert "- Final training loss: -" in card.text and "Evaluations" not in card.text


def test_a_recipe_holding_backticks_keeps_its_code_block(tmp_path: Path) -> None:
    recipe = 'data:\n  chat_template: "{{ \'```\' }}{% for m in messages %}{{ m.content }}{% endfor %}"\n'
    card = _saved(_card(recipe_yaml=recipe), tmp_path)
    assert f"````yaml\n{recipe}````\n" in card.text


def test_hub_ids() -> None:
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("org/name.v2")
    assert not any(is_hub_id(n) for n in ("builtin:tiny-qwen3", "/abs/model", "./rel", "~/m", "a/b/c", "plain"))


def test_results_are_read_from_metrics_records() -> None:
    """The card's numbers come from metrics.jsonl: the last training record (loss, tokens), every record's skipped
    steps, each stage's stage_end record and its last evaluation (a generation-only one has no eval_loss); times
    and counts of the evaluations are left out (they differ run to run)."""
    records = [
        {"step": 1, "stage": "a", "loss": 2.0, "tokens": 100, "skipped": 0, "tokens_per_sec": 9.0},
        {"step": 2, "stage": "a", "loss": None, "tokens": 200, "skipped": 1},
        {"step": 2, "stage": "a", "eval_loss": 1.9, "eval_ppl": 6.7, "eval_tokens": 50, "eval_seconds": 0.1},
        {"step": 2, "stage": "a", "event": "stage_end", "stage_steps": 2, "stage_tokens": 200, "ended_by": "gate"},
        {"step": 3, "stage": "b", "loss": 1.5, "tokens": 300, "skipped": 0},
        {"step": 3, "stage": "b", "math.exact": 0.5, "eval_gen_seconds": 0.2, "eval_seconds": 0.3},
        {"step": 4, "stage": "b", "loss": 1.25, "tokens": 400, "skipped": 0},
        {"step": 4, "stage": "b", "math.exact": 0.75, "a.eval_loss": 2.5, "eval_gen_seconds": 0.2,
         "eval_seconds": 0.3},
        {"step": 4, "stage": "b", "event": "stage_end", "stage_steps": 2, "stage_tokens": 200,
         "ended_by": "planned_length"},
    ]
    assert final_results(records) == FinalResults(steps=4, skipped_steps=1, tokens=400, final_loss=1.25)
    assert stage_results(records) == {
        "a": {"tokens": 200, "ended_by": "gate", "last_eval": {"eval_loss": 1.9, "eval_ppl": 6.7}},
        "b": {"tokens": 200, "ended_by": "planned_length", "last_eval": {"math.exact": 0.75, "a.eval_loss": 2.5}}}
    assert final_results([]) == FinalResults(steps=0, skipped_steps=0, tokens=None, final_loss=None)


@pytest.mark.parametrize(("setting", "text", "said"), [
    (None, stock_template("qwen3"), "qwen3 (the base model's own)"),
    (None, CHATML_TEMPLATE, "chatml (the base model's own)"),
    (None, "{{ messages }}", "custom: the base model's own"),
    ("qwen2.5", stock_template("qwen2.5"), "qwen2.5 (data.chat_template)"),
    ("chatml", CHATML_TEMPLATE, "chatml (data.chat_template)"),
    ("templates/mine.jinja", "{{ x }}", "custom: from templates/mine.jinja (data.chat_template)"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None,
     "custom: Jinja text in the recipe (data.chat_template)"),
])
def test_the_chat_template_is_named_when_stock_else_custom_and_where_from(setting: str | None, text: str | None,
                                                                          said: str) -> None:
    assert describe_chat_template(setting, text) == said


def test_an_unreadable_metrics_file_costs_the_card_not_the_weights(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The card is read from metrics.jsonl at the very end of a run: a file damaged in its middle leaves final/
    without its card (one warning), never the run without its weights."""
    from types import SimpleNamespace

    from toolkit.config.load import load_recipe
    from toolkit.runtime.run_dir import RunLayout
    from toolkit.train.setup import model_card

    layout = RunLayout(tmp_path / "run")
    layout.root.mkdir()
    layout.metrics.write_text('{"step": 1, "loss": 1.0}\nnot json\n{"step": 2, "loss": 0.5}\n')
    rank0 = SimpleNamespace(is_main_process=True)  # the card is rank 0's (it holds metrics.jsonl)
    card = model_card(load_recipe(None), None, None, layout, None, rank0,  # type: ignore[arg-type]
                      vision=False, datasets=[])
    assert card is None
    assert f"final/ is written without its model card (README.md): {layout.metrics}:2 is not a JSON record" \
        in caplog.text


def test_hub_datasets_are_the_entries_read_from_the_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """The front matter's datasets: entries that are Hub ids, and registry entries with an hf_hub_url; not files."""
    import json

    from toolkit.config.schema import Recipe
    from toolkit.config.stages import resolve_stages
    from toolkit.data.stages import hub_datasets

    monkeypatch.chdir(tmp_path)
    (tmp_path / "local.jsonl").write_text("{}\n")
    (tmp_path / "reg").mkdir()
    (tmp_path / "reg" / "dataset_info.json").write_text(json.dumps({"mine": {"hf_hub_url": "org/registered"},
                                                                    "file": {"file_name": "f.jsonl"}}))
    (tmp_path / "reg" / "f.jsonl").write_text("{}\n")
    recipe = Recipe.model_validate({"stages": [
        {"name": "a", "data": ["local.jsonl", "org/chat", "dummy:stage1"]},
        {"name": "b", "data": [{"dataset": "mine", "dataset_dir": "reg"}, {"dataset": "file", "dataset_dir": "reg"},
                               "org/chat"]}]})
    assert hub_datasets(resolve_stages(recipe), tmp_path / "dummy") == ["org/chat", "org/registered"]


def test_the_card_records_paths_relative_to_the_recipe_not_this_machines(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose recipe (in project/recipes/) names its base model and data by absolute paths: the card (its
    body, the stages' data and the resolved recipe) holds them relative to the recipe's folder, and Hub ids as they
    are; no absolute path of this machine is left in it."""
    from types import SimpleNamespace

    from toolkit.config.load import load_recipe
    from toolkit.runtime.run_dir import RunLayout
    from toolkit.train.setup import model_card

    project = tmp_path / "project"
    (project / "recipes").mkdir(parents=True)
    (project / "models" / "base").mkdir(parents=True)
    recipe_file = project / "recipes" / "my.yaml"
    recipe_file.write_text(f"output_dir: {project / 'runs/r'}\nmodel: {{name_or_path: {project / 'models/base'}}}\n"
                           f"stages:\n  - {{name: only, data: ['{project / 'data/a.jsonl'}', org/hub-chat], "
                           "max_steps: 1}\n")
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(str(recipe_file))
    layout = RunLayout(project / "runs" / "r")
    layout.root.mkdir(parents=True)
    layout.metrics.write_text('{"step": 1, "loss": 1.0}\n')
    resolved = SimpleNamespace(paths=[str(project / "data/a.jsonl"), "org/hub-chat"], weights=None, trainable=None,
                               pairs=False)
    plan = SimpleNamespace(num_samples=4, steps=1, global_batch=4, lr=1e-4)
    curriculum = SimpleNamespace(stages=[SimpleNamespace(name="only", resolved=resolved, plan=plan,
                                                         trainable_params=None)])
    rank0 = SimpleNamespace(is_main_process=True)
    card = model_card(recipe, str(recipe_file), curriculum, layout, None, rank0,  # type: ignore[arg-type]
                      vision=False, datasets=[])
    assert card is not None
    assert str(tmp_path) not in card, card
    assert "`../models/base`" in card and "`../data/a.jsonl`" in card and "`org/hub-chat`" in card
    assert "output_dir: ../runs/r" in card and "Trained with the recipe `my.yaml`" in card
