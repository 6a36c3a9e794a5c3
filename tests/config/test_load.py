"""Tests for the recipe schema (toolkit/config/schema.py): loading, overrides, and the error messages users see."""

from __future__ import annotations

import copy
import re
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from toolkit.builtin.models import TINY_MODEL
from toolkit.config.load import DEFAULT_RECIPE, load_recipe, parse_overrides, recipe_to_yaml
from toolkit.config.schema import Recipe, StageConfig, TrainConfig
from toolkit.config.stages import resolve_stages
from toolkit.errors import ToolkitError

REPO = Path(__file__).resolve().parents[2]

RECIPE_YAML = """\
output_dir: outputs/test
model:
  name_or_path: some/model
  dtype: bfloat16
lora:
  enabled: false
data:
  max_seq_len: 512
  overlength: truncate
stages:
  - name: first
    data: [a.jsonl, dummy:stage1]
    epochs: 2.5
    lr: 1e-4
  - name: second
    data: [b.jsonl]
    max_steps: 7
    warmup_ratio: 0.2
optimizer:
  lr: 3.0e-4
  betas: [0.8, 0.95]
schedule:
  kind: linear
train:
  micro_batch_size: 2
  grad_accum: 4
  seed: 123
"""

MINIMAL_YAML = "stages:\n  - name: only\n    data: [x.jsonl]\n"


def _write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _error(path: str | Path | None, overrides: list[str] | None = None) -> str:
    with pytest.raises(ToolkitError) as info:
        load_recipe(path, overrides)
    return str(info.value)


# --- loading ---------------------------------------------------------------------------------------------------


def test_embedded_default_loads() -> None:
    recipe = load_recipe(None)
    assert recipe.output_dir == "outputs/demo"
    assert recipe.model.name_or_path == TINY_MODEL
    assert (recipe.lora.r, recipe.lora.alpha, recipe.lora.enabled) == (8, 16.0, True)
    assert recipe.data.max_seq_len == 256
    assert [s.name for s in recipe.stages] == ["warmup_short", "longer_multiturn"]
    assert [s.data for s in recipe.stages] == [["dummy:stage1"], ["dummy:stage2"]]
    # The embedded stage values come through unchanged (read from DEFAULT_RECIPE so the test survives lr tuning).
    assert [s.lr for s in recipe.stages] == [st["lr"] for st in DEFAULT_RECIPE["stages"]]
    assert all(isinstance(s.lr, float) and s.lr > 0 for s in recipe.stages)
    assert [s.epochs for s in recipe.stages] == [st.get("epochs") for st in DEFAULT_RECIPE["stages"]]
    assert (recipe.train.micro_batch_size, recipe.train.grad_accum, recipe.train.seed) == (4, 2, 42)
    # Fields the default leaves out take the schema defaults.
    assert recipe.optimizer.lr == 2e-4
    assert recipe.schedule.kind == "cosine"
    assert recipe.schedule.warmup_ratio == 0.03


def test_embedded_default_is_not_mutated_by_overrides() -> None:
    before = copy.deepcopy(DEFAULT_RECIPE)
    recipe = load_recipe(None, ["stages.0.lr=0.5", "optimizer.lr=0.25", "stages.1.data=[x.jsonl]"])
    assert (recipe.stages[0].lr, recipe.optimizer.lr, recipe.stages[1].data) == (0.5, 0.25, ["x.jsonl"])
    assert before == DEFAULT_RECIPE
    assert load_recipe(None).stages[0].lr == before["stages"][0]["lr"] != 0.5


def test_yaml_file_loads(tmp_path: Path) -> None:
    recipe = load_recipe(_write(tmp_path, RECIPE_YAML))
    assert recipe.output_dir == "outputs/test"
    assert recipe.model.name_or_path == "some/model"
    assert recipe.model.dtype == "bfloat16"
    assert recipe.lora.enabled is False
    assert (recipe.data.max_seq_len, recipe.data.overlength) == (512, "truncate")
    first, second = recipe.stages
    assert (first.name, first.data, first.epochs, first.max_steps) == ("first", ["a.jsonl", "dummy:stage1"], 2.5, None)
    # PyYAML reads `1e-4` (no dot) as a string; the schema must still turn it into the float 1e-4.
    assert first.lr == 1e-4 and isinstance(first.lr, float)
    assert (second.name, second.max_steps, second.epochs, second.warmup_ratio) == ("second", 7, None, 0.2)
    assert recipe.optimizer.lr == 3e-4
    assert recipe.optimizer.betas == (0.8, 0.95)
    assert recipe.schedule.kind == "linear"
    assert (recipe.train.micro_batch_size, recipe.train.grad_accum, recipe.train.seed) == (2, 4, 123)


