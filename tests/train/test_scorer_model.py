"""A separate scorer model (toolkit/train/scorer_model.py) and `drop` by a model's scores (toolkit/train/
stage_scores.py), on a real stage built as training builds it (`build_stages`).

A second tiny Qwen3 (another seed and width, the run's tokenizer) scores a stage's rows at step 0: its scores equal a
plain full-logits computation with that model within 1e-6 (fp32); the rows a drop leaves out are exactly the easiest
and hardest by those scores (packed rows: by their hardest sample); the stage's length is planned before the scores
and does not move with them; a launch resumed inside the stage reads the scores and draws the same batches; a
scorer with other weights has another key (rescored at step 0, refused past it); a scorer with another tokenizer is
refused in one line.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from toolkit.builtin.text_model import write_tiny_qwen3
from toolkit.config.load import load_recipe
from toolkit.config.schema import Recipe
from toolkit.config.stages import resolve_stages
from toolkit.data.encoding import IGNORE_INDEX
from toolkit.data.plan import KeptRows
from toolkit.errors import ToolkitError
from toolkit.model.load import load_processing
from toolkit.runtime import process as distributed
from toolkit.train.scorer_model import check_scorers, weights_identity
from toolkit.train.setup import build_collator, build_stages
from toolkit.train.stage_scores import order_by_model

ROWS = 16
ANSWERS = ["4.", "Blue, like the sky over the sea at noon.", "c a t", "one two three four five", "Hi!",
           "144, since 12 * 12 = 144.", "The quick brown fox jumps over the lazy dog.", "Yes."]


@pytest.fixture(scope="module")
def scorer(tmp_path_factory: pytest.TempPathFactory, models: dict[str, str]) -> Path:
    """A second tiny Qwen3: another seed and width, the run's tokenizer."""
    out = tmp_path_factory.mktemp("scorer") / "small"
    return write_tiny_qwen3(out, tokenizer=AutoTokenizer.from_pretrained(models["text"]), hidden_size=32,
                            num_heads=2, num_kv_heads=1, intermediate_size=64, seed=11)


