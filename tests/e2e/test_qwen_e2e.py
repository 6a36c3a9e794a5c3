"""End to end with the real Qwen tokenizer and Qwen3's stock template: multi-turn rows (with think blocks, tool
calls and tool results) through the 3-stage curriculum give the same losses under ZeRO-3 x2 and FSDP2 x2 as in one
process; and `--create_dummy_data` works with a local Qwen3 checkpoint.

Every run (forked from the session's relauncher, conftest.relaunch: accelerate's launch environment without a
launch's imports) uses --mixed_precision no: this is an fp32 equality test (bf16 rounding differs between sharded and
unsharded reductions). The model is the session's tiny Qwen3 with the real 151,936-row vocabulary and hidden size
16, so the large LM head stays cheap.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, relaunch, train_forked
from toolkit.metrics.log import read_metrics

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def chat_rows(n: int, seed: int) -> list[dict]:
    """Multi-turn rows of every shape: plain, with a system prompt, reasoning (field and inline), tool calls."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b, c = rng.randint(1, 99), rng.randint(1, 99), rng.randint(1, 9)
        kind = i % 4
        row: dict = {"difficulty": float(a + b)}
        if kind == 3:
            row["tools"] = TOOLS
            row["messages"] = [
                {"role": "user", "content": f"Add {a} and {b} with the tool."},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}]},
                {"role": "tool", "content": str(a + b)},
                {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]
        else:
            first = {"role": "assistant", "content": f"{a} + {b} = {a + b}."}
            last = {"role": "assistant", "content": f"{a + b} + {c} = {a + b + c}."}
            if kind == 1:
                last["reasoning_content"] = f"Add {c} to {a + b}."
            elif kind == 2:
                first["content"] = f"<think>\nAdd.\n</think>\n\n{first['content']}"
            row["messages"] = [{"role": "user", "content": f"What is {a} + {b}?"}, first,
                               {"role": "user", "content": f"Now add {c}."}, last]
            if kind == 1:
                row["messages"].insert(0, {"role": "system", "content": "Be brief."})
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, qwen3_dir: Path) -> tuple[Path, Path]:
    """A copy of recipes/smoke_curriculum.yaml on the real-tokenizer Qwen3 and multi-turn files."""
    root = tmp_path_factory.mktemp("qwen-e2e")
    files = []
    for name, seed in (("chat_a", 1), ("chat_b", 2)):
        files.append(root / f"{name}.jsonl")
        files[-1].write_text("".join(json.dumps(r) + "\n" for r in chat_rows(24, seed)))
    recipe = yaml.safe_load((REPO / "recipes" / "smoke_curriculum.yaml").read_text())
    recipe["model"]["name_or_path"] = str(qwen3_dir)
    recipe["data"]["max_seq_len"] = 320  # the tool rows carry Qwen3's tools prompt
    recipe["stages"][0]["data"] = [{"path": str(files[0]), "weight": 3}, {"path": str(files[1]), "weight": 1}]
    recipe["stages"][1]["data"] = [str(files[1])]
    recipe["stages"][2]["data"] = [str(files[0])]
    recipe["stages"][2]["max_seq_len"] = 320
    for stage in recipe["stages"]:
        stage["max_steps"] = 2  # a few steps per stage: the 151,936-row LM head dominates each step on CPU
    recipe["train"].update(micro_batch_size=1, grad_accum=2)  # global batch 4 on 2 processes
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return root, path


def run(strategy: str, procs: int, out: Path, recipe: Path, *overrides: str) -> list[dict]:
    log = out.with_name(f"{out.name}.log")
    (code,) = relaunch(strategy, [(["--config", str(recipe), f"output_dir={out}", *overrides], log)],
                       num_processes=procs)
    if code != 0:
        pytest.fail(f"{strategy} x{procs} failed (rc={code}):\n{log.read_text()[-6000:]}")
    return [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


@pytest.fixture(scope="module")
def reference(setup: tuple[Path, Path]) -> list[dict]:
    root, recipe = setup
    return run("single", 1, root / "single", recipe, "train.micro_batch_size=2", "stages.2.micro_batch_size=2")


def test_reference_trains_every_stage(reference: list[dict]) -> None:
    assert [r["stage"] for r in reference] == ["mixture"] * 2 + ["easy_to_hard"] * 2 + ["short_to_long"] * 2
    assert all(math.isfinite(r["loss"]) for r in reference)
    assert reference[0]["loss"] == pytest.approx(math.log(151936), rel=0.05)  # random init over the real vocab


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_multi_turn_real_tokenizer_matches_single_process(strategy: str, setup: tuple[Path, Path],
                                                          reference: list[dict]) -> None:
    root, recipe = setup
    records = run(strategy, 2, root / strategy, recipe)
    assert [r["stage"] for r in records] == [r["stage"] for r in reference]
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in reference], rel=1e-4)


def test_create_dummy_data_with_a_qwen3_checkpoint(tmp_path: Path, qwen3_dir: Path) -> None:
    """The dummy rows (multi-turn and system-prompted among them) train with Qwen3's stock template."""
    out = tmp_path / "dummy"
    train_forked("single", 1, out, f"model.name_or_path={qwen3_dir}", "stages.0.max_steps=1", "stages.1.max_steps=2",
                 dummy_samples=32)
    records = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["stage"] for r in records] == ["short", "long", "long"]
    rows = [json.loads(line) for line in (out / "dummy_data" / "stage2.jsonl").read_text().splitlines()]
    assert any(sum(m["role"] == "assistant" for m in r["messages"]) > 1 for r in rows)
    assert (out / "final" / "tokenizer_config.json").is_file()