def test_minimal_yaml_fills_defaults(tmp_path: Path) -> None:
    recipe = load_recipe(_write(tmp_path, MINIMAL_YAML))
    assert recipe.output_dir == "outputs/run"
    assert recipe.model.name_or_path == TINY_MODEL
    assert recipe.lora.r == 16
    assert recipe.lora.target_modules == "all-linear"
    assert recipe.stages[0].epochs is None and recipe.stages[0].max_steps is None


def test_repo_smoke_recipe_loads() -> None:
    path = REPO / "recipes" / "smoke.yaml"
    raw = yaml.safe_load(path.read_text())
    recipe = load_recipe(path)
    assert [s.name for s in recipe.stages] == [st["name"] for st in raw["stages"]]
    assert [(s.max_steps, s.epochs, s.lr) for s in recipe.stages] == [
        (st.get("max_steps"), st.get("epochs"), st.get("lr")) for st in raw["stages"]]
    assert recipe.model_dump(mode="json")["train"] == {**TrainConfig().model_dump(mode="json"), **raw["train"]}


def test_recipe_to_yaml_round_trips(tmp_path: Path) -> None:
    recipe = load_recipe(_write(tmp_path, RECIPE_YAML))
    dumped = recipe_to_yaml(recipe)
    assert yaml.safe_load(dumped)["optimizer"]["betas"] == [0.8, 0.95]
    again = load_recipe(_write(tmp_path, dumped, "resolved.yaml"))
    assert again == recipe


def test_missing_recipe_file_names_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "recipe.yaml"
    msg = _error(missing)
    assert str(missing) in msg
    assert "does not exist" in msg


def test_invalid_yaml_is_toolkit_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "stages: [\n  - name: a\n")
    msg = _error(path)
    assert str(path) in msg and "not valid YAML" in msg


def test_non_mapping_yaml_is_toolkit_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "- a\n- b\n")
    msg = _error(path)
    assert str(path) in msg and "mapping" in msg


# --- unknown keys, wrong types, missing keys ----------------------------------------------------------------------


def test_unknown_top_level_key(tmp_path: Path) -> None:
    msg = _error(_write(tmp_path, MINIMAL_YAML + "optimiser:\n  lr: 1.0e-4\n"))
    assert "unknown key 'optimiser'" in msg
    assert "Did you mean: optimizer?" in msg
    assert str(tmp_path / "recipe.yaml") in msg


def test_unknown_nested_key_names_full_path_and_suggests(tmp_path: Path) -> None:
    msg = _error(_write(tmp_path, MINIMAL_YAML + "optimizer:\n  lrr: 1.0e-4\n"))
    assert "unknown key 'optimizer.lrr'" in msg
    assert "Did you mean: lr" in msg
    # The valid keys listed are the optimizer section's, not the top level's.
    assert "Valid keys here: lr, weight_decay, betas, eps, max_grad_norm, lr_scaling, reference_batch_size." in msg


def test_unknown_nested_key_via_override() -> None:
    msg = _error(None, ["optimizer.lrr=1e-4"])
    assert "unknown key 'optimizer.lrr'" in msg
    assert "Did you mean: lr" in msg
    assert "(embedded default)" in msg


def test_unknown_key_inside_stage() -> None:
    msg = _error(None, ["stages.0.epoch=2"])
    assert "unknown key 'stages.0.epoch'" in msg
    assert "Did you mean: epochs?" in msg
    assert f"Valid keys here: {', '.join(StageConfig.model_fields)}." in msg