def _recipe(tmp: Path, model: str, scorer: Path, **data: Any) -> Recipe:
    rows = [{"messages": [{"role": "user", "content": f"Question {i}: say something."},
                          {"role": "assistant", "content": ANSWERS[i % len(ANSWERS)] + " " * (i // len(ANSWERS))}]}
            for i in range(ROWS)]
    (tmp / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tree = {"output_dir": str(tmp / "run"), "model": {"name_or_path": model, "dtype": "float32"},
            "data": {"max_seq_len": 64, "num_proc": 1, "cache_dir": str(tmp / "cache"), **data},
            "stages": [{"name": "scored", "data": [str(tmp / "data.jsonl")], "order": "easy_to_hard",
                        "difficulty": {"by": "loss", "model": str(scorer)},
                        "drop": {"easiest": 0.25, "hardest": 0.125}, "epochs": 2}],
            "train": {"micro_batch_size": 1, "grad_accum": 2}, "logging": {"progress_bar": False, "trackers": []}}
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(tree))
    return load_recipe(tmp / "recipe.yaml")


@pytest.fixture(autouse=True)
def full_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp32 launch (no autocast), whatever an earlier test of the session left in accelerate's state."""
    from accelerate.state import AcceleratorState

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    AcceleratorState._reset_state()


def _launch(recipe: Recipe, model: str) -> tuple[Any, Any]:
    """(run, stage) as a launch holds them before its first step: the stage built, planned and not yet scored."""
    accelerator = distributed.build_accelerator(recipe.train.grad_accum, 10)
    assert accelerator.mixed_precision == "no"
    resolved = resolve_stages(recipe)
    _, tokenizer = load_processing(model, vision=False, trust_remote_code=False, chat_template=None)
    check_scorers(recipe, resolved, tokenizer, vision=False)
    curriculum = build_stages(recipe, resolved, accelerator, tokenizer, None, Path("unused"), None)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa")
    run = SimpleNamespace(recipe=recipe, accelerator=accelerator, model=policy, curriculum=curriculum,
                          collate=build_collator(recipe, model, tokenizer, vision=False), resumed_from=None,
                          identity=None, preemption=SimpleNamespace(started=False))
    return run, curriculum.stages[0]


@torch.no_grad()
def _reference(path: Path, rows: KeptRows) -> np.ndarray:
    """Each row's mean label-token loss under the scorer, alone, from full logits in float64."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    out = []
    for sample in (rows[i] for i in range(len(rows))):  # KeptRows wraps indices: no end to iterate to
        logp = F.log_softmax(model(input_ids=torch.tensor([sample["input_ids"]])).logits[0].double(), dim=-1)
        targets = torch.tensor(sample["labels"])[1:]
        keep = targets != IGNORE_INDEX
        out.append(float(-logp[:-1][keep].gather(1, targets[keep].unsqueeze(1)).sum()) / int(keep.sum()))
    return np.array(out)


def _batches(stage: Any) -> list[list[int]]:
    return [stage.sampler.batch(k) for k in range(stage.plan.steps)]


@pytest.mark.parametrize("packing", [False, True])
def test_a_scorer_orders_and_drops_a_stage_by_its_own_scores_and_a_resume_reads_them(
        tmp_path: Path, models: dict[str, str], scorer: Path, packing: bool,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="toolkit")
    recipe = _recipe(tmp_path, models["text"], scorer, packing=packing)
    run, stage = _launch(recipe, models["text"])
    n = len(stage.data.samples)
    easy, hard = n // 4, n // 8
    assert stage.data.dropped_by_score == (easy, hard)
    planned = stage.plan
    assert planned.num_samples == stage.sampler.num_samples == n - easy - hard  # planned before any score

    scores = order_by_model(run, stage, 0)
    rows = KeptRows(stage.data.samples.parts)
    expected = _reference(scorer, rows)
    np.testing.assert_allclose(scores, expected, rtol=1e-6, atol=1e-6)
    per_row = rows.per_row(expected)  # a packed row ranks by its hardest sample
    ranked = np.argsort(per_row, kind="stable")
    left_out = set(ranked[:easy].tolist()) | set(ranked[n - hard:].tolist())
    assert stage.plan == planned and stage.sampler.num_samples == n - easy - hard  # the scores moved no length
    seen = _batches(stage)
    drawn = [i for batch in seen for i in batch]
    assert set(drawn) == set(range(n)) - left_out  # exactly the kept rows, every one of them
    kept_order = [i for i in ranked.tolist() if i not in left_out]
    assert seen[0] == kept_order[:len(seen[0])]  # easiest kept first
    assert f"dropped the {easy} easiest and the {hard} hardest of its {n} rows by loss of the scorer" in caplog.text
    assert "loaded whole on each process" in caplog.text
    (key_file,) = (tmp_path / "run" / "scores").glob("scores-*.npz")

    # A launch resumed inside the stage: the scores are read (the scorer is not loaded) and the batches are the same.
    caplog.clear()
    again, resumed = _launch(recipe, models["text"])
    np.testing.assert_array_equal(order_by_model(again, resumed, 3), scores)
    assert "loaded whole on each process" not in caplog.text and "read from" in caplog.text
    assert resumed.plan == planned and _batches(resumed) == seen

    # Other weights: another key. At step 0 scored anew beside the first file; past it, refused in one line.
    changed = tmp_path / "changed"
    shutil.copytree(scorer, changed)
    write_tiny_qwen3(changed, tokenizer=AutoTokenizer.from_pretrained(models["text"]), hidden_size=32, num_heads=2,
                     num_kv_heads=1, intermediate_size=64, seed=12)
    assert weights_identity(changed, recipe) != weights_identity(scorer, recipe)
    other = _recipe(tmp_path, models["text"], changed, packing=packing)
    late, late_stage = _launch(other, models["text"])
    with pytest.raises(ToolkitError, match="resumes past the point those scores were taken"):
        order_by_model(late, late_stage, 3)
    fresh, fresh_stage = _launch(other, models["text"])
    order_by_model(fresh, fresh_stage, 0)
    files = sorted(p.name for p in (tmp_path / "run" / "scores").glob("scores-*.npz"))
    assert len(files) == 2 and key_file.name in files


def test_a_scorer_with_another_tokenizer_is_refused_in_one_line(tmp_path: Path, models: dict[str, str],
                                                                  scorer: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(scorer, other)
    tokenizer = AutoTokenizer.from_pretrained(models["text"])
    tokenizer.add_tokens(["<|extra|>"])
    tokenizer.save_pretrained(other)
    recipe = _recipe(tmp_path, models["text"], other)
    _, ours = load_processing(models["text"], vision=False, trust_remote_code=False, chat_template=None)
    with pytest.raises(ToolkitError) as refused:
        check_scorers(recipe, resolve_stages(recipe), ours, vision=False)
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"stage 'scored': difficulty.model '{other}' has another tokenizer")
    assert "added tokens" in line
    (other / "config.json").write_text("{")
    with pytest.raises(ToolkitError, match="its config cannot be read"):
        check_scorers(recipe, resolve_stages(recipe), ours, vision=False)


def test_the_scorers_dtype_is_part_of_its_scores_key(tmp_path: Path, models: dict[str, str], scorer: Path) -> None:
    """Scores taken in float32 are not read back by a run that scores in bfloat16 (issue 48's mutation audit: the
    dtype missing from the key went uncaught): the key's scorer part differs, and so does the key."""
    from toolkit.evals.scoring import score_key

    fp32 = _recipe(tmp_path, models["text"], scorer)
    bf16 = fp32.model_copy(update={"model": fp32.model.model_copy(update={"dtype": "bfloat16"})})
    a, b = weights_identity(scorer, fp32), weights_identity(scorer, bf16)
    assert a["scorer"]["dtype"] == "float32" and b["scorer"]["dtype"] == "bfloat16"
    assert score_key(rows="r", scorer=a, render="given") != score_key(rows="r", scorer=b, render="given")


def test_a_scorer_runs_its_own_code_only_with_its_own_consent(tmp_path: Path, models: dict[str, str],
                                                               scorer: Path) -> None:
    """model.trust_remote_code covers the policy only: a scorer whose config needs its own code (auto_map) is refused
    in one line naming it, its code not run, until its stage's difficulty.trust_remote_code allows it. A scorer whose
    pickled .bin weights do not load weights-only is refused in one line too, before the policy loads."""
    ran = tmp_path / "scorer-code-ran"
    custom = tmp_path / "custom"
    shutil.copytree(scorer, custom)
    config = json.loads((custom / "config.json").read_text())
    config |= {"model_type": "toolkit_consent_test", "auto_map": {"AutoConfig": "configuration_consent.ConsentConfig"}}
    (custom / "config.json").write_text(json.dumps(config))
    (custom / "configuration_consent.py").write_text(
        f"import pathlib\nfrom transformers import Qwen3Config\npathlib.Path({str(ran)!r}).write_text('ran')\n\n\n"
        "class ConsentConfig(Qwen3Config):\n    model_type = 'toolkit_consent_test'\n")
    recipe = _recipe(tmp_path, models["text"], custom)
    recipe = recipe.model_copy(update={"model": recipe.model.model_copy(update={"trust_remote_code": True})})
    _, tokenizer = load_processing(models["text"], vision=False, trust_remote_code=False, chat_template=None)
    with pytest.raises(ToolkitError, match=r"stage 'scored': difficulty.model '.*custom' needs its own Python code "
                                           r".*set difficulty.trust_remote_code: true on stage 'scored'") as err:
        check_scorers(recipe, resolve_stages(recipe), tokenizer, vision=False)
    assert "\n" not in str(err.value) and not ran.exists()
    tree = yaml.safe_load((tmp_path / "recipe.yaml").read_text())
    tree["stages"][0]["difficulty"]["trust_remote_code"] = True
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(tree))
    consented = load_recipe(tmp_path / "recipe.yaml")
    check_scorers(consented, resolve_stages(consented), tokenizer, vision=False)
    assert ran.read_text() == "ran"

    pickled = tmp_path / "pickled"
    shutil.copytree(scorer, pickled)
    (pickled / "model.safetensors").unlink()
    torch.save({"lm_head.weight": _Shell(f"touch {tmp_path / 'pwned'}")}, pickled / "pytorch_model.bin")
    bad = _recipe(tmp_path, models["text"], pickled)
    with pytest.raises(ToolkitError, match=r"its weights file pytorch_model.bin is a pickle that does not load as "
                                           r"plain tensors") as err:
        check_scorers(bad, resolve_stages(bad), tokenizer, vision=False)
    assert "weights_only=False" not in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "pwned").exists()


class _Shell:
    """Unpickling this runs a shell command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        import os

        return (os.system, (self.command,))
