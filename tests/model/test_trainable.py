"""Per-stage `trainable`: pattern matching, LoRA modules_to_save routing, signature groups, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from toolkit.builtin.text_model import write_tiny_qwen3
from toolkit.errors import ToolkitError
from toolkit.model.load import apply_lora
from toolkit.model.trainable import matches, modules_to_train, plan_trainable

LORA_TARGETS = ["q_proj", "v_proj"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny"))


def base(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir)


def lora_model(model_dir: Path, entries: list[list[str] | None], keys: list[str]) -> torch.nn.Module:
    model = base(model_dir)
    extra = modules_to_train(model, [e or [] for e in entries], keys)
    return apply_lora(model, r=2, alpha=4, dropout=0.0, target_modules=LORA_TARGETS, modules_to_save=extra)


def numel(model: torch.nn.Module, names: frozenset[str]) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if n in names)


@pytest.mark.parametrize(("name", "pattern", "expected"), [
    ("model.visual.merger.mlp.0.weight", "visual.merger", True),
    ("model.visual.merger.mlp.0.weight", "merger", True),
    ("model.visual.merger_x.weight", "visual.merger", False),  # whole components only
    ("model.visual.merger.weight", "isual.merger", False),
    ("model.norm.weight", "model.norm", True),
    ("model.norm.weight", "model.norm.weight", True),
    ("model.layers.0.input_layernorm.weight", "model.norm", False),
    ("model.layers.10.mlp.up_proj.weight", "layers.1[0-9].mlp", True),  # globs: over any run of components
    ("model.layers.1.mlp.up_proj.weight", "layers.1[0-9].mlp", False),
    ("model.layers.0.self_attn.q_proj.bias", "*.bias", True),
    ("model.layers.0.self_attn.q_proj.weight", "*.bias", False),
])
def test_matches(name: str, pattern: str, expected: bool) -> None:
    assert matches(name, pattern) is expected


def test_modules_to_train_takes_outermost_matches(model_dir: Path) -> None:
    model = base(model_dir)
    keys = ["stages.0.trainable", "stages.1.trainable"]
    assert modules_to_train(model, [["lora"], ["model.norm"]], keys) == ["model.norm"]
    assert modules_to_train(model, [["layers.1.mlp"], ["layers.1.mlp.up_proj", "model.norm"]], keys) == [
        "model.layers.1.mlp", "model.layers.1.mlp.up_proj", "model.norm"]
    assert modules_to_train(model, [["*.mlp"], []], keys) == ["model.layers.0.mlp", "model.layers.1.mlp"]


def test_unknown_pattern_names_key_and_close_names(model_dir: Path) -> None:
    model = base(model_dir)
    with pytest.raises(ToolkitError, match=r"stages\.1\.trainable: 'model\.nrom' matches no module of "
                                           r"Qwen3ForCausalLM\. Close names: .*model\.norm"):
        modules_to_train(model, [["lora"], ["model.nrom"]], ["stages.0.trainable", "stages.1.trainable"])
    with pytest.raises(ToolkitError, match=r"train\.trainable: 'visual\.merger' matches no module"):
        modules_to_train(model, [["visual.merger"]], ["train.trainable"])
    with pytest.raises(ToolkitError, match=r"stages\.0\.trainable: 'nrm\.weight' matches no trainable parameter"):
        plan_trainable(model, [["nrm.weight"]], ["stages.0.trainable"], lora=False)


def test_lora_stages_and_signature_groups(model_dir: Path) -> None:
    entries: list[list[str] | None] = [["lora"], ["model.norm"], ["lora", "model.norm"], None]
    keys = [f"stages.{i}.trainable" for i in range(4)]
    model = lora_model(model_dir, entries, keys)
    plan = plan_trainable(model, entries, keys, lora=True)
    names = dict(model.named_parameters())
    lora = frozenset(n for n in names if "lora_" in n)
    norm = frozenset(n for n in names if "model.norm.modules_to_save" in n)
    assert lora and len(norm) == 1
    assert plan.stage_names == [lora, norm, lora | norm, lora]  # None = the default: the adapters only
    assert plan.stage_counts == [numel(model, s) for s in plan.stage_names]
    assert plan.stage_counts[1] == 64  # hidden size: the final RMSNorm's weight
    # one optimizer group per signature, in model order; every trainable parameter in exactly one
    assert [sig for sig, _ in plan.groups] == [(True, False, True, True), (False, True, True, False)]
    assert sorted(n for _, group in plan.groups for n in group) == sorted(lora | norm)
    assert {n for n, p in names.items() if p.requires_grad} == lora | norm
    groups = plan.param_groups(model)
    assert [[id(p) for p in g["params"]] for g in groups] == [[id(names[n]) for n in ns] for _, ns in plan.groups]
    original = [n for n in names if "model.norm.original_module" in n]
    assert original and not names[original[0]].requires_grad  # PEFT's frozen copy stays frozen


def test_lora_pattern_over_adapted_module_is_refused(model_dir: Path) -> None:
    model = base(model_dir)  # no modules_to_save: the pattern's module holds LoRA layers
    model = apply_lora(model, r=2, alpha=4, dropout=0.0, target_modules=LORA_TARGETS, modules_to_save=[])
    for n, p in model.named_parameters():
        if "layers.0.self_attn" in n and "lora_" not in n:
            p.requires_grad_(True)
    with pytest.raises(ToolkitError, match="name modules that LoRA adapts"):
        plan_trainable(model, [["layers.0.self_attn"]], ["stages.0.trainable"], lora=True)


def test_full_finetuning_patterns_select_parameters(model_dir: Path) -> None:
    model = base(model_dir)
    entries: list[list[str] | None] = [["*norm*"], None]
    plan = plan_trainable(model, entries, ["stages.0.trainable", "train.trainable"], lora=False)
    names = [n for n, _ in model.named_parameters()]
    norms = frozenset(n for n in names if "norm" in n)
    assert plan.stage_names == [norms, frozenset(names)]
    assert all(p.requires_grad for p in model.parameters())  # every parameter trains in stage 2
    assert [sig for sig, _ in plan.groups] == [(False, True), (True, True)]  # model order: embeddings come first
    assert plan.stage_counts[1] == sum(p.numel() for p in model.parameters())