def test_unknown_key_inside_stage_in_yaml(tmp_path: Path) -> None:
    text = "stages:\n  - name: a\n    data: [x.jsonl]\n  - name: b\n    data: [y.jsonl]\n    mx_steps: 3\n"
    msg = _error(_write(tmp_path, text))
    assert "unknown key 'stages.1.mx_steps'" in msg
    assert "Did you mean: max_steps" in msg  # the closest name first


def test_wrong_type_names_key(tmp_path: Path) -> None:
    msg = _error(_write(tmp_path, MINIMAL_YAML + "optimizer:\n  lr: fast\n"))
    assert "'optimizer.lr'" in msg
    assert "'fast'" in msg
    assert "valid number" in msg


def test_wrong_literal_names_key() -> None:
    msg = _error(None, ["schedule.kind=exponential"])
    assert "'schedule.kind'" in msg
    assert "'exponential'" in msg


def test_out_of_range_value_names_key() -> None:
    msg = _error(None, ["lora.dropout=1.5"])
    assert "'lora.dropout'" in msg


def test_missing_stages_is_reported(tmp_path: Path) -> None:
    msg = _error(_write(tmp_path, "output_dir: x\n"))
    assert "'stages' is required." in msg


def test_empty_yaml_reports_missing_stages(tmp_path: Path) -> None:
    assert "'stages' is required." in _error(_write(tmp_path, ""))


def test_missing_stage_name_is_reported(tmp_path: Path) -> None:
    msg = _error(_write(tmp_path, "stages:\n  - data: [x.jsonl]\n"))
    assert "'stages.0.name' is required." in msg


def test_empty_stage_list_is_error(tmp_path: Path) -> None:
    assert "'stages'" in _error(_write(tmp_path, "stages: []\n"))


# --- overrides ---------------------------------------------------------------------------------------------------


def test_parse_overrides_types() -> None:
    assert parse_overrides(["optimizer.lr=1.0e-4", "stages.1.max_steps=3", "lora.target_modules=[q_proj,v_proj]",
                            "logging.progress_bar=false", "data.chat_template="]) == [
        (["optimizer", "lr"], 1e-4),
        (["stages", "1", "max_steps"], 3),
        (["lora", "target_modules"], ["q_proj", "v_proj"]),
        (["logging", "progress_bar"], False),
        (["data", "chat_template"], None),
    ]


def test_parse_overrides_keeps_equals_in_value() -> None:
    assert parse_overrides(["output_dir=a=b"]) == [(["output_dir"], "a=b")]


def test_overrides_apply_with_correct_types(tmp_path: Path) -> None:
    recipe = load_recipe(_write(tmp_path, RECIPE_YAML),
                         ["optimizer.lr=1e-4", "stages.1.max_steps=3", "lora.target_modules=[q_proj,v_proj]"])
    assert recipe.optimizer.lr == 1e-4 and isinstance(recipe.optimizer.lr, float)
    assert recipe.stages[1].max_steps == 3 and isinstance(recipe.stages[1].max_steps, int)
    assert recipe.lora.target_modules == ["q_proj", "v_proj"]
    # Untouched neighbours keep their values.
    assert recipe.stages[1].warmup_ratio == 0.2
    assert recipe.stages[0].epochs == 2.5


def test_overrides_on_embedded_default() -> None:
    recipe = load_recipe(None, ["optimizer.lr=1e-4", "stages.1.epochs=", "stages.1.max_steps=3",
                                "lora.target_modules=[q_proj,v_proj]", "schedule.kind=constant"])
    assert recipe.optimizer.lr == 1e-4
    assert (recipe.stages[1].max_steps, recipe.stages[1].epochs) == (3, None)
    assert (recipe.stages[0].max_steps, recipe.stages[0].epochs) == (None, None)  # epochs default to 1
    assert recipe.lora.target_modules == ["q_proj", "v_proj"]
    assert recipe.schedule.kind == "constant"
    # Sections that the override created keep their other defaults.
    assert recipe.optimizer.weight_decay == 0.0


def test_max_steps_override_on_embedded_default() -> None:
    recipe = load_recipe(None, ["stages.1.max_steps=3"])
    assert recipe.stages[1].max_steps == 3


