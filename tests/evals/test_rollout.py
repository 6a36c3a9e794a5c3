"""Rollouts (toolkit/evals/rollout.py) on the tiny Qwen3: seeded per (step, prompt, sample index), so a prompt's
completions do not depend on the prompts batched with it; their log-probs equal the training forward's (the chunked
loss head's per-token mode); truncation at the length limit; top-p."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import REPO, launch_cmd, run_env
from toolkit.evals.rollout import Rollout, SeededSampler, rollout, sample_seed
from toolkit.model.loss_head import install_loss_head, loss_head_of
from toolkit.train.grpo import policy_batch, tokens_to_grid

PROMPTS = ["What is 2 + 2?", "Count to five, slowly and carefully.", "Name a colour."]
G = 3


@pytest.fixture(scope="module")
def tiny(models: dict[str, str]) -> tuple[Any, Any]:
    tokenizer = AutoTokenizer.from_pretrained(models["text"])
    model = AutoModelForCausalLM.from_pretrained(models["text"], attn_implementation="sdpa", dtype=torch.float32)
    install_loss_head(model, "chunked", chunk_tokens=7)
    return model, tokenizer


def draw(tiny: tuple[Any, Any], prompts: list[str], keys: list[int], *, per_batch: int, step: int = 0,
         length: int = 12, temperature: float = 1.0, top_p: float = 1.0, eos: list[int] | None = None) -> Rollout:
    model, tokenizer = tiny
    return rollout(model, [tokenizer(p)["input_ids"] for p in prompts], keys, num_generations=G,
                   max_completion_length=length, temperature=temperature, top_p=top_p, seed=7, step=step,
                   eos_ids=eos or [tokenizer.eos_token_id], pad_id=tokenizer.pad_token_id, prompts_per_batch=per_batch)


def by_prompt(out: Rollout) -> list[list[list[int]]]:
    return [out.completion_ids[i:i + G] for i in range(0, len(out.completion_ids), G)]


def test_completions_do_not_depend_on_their_batch_mates_and_follow_the_seed(tiny: tuple[Any, Any]) -> None:
    together = draw(tiny, PROMPTS, [0, 1, 2], per_batch=3)
    alone = [draw(tiny, [p], [k], per_batch=1) for k, p in enumerate(PROMPTS)]
    reordered = draw(tiny, PROMPTS[::-1], [2, 1, 0], per_batch=2)
    assert by_prompt(together) == [by_prompt(a)[0] for a in alone] == by_prompt(reordered)[::-1]
    groups = by_prompt(together)
    assert all(len({tuple(c) for c in group}) > 1 for group in groups)  # samples of a prompt differ
    assert by_prompt(draw(tiny, PROMPTS, [0, 1, 2], per_batch=3, step=1)) != groups  # another step, other draws
    assert by_prompt(draw(tiny, PROMPTS, [5, 1, 2], per_batch=3))[0] != groups[0]  # the prompt's key seeds it
    assert sample_seed(7, 0, 1, 2) != sample_seed(7, 0, 2, 1)


def test_log_probs_equal_the_training_forward_and_truncation_is_flagged(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    ends = list(range(2, len(tokenizer), 5))  # the random model rarely says <|im_end|>: a fifth of the tokens end
    out = draw(tiny, PROMPTS, [0, 1, 2], per_batch=2, length=6, temperature=0.7, eos=ends)
    assert any(out.truncated) and not all(out.truncated)
    for ids, cut in zip(out.completion_ids, out.truncated, strict=True):
        assert (len(ids) == 6 and not set(ids) & set(ends)) if cut else (ids[-1] in ends and
                                                                           not set(ids[:-1]) & set(ends))
    t = out.tensors(tokenizer.pad_token_id)
    head = loss_head_of(model)
    assert head is not None
    with torch.no_grad(), head.per_token(0.7) as kept:
        model(**policy_batch(t["prompt_ids"], t["prompt_mask"], t["completion_ids"], t["completion_mask"]))
    expected = tokens_to_grid(kept.logps, t["completion_mask"])
    torch.testing.assert_close(t["old_logps"], expected, rtol=0, atol=1e-5)
    assert float(t["old_logps"].abs().max()) > 0.1


def test_a_small_top_p_keeps_only_the_most_likely_token(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    out = draw(tiny, PROMPTS[:1], [0], per_batch=1, top_p=1e-6)
    ids = tokenizer(PROMPTS[0], return_tensors="pt")["input_ids"]
    greedy = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
    end = greedy.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in greedy else len(greedy)
    assert out.completion_ids == [greedy[:end]] * G


@pytest.mark.slow
def test_one_and_two_processes_draw_the_same_completions_and_step_alike(models: dict[str, str],
                                                                         tmp_path: Path) -> None:
    """tests/helpers/rl_step.py in one process, then in two under DDP (gloo): the same completions and rewards, and
    the loss normalised over the global batch gives the same loss and LoRA gradients."""
    helper = str(REPO / "tests" / "helpers" / "rl_step.py")
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    for cmd, out in (([sys.executable, helper], one), ([*launch_cmd("ddp", 2), helper], two)):
        proc = subprocess.run([*cmd, models["text"], str(out)], env=run_env(), capture_output=True, text=True,
                              timeout=300, cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert a["completions"] == b["completions"] and len(a["completions"]) == 16
    assert a["rewards"] == b["rewards"] and 0 < sum(r[0] for r in a["rewards"]) < 16  # mixed groups
    assert any(abs(x) > 0.1 for x in a["advantages"])
    assert abs(a["loss"] - b["loss"]) <= 1e-6
    assert a["grads"].keys() == b["grads"].keys() and a["grads"]
    for name, grad in a["grads"].items():
        torch.testing.assert_close(torch.tensor(b["grads"][name]), torch.tensor(grad), rtol=0, atol=1e-6, msg=name)


def test_the_seeded_draw_follows_the_distribution() -> None:
    """The counter-based inverse-CDF draw takes each token with its probability (4000 rows, and one row over 1000
    positions), top-p's renormalised probability among the kept tokens (in any vocabulary order), and a row's
    draws depend only on its own seed."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    rows = SeededSampler(range(4000), 1.0, 1.0, torch.device("cpu"))
    chosen = rows(torch.zeros(4000, 1, dtype=torch.long), probs.log().repeat(4000, 1)).argmax(-1)
    torch.testing.assert_close(torch.bincount(chosen, minlength=4) / 4000, probs, rtol=0, atol=0.025)
    shuffled = torch.tensor([0.15, 0.5, 0.05, 0.3])  # top-p 0.75 keeps 0.5 and 0.3: 0.625 and 0.375
    kept = SeededSampler(range(4000), 1.0, 0.75, torch.device("cpu"))
    chosen = kept(torch.zeros(4000, 1, dtype=torch.long), shuffled.log().repeat(4000, 1)).argmax(-1)
    torch.testing.assert_close(torch.bincount(chosen, minlength=4) / 4000, torch.tensor([0.0, 0.625, 0.0, 0.375]),
                               rtol=0, atol=0.025)
    one = SeededSampler([12], 1.0, 1.0, torch.device("cpu"))
    alone = torch.stack([one(torch.zeros(1, 1, dtype=torch.long), probs.log().unsqueeze(0)).argmax(-1)[0]
                         for _ in range(1000)])
    torch.testing.assert_close(torch.bincount(alone, minlength=4) / 1000, probs, rtol=0, atol=0.05)
    paired = SeededSampler([99, 12], 1.0, 1.0, torch.device("cpu"))
    second = [int(paired(torch.zeros(2, 1, dtype=torch.long), probs.log().repeat(2, 1)).argmax(-1)[1])
              for _ in range(50)]
    assert alone[:50].tolist() == second
