"""Bad input: one clear `error:` line, exit code 2, no traceback, and nothing written or changed.

The cases are the rows of docs/bad_inputs.md: the test reads the table, runs each row's case and checks that the
error line holds the row's text. A row without a case, or a case without a row, fails `test_table_and_cases_agree`.

Most cases call the entry points' `main(argv)` in this process: the same code a user's command runs, with the
same exit code and stderr, but without paying the 10-20 s import of torch and transformers 60 times over. The
cases marked `subprocess` (and the tests below the table) launch real processes, as a user does.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import yaml

import train_curriculum
from tests.conftest import CHAT, REPO, base_recipe, launch_cmd, run_env, run_launch, write_jsonl
from tests.helpers.inprocess import Call, invoke, process_state_kept, snapshot
from toolkit.builtin.models import TINY_MODEL
from toolkit.runtime.run_dir import RunLayout, RunLock

TABLE = REPO / "docs" / "bad_inputs.md"


def documented() -> dict[str, str]:
    """id -> the text the error line must hold, from the table's rows."""
    rows = {}
    for line in TABLE.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^\| `([a-z0-9-]+)` \|.*\| `([^`]+)` \|$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


# Shared inputs (conftest): `models` (tiny text and VL models, built once) and `trained` (a finished 3-step run).


# --- the cases -------------------------------------------------------------------------------------------------

@dataclass
class Ctx:
    tmp: Path
    models: dict[str, str]
    trained: Path | None = None
    keep: list[object] = field(default_factory=list)  # objects a case holds until it ends (a live run's lock)
    cleanups: list[Callable[[], object]] = field(default_factory=list)  # run when the case ends (unmounts)

    def recipe(self, change: Callable[[dict[str, Any]], object] | None = None, rows: list[object] | None = None,
               text: str | None = None) -> Path:
        """recipe.yaml (one stage on data.jsonl, output_dir run/) with `change` applied, or given as `text`."""
        write_jsonl(self.tmp / "data.jsonl", rows if rows is not None else [CHAT] * 8)
        tree = base_recipe(self.models["text"])
        if change is not None:
            change(tree)
        path = self.tmp / "recipe.yaml"
        path.write_text(text if text is not None else yaml.safe_dump(tree))
        return path

    def train(self, *overrides: str, change: Callable[[dict[str, Any]], object] | None = None,
              rows: list[object] | None = None) -> Call:
        return Call(["--config", str(self.recipe(change, rows)), *overrides], self.tmp / "run")

    def copy_of_trained(self) -> Path:
        """A copy of the trained run's folder as the case's folder; returns its run/."""
        assert self.trained is not None
        shutil.copytree(self.trained, self.tmp, dirs_exist_ok=True)
        return self.tmp / "run"

    def resume(self, *overrides: str) -> Call:
        run = self.copy_of_trained()
        return Call(["--config", "recipe.yaml", *overrides], run)


CASES: dict[str, Callable[[Ctx], Call]] = {}
NEEDS_TRAINED_RUN: set[str] = set()


def case(name: str, *, trained: bool = False) -> Callable[[Callable[[Ctx], Call]], Callable[[Ctx], Call]]:
    def register(fn: Callable[[Ctx], Call]) -> Callable[[Ctx], Call]:
        CASES[name] = fn
        if trained:
            NEEDS_TRAINED_RUN.add(name)
        return fn

    return register


def stage(key: str, value: object) -> Callable[[dict[str, Any]], None]:
    return lambda t: t["stages"][0].__setitem__(key, value)


def section(name: str, **values: object) -> Callable[[dict[str, Any]], None]:
    return lambda t: t.setdefault(name, {}).update(values)


case("unknown-key")(lambda c: c.train(change=lambda t: t.__setitem__("optimiser", {"lr": 1})))
case("unknown-key-override")(lambda c: c.train("stages.0.learning_rate=1e-4"))
case("wrong-type")(lambda c: c.train("train.micro_batch_size=big"))
case("infinite-float")(lambda c: c.train("optimizer.lr=.inf"))
case("nan-float")(lambda c: c.train(change=stage("lr", float("nan"))))
case("broken-override")(lambda c: c.train("train.seed=[1,"))
case("override-without-value")(lambda c: c.train("optimizer.lr"))
case("override-index-out-of-range")(lambda c: c.train("stages.5.lr=1e-4"))
case("dummy-samples-zero")(lambda c: c.train("--create_dummy_data", "--num_dummy_samples", "0"))
case("epochs-and-max-steps")(lambda c: c.train(change=stage("epochs", 1)))
case("zero-mixture-weight")(lambda c: c.train(change=stage("data", [{"path": "data.jsonl", "weight": 0}])))
case("partial-mixture-weights")(lambda c: c.train(change=stage("data", [{"path": "data.jsonl", "weight": 1},
                                                                        "data.jsonl"])))
case("pacing-without-easy-to-hard")(lambda c: c.train(change=stage("pacing", {"kind": "linear"})))
case("preference-stage-model-scores")(lambda c: c.train(
    "stages.0.objective=dpo", "stages.0.order=easy_to_hard", "stages.0.difficulty={by: loss, model: current}"))
case("preference-on-sft-stage")(lambda c: c.train(change=stage("preference", {"beta": 0.2})))
case("preference-base-without-lora")(lambda c: c.train(
    "lora.enabled=false", "stages.0.objective=dpo", "stages.0.preference={reference: base}"))
case("preference-smoothing-without-robust")(lambda c: c.train(
    "stages.0.objective=dpo", "stages.0.preference={label_smoothing: 0.1}"))
case("preference-loss-weights-count")(lambda c: c.train(
    "stages.0.objective=dpo", "stages.0.preference={loss: [sigmoid, sft], loss_weights: [1]}"))
case("difficulty-field-without-name")(lambda c: c.train(change=lambda t: t["stages"][0].update(
    order="easy_to_hard", difficulty={"by": "field"})))
case("difficulty-without-order")(lambda c: c.train(change=stage("difficulty", {"by": "length"})))
case("difficulty-model-missing")(lambda c: c.train(change=lambda t: t["stages"][0].update(
    order="easy_to_hard", difficulty={"by": "loss"})))
case("difficulty-scorer-path")(lambda c: c.train(change=lambda t: t["stages"][0].update(
    order="easy_to_hard", difficulty={"by": "loss", "model": "./small-model"})))
case("difficulty-scorer-misspelt")(lambda c: c.train(change=lambda t: t["stages"][0].update(
    order="easy_to_hard", difficulty={"by": "loss", "model": "Base"})))
case("difficulty-scorer-offline")(lambda c: replace(c.train(change=lambda t: t["stages"][0].update(
    order="easy_to_hard", difficulty={"by": "loss", "model": "curriculum-toolkit-tests/no-such-scorer"})),
    env={"HF_HUB_OFFLINE": "1"}))


def scorer_copy(c: Ctx) -> Path:
    """A copy of the tiny text model, as a separate scorer to spoil."""
    scorer = c.tmp / "scorer"
    shutil.copytree(c.models["text"], scorer)
    return scorer


@case("difficulty-scorer-tokenizer")
def _(c: Ctx) -> Call:
    from transformers import AutoTokenizer

    scorer = scorer_copy(c)
    tokenizer = AutoTokenizer.from_pretrained(scorer)
    tokenizer.add_tokens(["<|extra|>"])
    tokenizer.save_pretrained(scorer)
    return c.train(change=lambda t: t["stages"][0].update(order="easy_to_hard",
                                                           difficulty={"by": "loss", "model": str(scorer)}))


@case("difficulty-scorer-config")
def _(c: Ctx) -> Call:
    scorer = scorer_copy(c)
    (scorer / "config.json").write_text("{")
    return c.train(change=lambda t: t["stages"][0].update(order="easy_to_hard",
                                                           difficulty={"by": "loss", "model": str(scorer)}))


case("drop-everything")(lambda c: c.train(change=lambda t: t["stages"][0].update(
    order="easy_to_hard", drop={"easiest": 0.5, "hardest": 0.5})))
case("difficulty-field-missing")(lambda c: c.train(change=lambda t: t["stages"][0].update(
    order="easy_to_hard", difficulty={"by": "field", "field": "difficulty"})))
case("difficulty-named-field-missing")(lambda c: c.train(change=lambda t: t["stages"][0].update(
    order="easy_to_hard", difficulty={"by": "field", "field": "score"})))
case("continue-first-stage")(lambda c: c.train(change=stage("schedule", "continue")))
case("duplicate-stage-names")(lambda c: c.train(change=lambda t: t["stages"].append(dict(t["stages"][0]))))
case("stage-names-one-path")(lambda c: c.train(change=lambda t: t["stages"].extend(
    dict(t["stages"][0], name=n) for n in ("only?", "only!"))))
case("lora-trainable-without-lora")(lambda c: c.train("lora.enabled=false", "stages.0.trainable=[lora]"))
case("patience-without-eval")(lambda c: c.train(change=stage("patience", 2)))
GENERATION = {"name": "facts", "data": ["eval.jsonl"], "scorers": ["exact"]}


def gated(metric: str, *, generation: bool = True) -> Callable[[dict[str, Any]], None]:
    def change(tree: dict[str, Any]) -> None:
        tree.setdefault("eval", {})["every_steps"] = 1
        if generation:
            tree["stages"][0]["generation"] = [GENERATION]
        tree["stages"][0]["advance_when"] = {"metric": metric, "at_least": 0.9}
    return change


def with_scorer(c: Ctx, scorer: str, module: str | None = None, rows: list[object] | None = None) -> Call:
    """A run whose stage has a generation eval on eval.jsonl with `scorer`; `module` is the text of the scorer's
    module, in the recipe's folder (each case names its own module: this process imports each name once)."""
    write_jsonl(c.tmp / "eval.jsonl", rows or [{"messages": [CHAT["messages"][0]], "reference": "4."}])
    if module is not None:
        (c.tmp / f"{scorer.partition(':')[0]}.py").write_text(module)
    return c.train(change=stage("generation", [dict(GENERATION, scorers=[scorer])]))


case("gate-unknown-metric")(lambda c: c.train(change=gated("facts.exakt")))
case("gate-without-eval")(lambda c: c.train(change=gated("facts.exact", generation=False)))
case("scorer-unknown")(lambda c: with_scorer(c, "exakt"))
case("scorer-import-fails")(lambda c: with_scorer(c, "my_scorers:cad_parses", "import cadquery_missing\n"))
case("scorer-missing-function")(lambda c: with_scorer(c, "cad_scorers:cad_parses", "def other(o, r, row):\n    "
                                                                                       "return 1\n"))
case("generation-row-without-reference")(lambda c: with_scorer(c, "exact", rows=[{"messages": [CHAT["messages"][0]]}]))
case("lr-scaling-without-reference")(lambda c: c.train(change=section("optimizer", lr_scaling="linear")))
case("min-pixels-over-max")(lambda c: c.train(change=section("data", min_pixels=4096, max_pixels=1024)))
case("bad-exclude-regex")(lambda c: c.train(change=section("lora", exclude_modules="(visual")))
case("zero-consecutive-skips")(lambda c: c.train("stability.max_consecutive_skips=0"))
case("data-missing")(lambda c: c.train(change=stage("data", ["nope.jsonl"])))
case("data-is-directory")(lambda c: (c.tmp / "empty").mkdir() or c.train(change=stage("data", ["empty"])))
case("data-malformed-line")(lambda c: c.train(rows=[CHAT, CHAT, '{"messages": [oops', CHAT]))
case("data-nested-too-deeply")(lambda c: c.train(rows=[CHAT, '{"messages": ' + "[" * 200_000 + "]" * 200_000 + "}"]))
case("data-row-over-byte-cap")(lambda c: c.train("data.overlength=error",
                                                  rows=[CHAT, '{"text": "' + "w " * (7 << 20) + '"}']))
case("data-row-not-object")(lambda c: c.train(rows=[CHAT, "[1, 2]"]))
case("data-bad-message")(lambda c: c.train(rows=[{"messages": [{"content": "no role"}]}]))
TOOL_CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]}
CHATML = section("data", chat_template="chatml")


def latin1_data(c: Ctx) -> Path:
    """data.jsonl whose line 2 holds 'café' in Latin-1: byte 0xe9 at offset len(line 1) + 13."""
    c.recipe()
    first = (json.dumps(CHAT) + "\n").encode()
    (c.tmp / "data.jsonl").write_bytes(first + b'{"text": "caf\xe9"}\n')
    assert len(first) + 13 == 115
    return c.tmp / "recipe.yaml"


case("data-not-utf8")(lambda c: Call(["--config", str(latin1_data(c))], c.tmp / "run"))
case("data-tools-with-chatml")(lambda c: c.train(change=CHATML, rows=[CHAT, dict(CHAT, tools=[{"type": "function"}])]))
case("data-reasoning-with-chatml")(lambda c: c.train(change=CHATML, rows=[{"messages": [
    CHAT["messages"][0], dict(CHAT["messages"][1], reasoning_content="Add.")]}]))
case("data-tool-calls-with-chatml")(lambda c: c.train(change=CHATML, rows=[{"messages": [
    CHAT["messages"][0], TOOL_CALL, {"role": "tool", "content": "4"}, CHAT["messages"][1]]}]))
case("data-tool-turn-with-chatml")(lambda c: c.train(change=CHATML, rows=[{"messages": [
    CHAT["messages"][0], CHAT["messages"][1], {"role": "tool", "content": "4"}, CHAT["messages"][1]]}]))
case("data-assistant-first")(lambda c: c.train(rows=[{"messages": [CHAT["messages"][1], *CHAT["messages"]]}]))
case("data-trailing-user")(lambda c: c.train(rows=[{"messages": [*CHAT["messages"], CHAT["messages"][0]]}]))
case("data-thinking-unknown")(lambda c: c.train("data.thinking=maybe"))
case("data-thinking-marked-template")(lambda c: c.train("data.thinking=none", change=CHATML))
case("data-no-usable-rows")(lambda c: c.train(rows=[{"text": "word " * 200}] * 4))
case("data-non-numeric-difficulty")(lambda c: c.train(
    "stages.0.order=easy_to_hard", rows=[dict(CHAT, difficulty=1), dict(CHAT, difficulty="hard")] * 3))
USER, ANSWER = CHAT["messages"]
case("data-mixed-shapes")(lambda c: c.train(rows=[CHAT, dict(CHAT, text="Also this.")]))
case("data-turn-weight-fraction")(lambda c: c.train(rows=[{"messages": [USER, dict(ANSWER, weight=0.5)]}]))
case("data-weight-on-user-turn")(lambda c: c.train(rows=[{"messages": [dict(USER, weight=1), ANSWER]}]))
case("data-weight-with-train-on-all")(lambda c: c.train("data.train_on=all", rows=[
    {"messages": [USER, dict(ANSWER, weight=0)]}]))
case("data-train-detail")(lambda c: c.train(rows=[{"messages": [USER, dict(ANSWER, train_detail=[
    {"begin_offset": 0, "end_offset": 1, "train": False}])]}]))
case("data-row-weight")(lambda c: c.train(rows=[dict(CHAT, weight=2)]))
case("data-preference-pair")(lambda c: c.train(rows=[{"prompt": "2 + 2?", "chosen": "4.", "rejected": "5."}]))
PAIR = {"prompt": "2 + 2?", "chosen": "4.", "rejected": "5."}


def inspect_pairs(c: Ctx, rows: list[object]) -> Call:
    """`toolkit inspect-data` on a file whose first row is a pair: it is read as a preference stage's."""
    return Call(["inspect-data", str(write_jsonl(c.tmp / "pairs.jsonl", rows))], c.tmp / "run", tool="toolkit")


case("data-not-a-pair")(lambda c: c.train("stages.0.objective=dpo", rows=[PAIR, CHAT]))
case("data-not-a-pair-inspected")(lambda c: inspect_pairs(c, [PAIR, CHAT]))
case("data-pair-with-images")(lambda c: c.train("stages.0.objective=dpo", rows=[dict(PAIR, images=["images/a.png"])]))
VISION_PAIR = {"images": ["images/a.png"], "prompt": [{"role": "user", "content": "<image>What colour is it?"}],
               "chosen": [{"role": "assistant", "content": "Red."}], "rejected": [{"role": "assistant",
                                                                                "content": "Blue."}]}
case("data-vision-pair-video-count")(lambda c: c.train(
    "stages.0.objective=dpo", f"model.name_or_path={c.models['vl']}", rows=[dict(VISION_PAIR, videos=["clip.mp4"])]))
case("data-vision-pair-video-in-answer")(lambda c: c.train(
    "stages.0.objective=dpo", f"model.name_or_path={c.models['vl']}",
    rows=[dict(VISION_PAIR, videos=["clip.mp4"], chosen=[{"role": "assistant", "content": "<video>Red."}])]))
case("data-vision-pair-image-in-answer")(lambda c: c.train(
    "stages.0.objective=dpo", f"model.name_or_path={c.models['vl']}",
    rows=[dict(VISION_PAIR, rejected=[{"role": "assistant", "content": "<image>Blue."}])]))
case("data-vision-pair-rejected-media")(lambda c: c.train(
    "stages.0.objective=dpo", f"model.name_or_path={c.models['vl']}",
    rows=[{"messages": [*VISION_PAIR["prompt"], *VISION_PAIR["chosen"]], "images": ["images/a.png"],
           "rejected_response": "Blue.", "rejected_images": ["images/b.png"]}]))
case("data-kto-label")(lambda c: c.train(rows=[{"prompt": "2 + 2?", "completion": "5.", "label": False}]))
case("data-kto-no-label")(lambda c: c.train("stages.0.objective=kto", rows=[
    {"prompt": "2 + 2?", "completion": " 4.", "label": True}, {"prompt": "2 + 2?", "completion": " 5."}]))
case("data-kto-label-not-boolean")(lambda c: c.train("stages.0.objective=kto", rows=[
    {"prompt": "2 + 2?", "completion": " 4.", "label": "good"}]))
GRPO = ("stages.0.objective=grpo", "stages.0.rewards=[{scorer: contains}]")
RL = "stages.0.rl={num_generations: 2, max_completion_length: 16}"
PROMPT = {"prompt": [{"role": "user", "content": "2 + 2?"}], "reference": "4"}
case("rl-keys-on-sft-stage")(lambda c: c.train("stages.0.rl={beta: 0.1}"))
case("rl-num-generations-global-batch")(lambda c: c.train(
    *GRPO, "stages.0.rl={num_generations: 8, max_completion_length: 16}", rows=[PROMPT] * 8))
case("rl-reward-module-missing")(lambda c: c.train(
    "stages.0.objective=grpo", "stages.0.rewards=[{scorer: 'no_such_rewards:accuracy'}]", RL, rows=[PROMPT] * 8))
case("rl-vision-language-model")(lambda c: c.train(f"model.name_or_path={c.models['vl']}", *GRPO, RL,
                                                   rows=[PROMPT] * 8))
case("rl-beta-without-lora")(lambda c: c.train(
    *GRPO, "lora.enabled=false", "stages.0.rl={num_generations: 2, max_completion_length: 16, beta: 0.04}",
    rows=[PROMPT] * 8))
PASS_RATE = ("stages.0.order=easy_to_hard", "stages.0.difficulty={by: pass_rate, model: current}")
case("difficulty-pass-rate-not-grpo")(lambda c: c.train(*PASS_RATE))
case("difficulty-row-measure-on-grpo")(lambda c: c.train(
    *GRPO, RL, "stages.0.order=easy_to_hard", "stages.0.difficulty={by: loss, model: current}", rows=[PROMPT] * 8))
case("drop-on-grpo-without-pass-rate")(lambda c: c.train(*GRPO, RL, "stages.0.drop={easiest: 0.25}",
                                                         rows=[PROMPT] * 8))
case("difficulty-pass-rate-base-without-lora")(lambda c: c.train(
    *GRPO, RL, "lora.enabled=false", "stages.0.order=easy_to_hard", "stages.0.difficulty={by: pass_rate, model: base}",
    rows=[PROMPT] * 8))
case("data-prompt-without-reference")(lambda c: c.train(*GRPO, RL, rows=[{"prompt": "2 + 2 =", "answer": "4"}] * 8))
case("data-rl-row-without-prompt")(lambda c: c.train(*GRPO, RL, rows=[{"question": "2 + 2?", "answer": "4"}] * 8))
case("data-pretokenised")(lambda c: c.train(rows=[{"text": "2 + 2 = 4.", "labels": [1, 2, 3]}]))
case("data-row-system")(lambda c: c.train(rows=[dict(CHAT, system="Be brief.")]))
case("data-tools-outside-chat")(lambda c: c.train(rows=[{"text": "2 + 2 = 4.", "tools": [{"type": "function"}]}]))
case("data-images-text-model")(lambda c: c.train(rows=[dict(CHAT, images=["images/a.png"])]))
case("unknown-builtin")(lambda c: c.train("model.name_or_path=builtin:tiny-llama"))
case("model-dir-missing")(lambda c: c.train("model.name_or_path=./models/nope"))
case("flash-attn-missing")(lambda c: c.train("model.attn_implementation=flash_attention_2"))
case("flash4-missing")(lambda c: c.train("model.attn_implementation=flash4"))
case("fused-layers-without-gpu")(lambda c: c.train("model.fused_layers=liger"))


def not_installed(c: Ctx, *modules: str) -> None:
    """`modules` cannot be imported for the case, as Python marks one (sys.modules[name] = None), installed or not."""
    saved = {m: sys.modules.get(m, False) for m in modules}
    for m in modules:
        sys.modules[m] = None  # type: ignore[assignment]

    def restore() -> None:
        for m, v in saved.items():
            if v is False:
                sys.modules.pop(m, None)
            else:
                sys.modules[m] = v

    c.cleanups.append(restore)


def _tracker_not_installed(c: Ctx) -> Call:
    not_installed(c, "trackio")
    return c.train("logging.trackers=[trackio]")


def _train_without_deepspeed(c: Ctx) -> Call:
    not_installed(c, "deepspeed")
    return Call(["train", "--accelerate-config", "zero3", "--dry-run"], c.tmp / "run", tool="toolkit")


case("tracker-not-installed")(_tracker_not_installed)
case("train-unknown-accelerate-config")(
    lambda c: Call(["train", "--accelerate-config", "zero4", "--dry-run"], c.tmp / "run", tool="toolkit"))
case("train-deepspeed-not-installed")(_train_without_deepspeed)
case("export-without-out")(lambda c: Call(["export", str(c.tmp / "run")], c.tmp / "run", tool="toolkit"))
case("export-private-without-push")(
    lambda c: Call(["export", str(c.tmp / "run"), "--out", str(c.tmp / "x"), "--private"], c.tmp / "x", tool="toolkit"))
case("trainable-matches-nothing")(lambda c: c.train("stages.0.trainable=[lora, model.nrom]"))
IDENTICAL_PAIR = {"prompt": [CHAT["messages"][0]], "chosen": [CHAT["messages"][1]], "rejected": [CHAT["messages"][1]]}
case("data-identical-pairs")(lambda c: c.train("stages.0.objective=dpo", rows=[IDENTICAL_PAIR] * 8))


@case("train-accelerate-config-word-is-no-path")
def _(c: Ctx) -> Call:
    (c.tmp / "mine").write_text("distributed_type: NO\n")  # a file here is named as a path: ./mine
    return Call(["train", "--accelerate-config", "mine", "--dry-run"], c.tmp / "mine", tool="toolkit")


@case("empty-output-dir")
def _(c: Ctx) -> Call:
    return Call(["--config", str(c.recipe(lambda t: t.__setitem__("output_dir", "")))], c.tmp / "metrics.jsonl")


@case("root-output-dir")
def _(c: Ctx) -> Call:
    # train.micro_batch_size=big too: every recipe error is on the one line, and a toolkit without the check stops
    # on that one instead of training into / (the first run of this case without the check did)
    return Call(["--config", str(c.recipe(lambda t: t.__setitem__("output_dir", "/tmp/../.."))),
                 "train.micro_batch_size=big"], c.tmp / "run")


case("run-name-path")(lambda c: c.train("run_name=../../elsewhere"))  # TensorBoard wrote outside output_dir


@case("duplicate-key")
def _(c: Ctx) -> Call:
    text = "output_dir: run\nstages:\n  - name: only\n    data: [data.jsonl]\n    lr: 1.0e-4\n    lr: 2.0e-4\n"
    return Call(["--config", str(c.recipe(text=text))], c.tmp / "run")


@case("config-is-directory")
def _(c: Ctx) -> Call:
    return Call(["--config", str(c.tmp)], c.tmp / "outputs")


@case("config-missing")
def _(c: Ctx) -> Call:
    return Call(["--config", str(c.tmp / "nope.yaml")], c.tmp / "outputs")


@case("config-broken-yaml")
def _(c: Ctx) -> Call:
    return Call(["--config", str(c.recipe(text="output_dir: run\nstages: [\n"))], c.tmp / "run")


@case("config-not-a-mapping")
def _(c: Ctx) -> Call:
    return Call(["--config", str(c.recipe(text="- output_dir\n- run\n"))], c.tmp / "run")


@case("config-not-utf8")
def _(c: Ctx) -> Call:
    path = c.tmp / "recipe.yaml"
    path.write_bytes("output_dir: café\n".encode("latin-1"))
    return Call(["--config", str(path)], c.tmp / "café")


@case("output-dir-is-file")
def _(c: Ctx) -> Call:
    (c.tmp / "notes.txt").write_text("the user's notes")
    return replace(c.train("output_dir=notes.txt"), watch=c.tmp / "notes.txt")


@case("output-dir-inside-file")
def _(c: Ctx) -> Call:
    (c.tmp / "notes.txt").write_text("the user's notes")
    return replace(c.train("output_dir=notes.txt/run"), watch=c.tmp / "notes.txt")


@case("output-dir-in-use")
def _(c: Ctx) -> Call:
    call = c.train()
    lock = RunLock(RunLayout(c.tmp / "run"))  # a live run's lock (flock: per open file)
    assert lock.acquire() is None
    c.keep.append(lock)  # held until the case ends
    return call


@case("output-dir-in-use-via-symlink")
def _(c: Ctx) -> Call:
    real = c.tmp / "runs" / "exp"
    real.mkdir(parents=True)
    (c.tmp / "exp").symlink_to(real)  # beside another folder than the real one: another .toolkit-cache
    lock = RunLock(RunLayout(real))  # the live run, launched with the real path
    assert lock.acquire() is None
    c.keep.append(lock)
    return replace(c.train("output_dir=exp"), watch=real)


@case("earlier-run-without-checkpoint", trained=True)
def _(c: Ctx) -> Call:
    run = c.copy_of_trained()
    shutil.rmtree(run / "checkpoints")
    return Call(["--config", "recipe.yaml"], run)


def interrupted_run(c: Ctx) -> Path:
    """The trained run as an attempt killed before its first checkpoint leaves it: no checkpoint, no final/."""
    run = c.copy_of_trained()
    shutil.rmtree(run / "checkpoints")
    shutil.rmtree(run / "final")
    return run


case("earlier-run-of-another-recipe", trained=True)(
    lambda c: Call(["--config", "recipe.yaml", "optimizer.lr=1e-3"], interrupted_run(c)))


@case("earlier-run-without-recipe", trained=True)
def _(c: Ctx) -> Call:
    run = interrupted_run(c)
    (run / "recipe.yaml").unlink()
    return Call(["--config", "recipe.yaml"], run)


case("resume-none-over-checkpoints", trained=True)(lambda c: c.resume("checkpoint.resume=none"))
case("resume-path-missing", trained=True)(lambda c: c.resume("checkpoint.resume=run/checkpoints/step-00000009"))
case("resume-changed-recipe", trained=True)(lambda c: c.resume("optimizer.lr=1e-3"))
case("resume-other-batch", trained=True)(lambda c: c.resume("train.grad_accum=4"))


case("resume-forced-stage-length", trained=True)(
    lambda c: c.resume("checkpoint.resume_force=true", "stages.0.max_steps=4"))
case("resume-forced-lora-rank", trained=True)(lambda c: c.resume("checkpoint.resume_force=true", "lora.r=8"))


@case("resume-uncommitted", trained=True)
def _(c: Ctx) -> Call:
    call = c.resume("checkpoint.resume=run/checkpoints/step-00000002")
    (c.tmp / "run/checkpoints/step-00000002/COMMITTED").unlink()
    return call


@case("resume-changed-data", trained=True)
def _(c: Ctx) -> Call:
    call = c.resume()
    with (c.tmp / "data.jsonl").open("a") as f:
        f.write(json.dumps(CHAT) + "\n")
    return call


@case("resume-swapped-weights", trained=True)
def _(c: Ctx) -> Call:
    call = c.resume()
    ckpts = c.tmp / "run/checkpoints"
    shutil.copy(ckpts / "step-00000002/model.safetensors", ckpts / "step-00000003/model.safetensors")
    return call


@case("resume-missing-optimizer", trained=True)
def _(c: Ctx) -> Call:
    call = c.resume()
    (c.tmp / "run/checkpoints/step-00000003/optimizer.bin").unlink()
    return call


@case("resume-damaged-meta", trained=True)
def _(c: Ctx) -> Call:
    call = c.resume()
    (c.tmp / "run/checkpoints/step-00000003/meta.json").write_text("{\"step\": 3, ")
    return call


@case("tokenizer-without-template")
def _(c: Ctx) -> Call:
    model = c.tmp / "model"
    shutil.copytree(c.models["text"], model)
    (model / "chat_template.jinja").unlink()
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    return c.train(f"model.name_or_path={model}")


@case("image-missing")
def _(c: Ctx) -> Call:
    row = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]},
                        {"role": "assistant", "content": "Red."}], "images": ["images/nope.png"]}
    return c.train(f"model.name_or_path={c.models['vl']}", rows=[CHAT, CHAT, row, CHAT])


@case("image-not-regular-file")
def _(c: Ctx) -> Call:
    import os

    (c.tmp / "images").mkdir()
    os.mkfifo(c.tmp / "images" / "pipe.png")  # it used to be said "not to exist"
    row = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]},
                        {"role": "assistant", "content": "Red."}], "images": ["images/pipe.png"]}
    return c.train(f"model.name_or_path={c.models['vl']}", rows=[CHAT, CHAT, row, CHAT])


def _video_row(*videos: str, tags: int = 1) -> dict[str, Any]:
    """A LLaMA-Factory video row: `tags` <video> tags, `videos` its files."""
    return {"messages": [{"role": "user", "content": "<video>" * tags + "What happens?"},
                         {"role": "assistant", "content": "It gets brighter."}], "videos": list(videos)}


def _video_case(c: Ctx, row: dict[str, Any], *overrides: str) -> Call:
    from tests.helpers.video_files import write_video

    write_video(c.tmp / "clip.mp4", 12)
    return c.train(f"model.name_or_path={c.models['vl']}", *overrides, rows=[CHAT, CHAT, row, CHAT])


case("video-missing")(lambda c: _video_case(c, _video_row("nope.mp4")))
case("video-no-frames")(lambda c: (c.tmp.joinpath("empty.mp4").write_bytes(b""),
                                   _video_case(c, _video_row("empty.mp4")))[1])
case("video-over-max-seq-len")(lambda c: _video_case(c, _video_row("clip.mp4"), "data.max_seq_len=64",
                                                     "data.video.nframes=6", "data.video.min_pixels=25088"))


@case("video-over-stage-max-seq-len")
def _(c: Ctx) -> Call:
    """A first stage of 64 tokens over the frames a second stage of 512 holds (6 frames of 25088 pixels)."""
    from tests.helpers.video_files import write_video

    def two_stages(tree: dict[str, Any]) -> None:
        tree["data"]["max_seq_len"] = 512
        tree["stages"] = [{**tree["stages"][0], "name": "short", "max_seq_len": 64}, {**tree["stages"][0],
                                                                                      "name": "long"}]

    write_video(c.tmp / "clip.mp4", 12)
    return c.train(f"model.name_or_path={c.models['vl']}", "data.video.nframes=6", "data.video.min_pixels=25088",
                   change=two_stages, rows=[CHAT, CHAT, _video_row("clip.mp4"), CHAT])


case("difficulty-frames-without-video")(lambda c: c.train(change=lambda t: t["stages"][0].update(
    order="easy_to_hard", difficulty={"by": "frames"})))
case("video-tags-mismatch")(lambda c: _video_case(c, _video_row("clip.mp4", tags=2)))
case("video-url")(lambda c: _video_case(c, _video_row("https://example.com/clip.mp4")))


@case("hub-id-offline")
def _(c: Ctx) -> Call:
    return replace(c.train("model.name_or_path=curriculum-toolkit-tests/no-such-model"), env={"HF_HUB_OFFLINE": "1"})


@case("hub-id-unreachable")
def _(c: Ctx) -> Call:
    # A real process with the hub client in online mode (its offline flag is read once, at import). Offline or
    # not, the answer is the same line: no network (CI), or no such repository (a machine with network).
    call = c.train("model.name_or_path=curriculum-toolkit-tests/no-such-model")
    return replace(call, env={"HF_HUB_OFFLINE": "0"}, subprocess=True)


@case("remote-code-needed")
def _(c: Ctx) -> Call:
    model = c.tmp / "custom-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "toolkit_custom", "auto_map": {
        "AutoConfig": "configuration_custom.CustomConfig"}}))
    (model / "configuration_custom.py").write_text(
        "from transformers import PretrainedConfig\n\nclass CustomConfig(PretrainedConfig):\n"
        "    model_type = 'toolkit_custom'\n")
    return c.train(f"model.name_or_path={model}")


@case("export-into-source-run", trained=True)
def _(c: Ctx) -> Call:
    run = c.copy_of_trained()
    return Call(["export", str(run), "--out", str(run)], run, tool="toolkit")


@case("export-into-parent", trained=True)
def _(c: Ctx) -> Call:
    run = c.copy_of_trained()
    return Call(["export", str(run), "--out", str(c.tmp)], c.tmp, tool="toolkit")


@case("export-into-user-folder", trained=True)
def _(c: Ctx) -> Call:
    run = c.copy_of_trained()
    (c.tmp / "thesis").mkdir()
    (c.tmp / "thesis" / "chapter1.tex").write_text("years of work")
    return Call(["export", str(run), "--out", str(c.tmp / "thesis")], c.tmp / "thesis", tool="toolkit")


@case("export-not-a-run")
def _(c: Ctx) -> Call:
    (c.tmp / "stuff").mkdir()
    (c.tmp / "stuff" / "a.txt").write_text("x")
    return Call(["export", str(c.tmp / "stuff"), "--out", str(c.tmp / "exported")], c.tmp / "exported",
                tool="toolkit")


@case("export-files-changed", trained=True)
def _(c: Ctx) -> Call:
    ckpt = c.copy_of_trained() / "checkpoints" / "step-00000002"
    shutil.copy2(ckpt.parent / "step-00000003" / "portable" / "lora_state.safetensors",
                 ckpt / "portable" / "lora_state.safetensors")
    return Call(["export", str(ckpt), "--out", str(c.tmp / "exported")], c.tmp / "exported", tool="toolkit")


@case("export-base-model-moved", trained=True)
def _(c: Ctx) -> Call:
    """A run trained with `model.name_or_path: ../models/tiny-qwen3` from another folder records that path."""
    ckpt = c.copy_of_trained() / "checkpoints" / "step-00000003"
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps(meta | {"base_model": "../models/tiny-qwen3"}))
    return Call(["export", str(ckpt), "--out", str(c.tmp / "exported")], c.tmp / "exported", tool="toolkit")


@case("export-without-recipe", trained=True)
def _(c: Ctx) -> Call:
    run = c.copy_of_trained()
    (run / "recipe.yaml").unlink()  # it used to advise "--config", an option export does not have
    return Call(["export", str(run / "checkpoints" / "step-00000003"), "--out", str(c.tmp / "exported")],
                c.tmp / "exported", tool="toolkit")


@case("export-remote-code", trained=True)
def _(c: Ctx) -> Call:
    run = c.copy_of_trained()
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    recipe["model"]["trust_remote_code"] = True
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return Call(["export", str(run), "--out", str(c.tmp / "exported")], c.tmp / "exported", tool="toolkit")


@case("report-not-a-run")
def _(c: Ctx) -> Call:
    (c.tmp / "stuff").mkdir()
    return Call(["report", str(c.tmp / "stuff")], c.tmp / "stuff", tool="toolkit")


@case("report-runs-without-out", trained=True)
def _(c: Ctx) -> Call:
    run = c.copy_of_trained()
    shutil.copytree(run, c.tmp / "run2")
    return Call(["report", str(run), str(c.tmp / "run2")], run, tool="toolkit")


@case("report-out-not-a-report", trained=True)
def _(c: Ctx) -> Call:
    run = c.copy_of_trained()
    (c.tmp / "notes.html").write_text("<html>the user's notes</html>")
    return Call(["report", str(run), "--out", str(c.tmp / "notes.html")], c.tmp / "notes.html", tool="toolkit")


@case("dummy-data-out-is-file")
def _(c: Ctx) -> Call:
    (c.tmp / "notes.txt").write_text("the user's notes")
    return Call(["dummy-data", "--out", str(c.tmp / "notes.txt")], c.tmp / "notes.txt", tool="toolkit")


@case("dummy-data-out-user-folder")
def _(c: Ctx) -> Call:
    (c.tmp / "data").mkdir()
    (c.tmp / "data" / "stage1.jsonl").write_text('{"text": "the user\'s own rows"}\n')
    return Call(["dummy-data", "--out", str(c.tmp / "data")], c.tmp / "data", tool="toolkit")


@case("tiny-model-out-user-folder")
def _(c: Ctx) -> Call:
    (c.tmp / "model").mkdir()
    (c.tmp / "model" / "config.json").write_text('{"model_type": "the user\'s own"}\n')
    return Call(["tiny-model", "--out", str(c.tmp / "model")], c.tmp / "model", tool="toolkit")


@case("output-dir-of-the-user")
def _(c: Ctx) -> Call:
    (c.tmp / "run").mkdir()
    (c.tmp / "run" / "recipe.yaml").write_text("model: {name_or_path: the/users/own}\n")
    return c.train()


@case("run-lock-is-a-link")
def _(c: Ctx) -> Call:
    victim = c.tmp / "victim.txt"
    victim.write_text("the user's own file\n")
    lock = RunLayout(c.tmp / "run").lock_file
    lock.parent.mkdir(parents=True)
    lock.symlink_to(victim)  # planted by anyone who can write the shared folder beside the output dir
    return replace(c.train(), watch=victim)


@case("dummy-data-zero")
def _(c: Ctx) -> Call:
    return Call(["dummy-data", "--out", str(c.tmp / "dummy"), "--num-samples", "0"], c.tmp / "dummy", tool="toolkit")


@case("score-out-exists")
def _(c: Ctx) -> Call:
    (c.tmp / "mine.parquet").write_text("the user's")
    return Call(["score", "--config", str(c.recipe()), "--out", str(c.tmp / "mine.parquet")], c.tmp / "run",
                tool="toolkit")


@case("score-unknown-stage")
def _(c: Ctx) -> Call:
    return Call(["score", "--config", str(c.recipe()), "--stage", "nope"], c.tmp / "run", tool="toolkit")


@case("score-dummy-samples-zero")
def _(c: Ctx) -> Call:
    recipe = c.recipe(stage("data", ["dummy:stage1"]))
    return Call(["score", "--config", str(recipe), "--num-dummy-samples", "0"], c.tmp / "run", tool="toolkit")


@case("score-vision-language")
def _(c: Ctx) -> Call:
    return Call(["score", "--config", str(c.recipe()), f"model.name_or_path={c.models['vl']}"], c.tmp / "run",
                tool="toolkit")


@case("score-output-dir-in-use")
def _(c: Ctx) -> Call:
    call = Call(["score", "--config", str(c.recipe())], c.tmp / "run", tool="toolkit")
    lock = RunLock(RunLayout(c.tmp / "run"))  # a live run's lock
    assert lock.acquire() is None
    c.keep.append(lock)
    return call


@case("scores-missing-on-resume")
def _(c: Ctx) -> Call:
    """A run ordered by the base model's loss, trained here for 1 step (a checkpoint at 1), whose scores
    were then deleted: the relaunch resumes at step 1, past step 0 where they were taken."""
    call = c.train(change=lambda t: t["stages"][0].update(order="easy_to_hard", max_steps=1,
                                                          difficulty={"by": "loss", "model": "base"}))
    with contextlib.chdir(c.tmp), contextlib.redirect_stderr(io.StringIO()) as err, process_state_kept():
        assert train_curriculum.main(call.argv) == 0, err.getvalue()[-3000:]
    shutil.rmtree(c.tmp / "run" / "scores")
    return call


@case("preflight-accelerate-config-missing")
def _(c: Ctx) -> Call:
    return Call(["preflight", "--config", str(c.recipe()), "--accelerate-config", str(c.tmp / "nope.yaml"),
                 "--no-data"], c.tmp / "run", tool="toolkit")


@case("preflight-accelerate-config-broken")
def _(c: Ctx) -> Call:
    (c.tmp / "acc.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config: {zero_stage: 3\n")
    return Call(["preflight", "--config", str(c.recipe()), "--accelerate-config", str(c.tmp / "acc.yaml"),
                 "--no-data"], c.tmp / "run", tool="toolkit")


@case("preflight-data-not-utf8")
def _(c: Ctx) -> Call:
    return Call(["preflight", "--config", str(latin1_data(c)), "--accelerate-config",
                 str(REPO / "accelerate_configs" / "single.yaml")], c.tmp / "run", tool="toolkit")


def lf_registry(c: Ctx, **entries: dict[str, Any]) -> None:
    """A LLaMA-Factory data folder lfdata/ (its dataset_info.json and an Alpaca file) with these registry entries."""
    (c.tmp / "lfdata").mkdir(exist_ok=True)
    write_jsonl(c.tmp / "lfdata" / "alpaca.jsonl", [{"instruction": "2 + 2?", "output": "4."}] * 8)
    (c.tmp / "lfdata" / "dataset_info.json").write_text(json.dumps({"alpaca_demo": {"file_name": "alpaca.jsonl"},
                                                                    **entries}))


def registry_case(name: str, dataset: str, **entries: dict[str, Any]) -> None:
    @case(name)
    def _(c: Ctx) -> Call:
        lf_registry(c, **entries)
        return c.train(change=stage("data", [{"dataset": dataset, "dataset_dir": "lfdata"}]))


@case("data-lf-folder-as-path")
def _(c: Ctx) -> Call:
    lf_registry(c)
    return c.train(change=stage("data", ["lfdata"]))


registry_case("registry-unknown-dataset", "alpaca_dem")


@case("registry-ranking")
def _(c: Ctx) -> Call:
    lf_registry(c, pairs={"file_name": "pairs.jsonl", "ranking": True})
    write_jsonl(c.tmp / "lfdata" / "pairs.jsonl", [{"instruction": "2 + 2?", "chosen": "4.", "rejected": "5."}] * 8)
    return c.train(change=stage("data", [{"dataset": "pairs", "dataset_dir": "lfdata"}]))


registry_case("registry-kto", "kto", kto={"file_name": "alpaca.jsonl", "formatting": "sharegpt",
                                          "tags": {"kto_tag": "label"}})
registry_case("registry-remote", "scripted", scripted={"script_url": "my_loader"})
registry_case("registry-hub-not-cached", "hub", hub={"hf_hub_url": "someone/not-cached"})
registry_case("registry-num-samples", "sampled", sampled={"file_name": "alpaca.jsonl", "num_samples": 4})
registry_case("registry-file-outside", "outside", outside={"file_name": "../data.jsonl"})  # it trained on it
registry_case("registry-file-absolute", "absolute", absolute={"file_name": "/etc/hostname"})
case("dataset-comma-list")(lambda c: c.train(change=stage("data", [{"dataset": "alpaca_demo,glaive_toolcall"}])))
case("data-path-and-dataset")(lambda c: c.train(change=stage("data", [{"path": "data.jsonl",
                                                                        "dataset": "alpaca_demo"}])))
case("data-unknown-tag")(lambda c: c.train(change=stage("data", [{"path": "data.jsonl", "tags": {"role": "speaker"}}])))
case("data-turn-keys-unmapped")(lambda c: c.train(rows=[{"conversations": [
    {"speaker": "customer", "text": "2 + 2?"}, {"speaker": "agent", "text": "4."}]}]))
case("data-unknown-role")(lambda c: c.train(rows=[{"messages": [dict(USER, role="customer"), ANSWER]}]))
case("data-turn-loss-scale")(lambda c: c.train(rows=[{"messages": [USER, dict(ANSWER, loss_scale=2.0)]}]))
case("data-part-flags-disagree")(lambda c: c.train(rows=[{"messages": [USER, {"role": "assistant", "content": [
    {"type": "text", "text": "It is ", "train": False}, {"type": "text", "text": "4.", "train": True}]}]}]))
case("data-part-not-text")(lambda c: c.train(rows=[{"messages": [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}, ANSWER]}]))
case("data-trl-stepwise")(lambda c: c.train(rows=[{"prompt": "2 + 2?", "completions": ["Two and two", " is 4."],
                                                    "labels": [True, True]}]))
case("data-content-key-unread")(lambda c: c.train(rows=[dict(CHAT, rationale="Because two and three make five.")]))
case("data-turn-content-key-unread")(lambda c: c.train(rows=[{"messages": [USER, dict(ANSWER, thoughts="So: five.")]}]))
case("data-dolly-unmapped")(lambda c: c.train(rows=[{  # databricks-dolly-15k, row 2
    "instruction": "Which is a species of fish? Tope or Rope", "context": "", "response": "Tope",
    "category": "classification"}]))
case("data-roles-ambiguous")(lambda c: c.train(rows=[{  # two columns no vocabulary names: which is the answer?
    "ask_text": "What is two and two?", "reply_body": "It is four.", "id": 3}]))
case("data-flat-message-export")(lambda c: c.train(rows=[{  # OpenAssistant/oasst2, flat export: a reply whose
    "message_id": "c8e83833", "parent_id": "6ab24d72", "text": "Monopsony is a market with one buyer.",  # parent
    "role": "assistant", "lang": "en"}]))  # (its tree's prompt) is not in the file
case("data-row-contradicts-file-roles")(lambda c: c.train(rows=[  # lmsys-chat-1m's `conversation`, then as text
    {"conversation": [USER, ANSWER]}, {"conversation": "hello, the model!"}]))
case("data-image-placeholder-no-images")(lambda c: c.train(rows=[{"messages": [
    dict(USER, content="<IMG_CONTEXT>\nWhat is it?"), ANSWER]}]))
case("data-image-markup")(lambda c: c.train(rows=[{"conversations": [  # Qwen-VL (v1) finetune README
    {"from": "user", "value": "Picture 1: <img>assets/demo.jpeg</img>\nWhat is the headline?"},
    {"from": "assistant", "value": "Welcome."}]}]))
case("data-images-url")(lambda c: c.train(rows=[{"messages": [dict(USER, content="<image>What is it?"), ANSWER],
                                                 "images": ["https://example.com/cat.png"]}]))
case("data-video-row")(lambda c: c.train(rows=[{"video": "videos/005.mp4", "conversations": [  # Qwen-VL finetune
    {"from": "human", "value": "<video>\nWhat caused the blue object to move?"},
    {"from": "gpt", "value": "Answer: (B) Collision"}]}]))
case("data-video-placeholder")(lambda c: c.train(rows=[{"messages": [dict(USER, content="<video>What is she doing?"),
                                                                     ANSWER]}]))
case("data-audio-part")(lambda c: c.train(rows=[{"messages": [dict(USER, content=[
    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]), ANSWER]}]))
case("data-image-url")(lambda c: c.train(rows=[{"messages": [dict(USER, content=[
    {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]), ANSWER]}]))
case("data-unknown-part-type")(lambda c: c.train(rows=[{"messages": [dict(USER, content=[
    {"type": "file", "file": {"file_id": "f"}}]), ANSWER]}]))
case("data-empty-answer")(lambda c: c.train(rows=[{"messages": [USER, dict(ANSWER, content="")]}]))
case("data-empty-answers-unknown")(lambda c: c.train("data.empty_answers=drop"))


def one_object(c: Ctx) -> Call:
    (c.tmp / "info.json").write_text(json.dumps({"alpaca_en_demo": {"file_name": "alpaca_en_demo.json"}}, indent=2))
    return c.train(change=stage("data", ["info.json"]))


case("data-json-one-object")(one_object)
case("data-prompt-beside-messages")(lambda c: c.train(rows=[dict(CHAT, prompt="Something else.")]))
case("data-ignore-empty-key")(lambda c: c.train(change=stage("data", [{"path": "data.jsonl", "ignore": [""]}])))
case("data-trl-image-not-path")(lambda c: c.train(rows=[dict(CHAT, image={"bytes": None, "path": None})]))
case("data-prompt-list-completion-string")(lambda c: c.train(rows=[{"prompt": [USER], "completion": "4."}]))
case("data-tool-call-not-json")(lambda c: c.train(rows=[{"messages": [
    USER, {"role": "tool_call", "content": "add(2, 2)"}, {"role": "tool_response", "content": "4"}, ANSWER]}]))
@case("resume-forced-model", trained=True)
def _(c: Ctx) -> Call:
    call = c.resume("checkpoint.resume_force=true", "model.name_or_path=other-model")
    shutil.copytree(c.models["text"], c.tmp / "other-model")
    return call


case("resume-forced-trainable", trained=True)(
    lambda c: c.resume("checkpoint.resume_force=true", "train.trainable=[lora,model.norm]"))
case("cache-not-writable")(lambda c: replace(c.train(), env={"TOOLKIT_CACHE_DIR": "/dev/null/cache"}))
case("chat-template-unknown")(lambda c: c.train(change=section("data", chat_template="qwen4")))
case("chat-template-missing")(lambda c: c.train(change=section("data", chat_template="templates/chat.jinja")))
@case("export-final-damaged", trained=True)
def _(c: Ctx) -> Call:
    run = c.copy_of_trained()
    adapter = run / "final" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[: adapter.stat().st_size // 2])
    return Call(["export", str(run), "--out", str(c.tmp / "exported")], c.tmp / "exported", tool="toolkit")


@case("export-checkpoint-final-tokenizer-changed", trained=True)
def _(c: Ctx) -> Call:
    run = c.copy_of_trained()
    config = run / "final" / "tokenizer_config.json"  # still a tokenizer that loads: only the check can tell
    config.write_text(json.dumps(json.loads(config.read_text()) | {"model_max_length": 7}))
    return Call(["export", str(run / "checkpoints" / "step-00000003"), "--out", str(c.tmp / "exported")],
                c.tmp / "exported", tool="toolkit")


@case("model-from-damaged-final")
def _(c: Ctx) -> Call:
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.checkpoint.final import save_final

    final = c.tmp / "earlier" / "final"  # a full fine-tune's final/, as training writes it
    final.parent.mkdir()
    save_final(Accelerator(cpu=True), AutoModelForCausalLM.from_pretrained(c.models["text"]),
               AutoTokenizer.from_pretrained(c.models["text"]), final, card=None)
    weights = final / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(raw[:-64] + bytes(64))  # the same size, the last tensor's last values zeroed: it loads
    return c.train(f"model.name_or_path={final}")


@case("damaged-store-read-only-cache")
def _(c: Ctx) -> Call:
    import numpy as np
    import pyarrow as pa

    from tests.conftest import mounted_tmpfs, remount_read_only
    from toolkit.config.load import load_recipe
    from toolkit.config.stages import resolve_stages
    from toolkit.data.sources import resolve_source
    from toolkit.data.stages import row_encoder
    from toolkit.data.store import open_store
    from toolkit.model.load import load_processing

    mounts = contextlib.ExitStack()
    cache = mounts.enter_context(mounted_tmpfs(c.tmp / "cache", "16m"))
    c.cleanups.append(mounts.close)  # unmounted when the case ends
    recipe = load_recipe(c.recipe(), [f"data.cache_dir={cache}"])
    tokenizer = load_processing(c.models["text"], vision=False, trust_remote_code=False, chat_template=None)[1]
    entry = resolve_stages(recipe)[0].entries[0]  # the run's store, prepared here (a store's key has no path)
    source = resolve_source(replace(entry, path=str(c.tmp / entry.path)), c.tmp)
    store = open_store(source, row_encoder(recipe.data, tokenizer, None), cache, num_proc=1).path
    assert store is not None
    data = store / "data.arrow"
    ids = pa.ipc.open_stream(data.read_bytes()).read_all().column("input_ids")[0].values.to_numpy()
    raw = data.read_bytes()
    at = raw.find(ids.tobytes())
    data.write_bytes(raw[:at] + np.ascontiguousarray(ids[::-1]).tobytes() + raw[at + ids.nbytes:])  # same size
    remount_read_only(cache)
    return c.train(f"data.cache_dir={cache}")


@case("data-not-regular-file")
def _(c: Ctx) -> Call:
    import os

    os.mkfifo(c.tmp / "pipe.jsonl")  # never opened: opening a FIFO blocks until someone writes
    return c.train(change=stage("data", ["pipe.jsonl"]))


case("data-oversized-row")(lambda c: c.train("data.overlength=error", rows=[CHAT, {"text": "word " * 220_000}, CHAT]))


def parallelism(c: Ctx, *, deepspeed: bool = True, **sizes: str) -> Call:
    """What `accelerate launch` puts in the environment for a config file's `parallelism_config` block (one process:
    the refusals come before the process group)."""
    env = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "ACCELERATE_USE_DEEPSPEED": str(deepspeed).lower(),
           **{f"PARALLELISM_CONFIG_{k.upper()}": v for k, v in {"sp_size": "2", **sizes}.items()}}
    return replace(c.train(), env=env)


case("sequence-parallel-without-deepspeed")(lambda c: parallelism(c, deepspeed=False))
case("context-parallel")(lambda c: parallelism(c, cp_size="2", sp_size="1"))
case("parallel-sizes-do-not-multiply")(lambda c: parallelism(c))
case("sequence-length-fixed")(lambda c: parallelism(c, sp_seq_length_is_variable="false"))


# --- running them ----------------------------------------------------------------------------------------------

def test_table_and_cases_agree() -> None:
    rows = documented()
    assert len(rows) >= 40
    assert sorted(set(rows) - set(CASES)) == [], "documented without a case"
    assert sorted(set(CASES) - set(rows)) == [], "a case missing from docs/bad_inputs.md"


@pytest.mark.parametrize("name", sorted(documented()))
def test_bad_input(name: str, tmp_path: Path, models: dict[str, str], request: pytest.FixtureRequest,
                   monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = Ctx(tmp_path, models, request.getfixturevalue("trained") if name in NEEDS_TRAINED_RUN else None)
    try:
        call = CASES[name](ctx)
        before = snapshot(call.watch)
        rc, stderr = invoke(call, tmp_path, monkeypatch)
    finally:
        for cleanup in ctx.cleanups:
            cleanup()
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert rc == 2, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert len(errors) == 1, stderr[-3000:]
    assert documented()[name] in errors[0], errors[0]
    assert snapshot(call.watch) == before, f"{call.watch} was changed"


# --- keys that change what trains and are honoured (the second table of docs/bad_inputs.md) ---------------------

def honoured_documented() -> list[str]:
    """The ids of the table of honoured data keys."""
    text = TABLE.read_text(encoding="utf-8").split("## Data keys that change what trains: honoured")[1]
    return re.findall(r"^\| `([a-z0-9-]+)` \|", text.split("\n## ")[0], flags=re.MULTILINE)


Q2, A2 = {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "6."}
TWO_TURNS = [USER, ANSWER, Q2, A2]


def _trained_runs(row: dict[str, Any], tok: Any) -> list[str]:
    from toolkit.data.encoding import IGNORE_INDEX, encode_row

    ids, labels = encode_row(row, tok, "assistant", "data.jsonl:1")
    runs, current = [], []
    for t, lab in [*zip(ids, labels, strict=True), (0, IGNORE_INDEX)]:
        if lab != IGNORE_INDEX:
            current.append(t)
        elif current:
            runs.append(tok.decode(current))
            current = []
    return runs


def _flag(messages: list[dict[str, Any]], index: int, **flag: Any) -> list[dict[str, Any]]:
    return [dict(m, **flag) if i == index else m for i, m in enumerate(messages)]


E = "<|im_end|>"
HONOURED: dict[str, Callable[[Any], None]] = {
    "turn-weight-zero": lambda tok: _expect(tok, _flag(TWO_TURNS, 1, weight=0), ["<think>\n\n</think>\n\n6." + E]),
    "turn-training-false": lambda tok: _expect(tok, _flag(TWO_TURNS, 3, training=False), ["4." + E]),
    "turn-weight-one": lambda tok: _expect(tok, _flag(_flag(TWO_TURNS, 1, weight=1), 3, training=True), None),
    "turn-weight-zero-prompt": lambda tok: _expect(tok, _flag(_flag(TWO_TURNS, 0, weight=0), 2, training=False), None),
    "all-turns-weight-zero": lambda tok: _expect(tok, _flag(_flag(TWO_TURNS, 1, weight=0), 3, weight=0), []),
    "null-other-shape": lambda tok: _expect(tok, TWO_TURNS, None, text=None, prompt=None),
    "plain-extras": lambda tok: _expect(tok, TWO_TURNS, None, id=3, source="web", label="math", difficulty=2),
    "turn-train-false": lambda tok: _expect(tok, _flag(TWO_TURNS, 3, train=False), ["4." + E]),
    "turn-loss-false": lambda tok: _expect(tok, _flag(_flag(TWO_TURNS, 1, loss=None), 3, loss=False), ["4." + E]),
    "turn-loss-scale-zero": lambda tok: _expect(tok, _flag(_flag(TWO_TURNS, 1, loss_scale=1), 3, loss_scale=0),
                                                ["4." + E]),
    "turn-loss-weight-zero": lambda tok: _expect(tok, _flag(TWO_TURNS, 3, loss_weight=0.0), ["4." + E]),
}


def _expect(tok: Any, messages: list[dict[str, Any]], runs: list[str] | None, **extra: Any) -> None:
    """The row trains `runs` (None: exactly what the bare two-turn chat trains), on the bare chat's token ids."""
    from toolkit.data.encoding import encode_row

    bare = _trained_runs({"messages": TWO_TURNS}, tok)
    assert bare == ["4." + E, "<think>\n\n</think>\n\n6." + E]
    assert _trained_runs({"messages": messages, **extra}, tok) == (bare if runs is None else runs)
    assert encode_row({"messages": messages, **extra}, tok, "assistant", "f:1")[0] == \
        encode_row({"messages": TWO_TURNS}, tok, "assistant", "f:1")[0]


def test_honoured_table_and_cases_agree() -> None:
    assert sorted(honoured_documented()) == sorted(HONOURED)


@pytest.mark.parametrize("name", sorted(HONOURED))
def test_honoured(name: str, qwen_tokenizer: Any) -> None:
    import copy

    from tests.conftest import stock_template

    tok = copy.copy(qwen_tokenizer)
    tok.chat_template = stock_template("qwen3")
    HONOURED[name](tok)


# --- the same through real processes, as users launch them ------------------------------------------------------

def test_unknown_key_in_a_real_process(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(base_recipe(TINY_MODEL) | {"optimiser": {"lr": 1}}))
    proc = subprocess.run([sys.executable, str(REPO / "train_curriculum.py"), "--config", str(recipe)],
                          cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert [line for line in proc.stderr.splitlines() if line.startswith("error: ")] == [
        f"error: Invalid recipe {recipe}: unknown key 'optimiser'. Did you mean: optimizer? Valid keys here: "
        "output_dir, run_name, model, lora, data, stages, optimizer, schedule, train, eval, stability, checkpoint, "
        "logging, distributed."]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_refusal_under_a_two_process_launch_is_one_line(tmp_path: Path) -> None:
    """Issue 38 rule 5: both ranks refuse the recipe (before their process group exists); rank 0 says it, rank 1
    hears it through the launcher's store and stays quiet, so the launch prints one `error:` line in all (it printed
    one per rank). Rank 0 exits 2; the launch's own exit (1) and its ChildFailedError traceback are torch elastic's,
    which no child can change (docs/bad_inputs.md): its summary holds the line once, as its root cause."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(base_recipe(TINY_MODEL) | {"optimiser": {"lr": 1}}))
    proc = run_launch([*launch_cmd("ddp", 2), str(REPO / "train_curriculum.py"), "--config", str(recipe)],
                      cwd=tmp_path, timeout=300)
    output = proc.stdout + proc.stderr
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "unknown key 'optimiser'" in errors[0], output[-4000:]
    assert proc.returncode == 1, output[-4000:]
    root_cause = output[output.index("Root Cause"):]
    assert "rank      : 0 " in root_cause and "exitcode  : 2 " in root_cause, root_cause
    assert "traceback : error: Invalid recipe" in root_cause, root_cause
    # Rank 1 stopped on the same error and stayed quiet (exit 2, its record pointing at rank 0's), or, where rank 0
    # ended first, the launcher stopped it with SIGTERM (it stops the others once one process fails).
    rank_1 = output[output.index("Failures:"):output.index("Root Cause")]
    assert ("traceback : the same error as rank 0 (rank 1 stopped on it too)" in rank_1
            or "SIGTERM" in rank_1), rank_1
    assert not re.search(r'File ".*(/toolkit/|train_curriculum\.py)"', output), output[-4000:]  # no rank's
    assert not (tmp_path / "run").exists()


def test_deepspeed_config_that_does_not_exist(tmp_path: Path) -> None:
    acc_cfg = yaml.safe_load((REPO / "accelerate_configs" / "zero3.yaml").read_text())
    acc_cfg["deepspeed_config"]["deepspeed_config_file"] = "ds_configs/missing.json"
    cfg_path = tmp_path / "acc.yaml"
    cfg_path.write_text(yaml.safe_dump(acc_cfg))
    launcher = launch_cmd("zero3", 1)
    launcher[launcher.index("--config_file") + 1] = str(cfg_path)
    write_jsonl(tmp_path / "data.jsonl", [CHAT] * 8)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(base_recipe(TINY_MODEL, str(tmp_path / "data.jsonl"))
                                                         | {"output_dir": str(tmp_path / "run")}))
    proc = run_launch([*launcher, str(REPO / "train_curriculum.py"), "--config", str(tmp_path / "recipe.yaml")],
                      timeout=300)
    # accelerate launch exits 1 when its child fails; the child's own message is what the user reads.
    assert proc.returncode != 0
    assert "error: The accelerate config names the DeepSpeed config 'ds_configs/missing.json'" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_rows_without_assistant_tokens_are_skipped_not_nan(tmp_path: Path, models: dict[str, str],
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    from toolkit.metrics.log import read_metrics

    no_assistant = {"messages": [{"role": "user", "content": "Nothing to learn here."}]}
    ctx = Ctx(tmp_path, models)
    rc, stderr = invoke(ctx.train("stages.0.max_steps=2", rows=[CHAT, no_assistant] * 6), tmp_path, monkeypatch)
    assert rc == 0, stderr[-3000:]
    assert "12 rows, 6 kept" in caplog.text and "6 skipped with no trainable tokens" in caplog.text
    records = read_metrics(tmp_path / "run" / "metrics.jsonl", "train")
    assert len(records) == 2 and all(r["loss"] is not None for r in records)