def test_later_override_wins() -> None:
    assert load_recipe(None, ["optimizer.lr=0.1", "optimizer.lr=0.2"]).optimizer.lr == 0.2


@pytest.mark.parametrize("bad", ["foo", "=1", " =1"])
def test_malformed_override(bad: str) -> None:
    with pytest.raises(ToolkitError, match=r"is not of the form key\.sub=value"):
        parse_overrides([bad])
    with pytest.raises(ToolkitError, match=r"is not of the form key\.sub=value"):
        load_recipe(None, [bad])


def test_override_list_index_out_of_range() -> None:
    msg = _error(None, ["stages.5.lr=1"])
    assert "stages.5" in msg
    assert "index out of range" in msg
    assert "2 items" in msg


def test_override_last_part_index_out_of_range() -> None:
    msg = _error(None, ["stages.2={name: c, data: [z.jsonl]}"])
    assert "stages.2" in msg and "index out of range" in msg


def test_override_non_numeric_list_index() -> None:
    assert "index out of range" in _error(None, ["stages.first.lr=1"])


def test_override_replaces_whole_stage() -> None:
    recipe = load_recipe(None, ["stages.1={name: c, data: [z.jsonl], max_steps: 2}"])
    assert [(s.name, s.data, s.max_steps, s.epochs) for s in recipe.stages][1] == ("c", ["z.jsonl"], 2, None)


def test_override_below_scalar_is_toolkit_error() -> None:
    msg = _error(None, ["output_dir.sub=1"])
    assert "output_dir" in msg


# --- cross-field validation -------------------------------------------------------------------------------------


def test_epochs_and_max_steps_both_set_is_error(tmp_path: Path) -> None:
    text = "stages:\n  - name: a\n    data: [x.jsonl]\n    epochs: 2\n    max_steps: 10\n"
    msg = _error(_write(tmp_path, text))
    assert "'stages.0'" in msg
    assert "set either epochs or max_steps, not both" in msg


def test_epochs_and_max_steps_both_set_via_override() -> None:
    msg = _error(None, ["stages.0.epochs=2", "stages.0.max_steps=3"])
    assert "'stages.0'" in msg and "not both" in msg


def test_lr_scaling_needs_reference_batch_size() -> None:
    msg = _error(None, ["optimizer.lr_scaling=linear"])
    assert "'optimizer'" in msg
    assert "reference_batch_size" in msg


def test_lr_scaling_with_reference_batch_size_loads() -> None:
    recipe = load_recipe(None, ["optimizer.lr_scaling=sqrt", "optimizer.reference_batch_size=16"])
    assert (recipe.optimizer.lr_scaling, recipe.optimizer.reference_batch_size) == ("sqrt", 16)


def test_duplicate_stage_names_are_error(tmp_path: Path) -> None:
    text = ("stages:\n  - {name: a, data: [x.jsonl]}\n  - {name: b, data: [y.jsonl]}\n"
            "  - {name: a, data: [z.jsonl]}\n")
    msg = _error(_write(tmp_path, text))
    assert "stage names must be unique" in msg
    assert "['a']" in msg


def test_stage_names_that_become_one_path_component_are_refused(tmp_path: Path) -> None:
    """`a/b` and `a:b` both become `a_b`: they would share evals/a_b/ and scores/a_b.parquet (one stage's scores read
    as the other's). Refused at load naming both; names that stay apart load."""
    text = ("stages:\n  - {name: a/b, data: [x.jsonl]}\n  - {name: c, data: [y.jsonl]}\n"
            "  - {name: 'a:b', data: [z.jsonl]}\n")
    msg = _error(_write(tmp_path, text))
    assert "stages 'a/b' and 'a:b' would share the folder and scores file 'a_b'" in msg
    text = "stages:\n  - {name: a/b, data: [x.jsonl]}\n  - {name: a_b_, data: [y.jsonl]}\n"
    assert [s.name for s in load_recipe(_write(tmp_path, text)).stages] == ["a/b", "a_b_"]


def test_duplicate_stage_names_via_override() -> None:
    assert "repeated: ['warmup_short']" in _error(None, ["stages.1.name=warmup_short"])


def test_negative_seed_is_rejected_by_schema() -> None:
    msg = _error(None, ["train.seed=-1"])
    assert "'train.seed'" in msg


# --- descriptions -----------------------------------------------------------------------------------------------


def _sections(model: type[BaseModel], prefix: str, seen: dict[str, type[BaseModel]]) -> None:
    seen[prefix or "(top level)"] = model
    for name, info in model.model_fields.items():
        stack = [info.annotation]
        while stack:
            ann = stack.pop()
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                _sections(ann, f"{prefix}{name}.", seen)
            else:
                stack.extend(typing.get_args(ann))


def test_every_field_has_description() -> None:
    sections: dict[str, type[BaseModel]] = {}
    _sections(Recipe, "", sections)
    # every section of the schema is visited (so a new section cannot escape the description check)
    scalars = {"output_dir", "run_name"}
    assert set(sections) >= {"(top level)"} | {f"{name}." for name in Recipe.model_fields if name not in scalars}
    assert {"stages.data.", "stages.pacing."} <= set(sections)  # nested sections are visited too
    missing = [f"{prefix}{name}" for prefix, model in sections.items() for name, info in model.model_fields.items()
               if not (info.description and info.description.strip())]
    assert missing == []
    assert sum(len(m.model_fields) for m in sections.values()) >= 40


# --- trainable, patience, vision settings ----------------------------------------------------------------------

def test_trainable_and_patience_load() -> None:
    recipe = load_recipe(None, ["train.trainable=[lora, model.norm]", "stages.1.trainable=[visual.merger]",
                                "stages.0.patience=3", "stages.0.patience_min_delta=0.01", "eval.data=[e.jsonl]",
                                "eval.every_steps=10", "data.max_pixels=50176"])
    assert recipe.train.trainable == ["lora", "model.norm"] and recipe.stages[1].trainable == ["visual.merger"]
    assert recipe.stages[0].patience == 3 and recipe.data.max_pixels == 50176


@pytest.mark.parametrize(("overrides", "needle"), [
    (["lora.enabled=false", "stages.1.trainable=[lora]"], "stages.1 ('longer_multiturn'): trainable names 'lora' "
                                                          "but lora.enabled is false"),
    (["lora.enabled=false", "train.trainable=[lora]"], "trainable names 'lora' but lora.enabled is false"),
    (["stages.0.trainable=[]"], "stages.0.trainable"),
    (["stages.0.patience=2"], "patience needs eval data (stages[].eval or eval.data) and eval.every_steps"),
    (["stages.0.patience=2", "eval.data=[e.jsonl]"], "patience needs eval data"),
    (["stages.0.patience=0"], "stages.0.patience"),
    (["stages.0.patience=2", "eval.data=[e.jsonl]", "eval.every_steps=5", "stages.1.schedule=continue"],
     "would cut the LR schedule that stage 'longer_multiturn' continues"),
    (["data.min_pixels=1000", "data.max_pixels=100"], "min_pixels (1000) is larger than max_pixels (100)"),
    (["lora.exclude_modules=.*(visual"], "exclude_modules is not a valid regular expression: missing )"),
])
def test_trainable_patience_and_pixel_errors(overrides: list[str], needle: str) -> None:
    assert needle in _error(None, overrides)


def test_changed_trainable_changes_resume_invariants() -> None:
    from toolkit.config.identity import resume_invariants

    plain, frozen = load_recipe(None), load_recipe(None, ["train.trainable=[lora]"])
    assert "trainable" not in resume_invariants(plain)  # unset: hashes of existing checkpoints are unchanged
    assert resume_invariants(frozen)["trainable"] == ["lora"]
    staged = load_recipe(None, ["stages.1.trainable=[model.norm]"])
    assert resume_invariants(staged)["stages"][1]["trainable"] == ["model.norm"]


def test_per_stage_micro_batch_is_layout_not_an_invariant() -> None:
    """Like train.micro_batch_size: another split of the same per-stage global batch may resume (checked through
    the global batches), so the per-stage micro batch is left out of the hash when set."""
    from toolkit.config.identity import resume_invariants

    one, two = (load_recipe(None, [f"stages.1.micro_batch_size={m}"]) for m in (1, 2))
    assert resume_invariants(one) == resume_invariants(two)
    assert resume_invariants(load_recipe(None))["stages"][1]["micro_batch_size"] is None  # unset: unchanged hash


def test_the_renderer_is_how_data_is_prepared_not_an_invariant() -> None:
    """data.renderer changes the speed, not the text (the direct renderer is the template's text byte for byte):
    a resume may switch it, and checkpoints written before the key existed keep their hash."""
    from toolkit.config.identity import resume_invariants

    direct, jinja = load_recipe(None), load_recipe(None, ["data.renderer=jinja"])
    assert jinja.data.renderer == "jinja" and resume_invariants(direct) == resume_invariants(jinja)
    assert "renderer" not in resume_invariants(direct)["data"]


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_validates(path: Path) -> None:
    recipe = load_recipe(path)
    assert recipe.stages and all(s.name for s in recipe.stages)


def test_resolve_stages_takes_each_stage_value_else_the_recipe_default() -> None:
    recipe = load_recipe(None, ["data.max_seq_len=128", "train.micro_batch_size=4", "optimizer.lr=1e-3",
                                "schedule.kind=linear", "schedule.warmup_ratio=0.1", "eval.data=[e.jsonl]",
                                "stages.1.max_seq_len=512", "stages.1.micro_batch_size=1", "stages.1.lr=null",
                                "stages.1.schedule=continue", "stages.1.warmup_ratio=0.0",
                                "stages.1.eval=[own.jsonl]", "stages.1.trainable=[lora, '*.norm']"])
    first, second = resolve_stages(recipe)
    assert (first.max_seq_len, first.micro_batch_size, first.lr) == (128, 4, 1e-2)  # the demo's stage lr
    assert (second.max_seq_len, second.micro_batch_size, second.lr) == (512, 1, 1e-3)
    assert (first.schedule, second.schedule, first.warmup_ratio, second.warmup_ratio) == ("linear", "continue",
                                                                                         0.1, 0.0)
    assert (first.eval, second.eval) == (("e.jsonl",), ("own.jsonl",))
    assert (first.eval_micro_batch_size, second.eval_micro_batch_size) == (4, 1)  # the stage's, not train's
    assert (first.trainable, first.trainable_key) == (("lora",), "train.trainable")  # LoRA's default
    assert (second.trainable, second.trainable_key) == (("lora", "*.norm"), "stages.1.trainable")
    full = resolve_stages(load_recipe(None, ["lora.enabled=false", "eval.micro_batch_size=3"]))
    assert full[0].trainable is None and full[0].eval_micro_batch_size == 3  # None: every parameter


GEN = "eval.generation=[{name: facts, data: [f.jsonl], scorers: [exact, {kind: contains, name: has}]}]"


def test_a_gate_names_a_metric_its_stage_evaluates() -> None:
    from toolkit.config.stages import stage_metrics

    gated = ["eval.every_steps=2", "stages.0.advance_when={metric: facts.exact, at_least: 0.9, min_steps: 3}"]
    recipe = load_recipe(None, [GEN, *gated])
    assert recipe.stages[0].advance_when.describe() == "facts.exact >= 0.9"
    stages = resolve_stages(recipe)
    assert stage_metrics(stages, 0, all_stages=False) == ["facts.exact", "facts.has"]
    own = load_recipe(None, ["stages.0.eval=[a.jsonl]", "stages.1.eval=[b.jsonl]",
                             "stages.1.generation=[{name: late, data: [l.jsonl], scorers: [json_valid]}]"])
    assert stage_metrics(resolve_stages(own), 0, all_stages=False) == ["eval_loss"]
    assert stage_metrics(resolve_stages(own), 0, all_stages=True) == [
        "eval_loss", "warmup_short.eval_loss", "longer_multiturn.eval_loss", "late.json_valid"]
    at_most = load_recipe(None, ["stages.0.eval=[a.jsonl]", "eval.every_steps=5",
                                 "stages.0.advance_when={metric: eval_loss, at_most: 1.5}"])
    assert at_most.stages[0].advance_when.met(1.5) and not at_most.stages[0].advance_when.met(1.6)


@pytest.mark.parametrize(("overrides", "message"), [
    (["stages.0.advance_when={metric: facts.exact, at_least: 1}"],
     "stages.0 ('warmup_short'): advance_when needs an eval of this stage to decide on"),
    ([GEN, "eval.every_steps=2", "stages.0.advance_when={metric: facts.exakt, at_least: 1}"],
     "advance_when.metric 'facts.exakt' is not a metric this stage evaluates (did you mean facts.exact?); its "
     "metrics: facts.exact, facts.has"),
    ([GEN, "eval.every_steps=2", "stages.0.advance_when={metric: eval_loss, at_most: 1}"],
     "advance_when.metric 'eval_loss' is not a metric this stage evaluates"),
    ([GEN, "stages.0.advance_when={metric: facts.exact, at_least: 1}"], "advance_when needs eval.every_steps"),
    ([GEN, "eval.every_steps=2", "stages.0.advance_when={metric: facts.exact}"],
     "advance_when needs exactly one of at_least and at_most"),
    ([GEN, "eval.every_steps=2", "stages.0.advance_when={metric: facts.exact, at_least: 1, at_most: 2}"],
     "advance_when needs exactly one of at_least and at_most"),
    ([GEN, "eval.every_steps=2", "stages.1.schedule=continue",
      "stages.0.advance_when={metric: facts.exact, at_least: 1}"],
     "advance_when may end the stage early, which would cut the LR schedule that stage 'longer_multiturn' continues"),
    ([GEN, "stages.1.generation=[{name: facts, data: [g.jsonl], scorers: [exact]}]"],
     "generation eval names must be unique, repeated: ['facts'] (eval.generation, stages.1.generation)"),
    (["eval.generation=[{name: 'a.b', data: [f.jsonl], scorers: [exact]}]"], "'eval.generation.0.name': String "
     "should match pattern"),
])
def test_bad_gates_and_generation_evals(overrides: list[str], message: str) -> None:
    with pytest.raises(ToolkitError) as err:
        load_recipe(None, overrides)
    assert message in str(err.value) and "'stages': [" not in str(err.value)  # no dump of the whole recipe


def test_gates_bind_their_evals_to_checkpoints() -> None:
    """A gated recipe's eval settings decide stage lengths: a resume with other ones is a changed recipe."""
    from toolkit.config.identity import resume_invariants

    gated = [GEN, "eval.every_steps=2", "stages.0.advance_when={metric: facts.exact, at_least: 1}"]
    assert resume_invariants(load_recipe(None, gated)) != resume_invariants(load_recipe(None, [*gated[:1],
                                                                                              "eval.every_steps=3",
                                                                                              gated[2]]))
    assert "gate_evals" not in resume_invariants(load_recipe(None, [GEN]))  # ungated: as before


@pytest.mark.parametrize(("overrides", "needle"), [
    (["stages.0.objective=dpo", "stages.0.order=easy_to_hard", "stages.0.difficulty={by: ifd, model: current}"],
     "stages.0 ('warmup_short'): difficulty.by ifd on an objective dpo stage is not supported"),
    (["stages.0.objective=simpo", "stages.0.order=easy_to_hard", "stages.0.difficulty={by: loss, model: base}"],
     "difficulty.by loss on an objective simpo stage is not supported"),
    (["stages.0.order=easy_to_hard", "stages.0.difficulty={by: margin, model: current}"],
     "stages.0 ('warmup_short'): difficulty.by margin scores preference pairs, and this objective sft stage has none"),
    (["stages.0.objective=dpo", "stages.0.order=easy_to_hard", "stages.0.difficulty={by: chosen_loss}"],
     "difficulty.by is chosen_loss: name the scorer with difficulty.model: base or current"),
    (["stages.0.objective=dpo", "stages.0.order=easy_to_hard", "stages.0.difficulty={by: margin, model: org/scorer}"],
     "difficulty.by is margin: name the scorer with difficulty.model: base or current"),
    (["stages.0.objective=ppo"], "'stages.0.objective': Input should be 'sft', 'dpo', 'orpo', 'simpo', 'kto' or "
     "'grpo'"),
    (["stages.0.objective=kto", "stages.0.preference={loss: ipo}"], "preference.loss is set but a kto stage's loss is "
     "KTO's"),
    (["stages.0.objective=dpo", "stages.0.preference={desirable_weight: 1.3}"], "preference.desirable_weight is set "
     "but the stage's objective is dpo; only kto stages"),
    (["stages.0.objective=kto", "stages.0.preference={undesirable_weight: -1}"],
     "'stages.0.preference.undesirable_weight'"),
    (["stages.0.objective=kto", "stages.0.preference={reference: base}", "lora.enabled=false"],
     "preference.reference is base (the model with its LoRA adapter off) but lora.enabled is false"),
    (["stages.0.objective=kto", "stages.0.order=easy_to_hard", "stages.0.difficulty={by: margin, model: current}"],
     "difficulty.by margin on a kto stage is not supported"),
    (["stages.0.objective=kto", "train.micro_batch_size=1"], "a kto stage's micro_batch_size is 1, so each row's "
     "KL side would be the row itself"),
    (["stages.0.preference={beta: 0.2}"], "preference is set but the stage's objective is sft"),
    (["stages.0.objective=dpo", "stages.0.preference={beta: 0}"], "'stages.0.preference.beta'"),
    (["stages.0.objective=dpo", "stages.0.preference={loss: [sigmoid, dpo]}"], "'stages.0.preference.loss.1'"),
    (["stages.0.objective=dpo", "stages.0.preference={loss: [sigmoid, sigmoid]}"], "names a loss twice"),
    (["stages.0.objective=dpo", "stages.0.preference={loss: sft}"], "preference.loss is only sft"),
    (["stages.0.objective=dpo", "stages.0.preference={loss: [sigmoid, sft], loss_weights: [1]}"],
     "loss_weights has 1 weights for 2 losses"),
    (["stages.0.objective=dpo", "stages.0.preference={label_smoothing: 0.1}"],
     "only the robust loss uses it"),
    (["stages.0.objective=dpo", "stages.0.preference={loss: robust, label_smoothing: 0.5}"],
     "'stages.0.preference.label_smoothing': Input should be less than 0.5"),
    (["stages.0.objective=dpo", "stages.0.preference={simpo_gamma: 1}"], "only simpo stages use it"),
    (["stages.0.objective=orpo", "stages.0.preference={loss: [hinge]}"], "pair loss is orpo itself"),
    (["stages.0.objective=simpo", "stages.0.preference={reference: base}"], "simpo takes no reference"),
    (["stages.0.objective=orpo", "stages.0.preference={loss_weights: [0.5]}"],
     "an orpo stage weighs only its sft term"),
    (["lora.enabled=false", "stages.0.objective=dpo", "stages.0.preference={reference: base}"],
     "reference is base (the model with its LoRA adapter off) but lora.enabled is false"),
])
def test_preference_stage_keys_are_validated(overrides: list[str], needle: str) -> None:
    """Every bad value of stages[].objective / stages[].preference gets its one line, and so does what a pair
    stage cannot do yet (rank pairs by a field or a model, drop by difficulty)."""
    assert needle in _error(None, overrides)


def test_sft_objective_is_the_default_and_leaves_resume_hashes_unchanged() -> None:
    from toolkit.config.identity import resume_invariants

    recipe = load_recipe(None)
    assert [s.objective for s in recipe.stages] == ["sft"] * len(recipe.stages)
    assert all("objective" not in s and "preference" not in s for s in resume_invariants(recipe)["stages"])
    assert resume_invariants(load_recipe(None, ["stages.0.objective=sft"])) == resume_invariants(recipe)
def test_the_recipe_guide_names_every_model_key() -> None:
    """docs/recipes.md's annotated recipe has a line for each `model.*` key of the schema (trust_remote_code, which
    decides whether a model folder's own Python code runs, was missing)."""
    from toolkit.config.schema import ModelConfig

    guide = (Path(__file__).resolve().parents[2] / "docs" / "recipes.md").read_text(encoding="utf-8")
    block = guide[guide.index("\nmodel:\n"):guide.index("\nlora:")]
    missing = [key for key in ModelConfig.model_fields if not re.search(rf"^\s+#? ?{key}:", block, re.MULTILINE)]
    assert not missing, missing
