"""The scoring pass (toolkit/evals/scoring.py) equals a plain computation, row by row.

The reference runs each row alone through the same tiny Qwen3 with the standard head: full-vocabulary logits,
log_softmax, the label tokens' negative log-probs summed in float64. The pass runs the rows batched, padded or
packed into one row, through the installed chunked loss head (several chunks per micro-batch). Per-row loss,
perplexity and IFD agree within 1e-6, and so do the eval loss built on it and the full-logits path of
`model.loss_head: standard`.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from toolkit.data.collate import padding_collator
from toolkit.data.encoding import IGNORE_INDEX, encode_row
from toolkit.data.packing import PackedCollator
from toolkit.evals.loss import evaluate
from toolkit.evals.scoring import ScoreCache, cached_row_sums, measure, response_alone, row_sums, score_key
from toolkit.model.attention import SDPA_PACKED, register_kernels
from toolkit.model.loss_head import install_loss_head, loss_head_of
from toolkit.runtime import process as distributed

QUESTIONS = [("What is 2 + 2?", "4."), ("Name a colour.", "Blue, like the sky over the sea at noon."),
             ("Spell cat.", "c a t"), ("Count to five.", "one two three four five"),
             ("Say hi.", "Hi!"), ("What is 12 * 12?", "144, since 12 * 12 = 144.")]


@pytest.fixture(scope="module")
def tokenizer(models: dict[str, str]) -> Any:
    return AutoTokenizer.from_pretrained(models["text"])


@pytest.fixture(scope="module")
def samples(tokenizer: Any) -> list[dict[str, Any]]:
    rows = []
    for i, (q, a) in enumerate(QUESTIONS):
        ids, labels = encode_row({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]},
                                 tokenizer, "assistant", f"rows.jsonl:{i + 1}")
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def load(models: dict[str, str], attn: str = "sdpa") -> PreTrainedModel:
    register_kernels()
    model = AutoModelForCausalLM.from_pretrained(models["text"], attn_implementation=attn, dtype=torch.float32)
    model.config.use_cache = False
    return model.eval()


@torch.no_grad()
def reference(model: PreTrainedModel, sample: dict[str, Any]) -> tuple[float, int]:
    """(summed negative log-prob of the label tokens, their count) of one row alone, from full logits."""
    ids = torch.tensor([sample["input_ids"]])
    labels = torch.tensor(sample["labels"])
    logp = F.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    targets = labels[1:]
    keep = targets != IGNORE_INDEX
    picked = logp[:-1][keep].gather(1, targets[keep].unsqueeze(1))
    return float(-picked.sum()), int(keep.sum())


@pytest.fixture(scope="module")
def expected(models: dict[str, str], samples: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    model = load(models)
    given = [reference(model, s) for s in samples]
    alone = [reference(model, response_alone(s)) for s in samples]
    loss = np.array([s / n for s, n in given])
    alone_loss = np.array([s / n for s, n in alone])
    return {"sum": np.array([s for s, _ in given]), "tokens": np.array([n for _, n in given]), "loss": loss,
            "perplexity": np.exp(loss), "ifd": loss / alone_loss}


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_row_scores_equal_a_full_logits_computation_row_by_row(models: dict[str, str], tokenizer: Any,
                                                               samples: list[dict[str, Any]],
                                                               expected: dict[str, np.ndarray], packed: bool) -> None:
    model = load(models, SDPA_PACKED if packed else "sdpa")
    head = install_loss_head(model, "chunked", chunk_tokens=5)  # several chunks per micro-batch
    assert head is not None and loss_head_of(model) is head
    collate = PackedCollator() if packed else padding_collator(tokenizer)
    accelerator = distributed.build_accelerator(1, 10)
    calls = head.calls
    given = row_sums(accelerator, model, samples, collate, micro_batch_size=4, block_rows=5)
    alone = row_sums(accelerator, model, [response_alone(s) for s in samples], collate, micro_batch_size=3)
    assert head.calls - calls == (2 + 1) + 2  # blocks of 5 + 1 rows, then 6 rows: the chunked head ran each
    assert given.loss.dtype == np.float64
    np.testing.assert_array_equal(given.tokens, expected["tokens"])
    np.testing.assert_allclose(given.loss, expected["sum"], rtol=1e-7)  # fp32 forwards: sums of ~100 tokens
    for name in ("loss", "ifd"):
        np.testing.assert_allclose(measure(name, given, alone), expected[name], rtol=0, atol=1e-6)
    np.testing.assert_allclose(measure("perplexity", given), expected["perplexity"], rtol=1e-6)  # ~e^6: relative
    assert model.training is False


def test_a_subset_of_rows_in_blocks_reports_each_block(models: dict[str, str], tokenizer: Any,
                                                       samples: list[dict[str, Any]],
                                                       expected: dict[str, np.ndarray]) -> None:
    model = load(models).train()
    install_loss_head(model, "chunked")
    seen: list[list[int]] = []
    sums = row_sums(distributed.build_accelerator(1, 10), model, samples, padding_collator(tokenizer), 2,
                    rows=[5, 0, 3], block_rows=2, on_block=lambda idx, part: seen.append(idx.tolist()))
    assert seen == [[5, 0], [3]]
    np.testing.assert_allclose(sums.loss, expected["sum"][[5, 0, 3]], rtol=1e-7)
    assert model.training  # put back as it was


def test_the_standard_head_gives_the_same_sums_and_the_eval_loss_is_their_total(
        models: dict[str, str], tokenizer: Any, samples: list[dict[str, Any]],
        expected: dict[str, np.ndarray]) -> None:
    model = load(models)  # no loss head installed: model.loss_head standard, full logits
    accelerator = distributed.build_accelerator(1, 10)
    sums = row_sums(accelerator, model, samples, padding_collator(tokenizer), 3)
    np.testing.assert_allclose(sums.loss, expected["sum"], rtol=1e-7)  # fp32 forwards: sums of ~100 tokens
    install_loss_head(model, "chunked")
    result = evaluate(accelerator, model, samples, padding_collator(tokenizer), 4)
    mean = expected["sum"].sum() / expected["tokens"].sum()
    assert result["eval_tokens"] == int(expected["tokens"].sum())
    assert math.isclose(result["eval_loss"], mean, abs_tol=1e-6)


def test_response_alone_keeps_the_label_tokens_after_the_opening_token() -> None:
    row = {"input_ids": [1, 2, 3, 4, 5, 6, 7], "labels": [IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 4, 5,
                                                              IGNORE_INDEX, 7]}
    assert response_alone(row) == {"input_ids": [1, 4, 5, 7], "labels": [IGNORE_INDEX, 4, 5, 7]}



class StopAfter:
    """Raises, as a stop signal before the first step does (runtime/signals.py's Stopped), once `blocks` blocks
    were kept: the pass is cut off between two blocks."""

    def __init__(self, cache: ScoreCache, blocks: int) -> None:
        self.cache, self.left = cache, blocks
        self._record = cache.record

    def __call__(self, indices: np.ndarray, part: Any) -> None:
        self._record(indices, part)
        self.left -= 1
        if self.left == 0:
            raise KeyboardInterrupt


def test_a_stopped_pass_keeps_its_blocks_and_the_next_one_scores_only_the_rest(
        tmp_path: Path, models: dict[str, str], tokenizer: Any, samples: list[dict[str, Any]],
        expected: dict[str, np.ndarray], caplog: pytest.LogCaptureFixture) -> None:
    model = load(models)
    head = install_loss_head(model, "chunked")
    assert head is not None
    accelerator = distributed.build_accelerator(1, 10)
    collate = padding_collator(tokenizer)
    key = score_key(rows="store-sha", scorer="weights-sha", rendering="given")
    first = ScoreCache(tmp_path, key, len(samples), writer=True)
    first.record = StopAfter(first, blocks=2)  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        cached_row_sums(accelerator, model, samples, collate, 1, cache=first, block_rows=2)
    again = ScoreCache(tmp_path, key, len(samples), writer=True)
    assert again.done.tolist() == [True] * 4 + [False] * 2  # two blocks of two rows kept
    calls = head.calls
    with caplog.at_level(logging.INFO, logger="toolkit.evals.scoring"):
        sums = cached_row_sums(accelerator, model, samples, collate, 1, cache=again, block_rows=2)
    assert head.calls - calls == 2  # only the two rows not done
    np.testing.assert_allclose(sums.loss, expected["sum"], rtol=1e-7)
    assert any("scoring: 6/6 rows (100%)" in r.getMessage() and "rows/s, ETA" in r.getMessage()
               for r in caplog.records)
    calls = head.calls
    cached_row_sums(accelerator, model, samples, collate, 1, cache=ScoreCache(tmp_path, key, 6, writer=True))
    assert head.calls == calls  # complete: nothing scored again
    other = score_key(rows="store-sha", scorer="other-weights", rendering="given")
    assert not ScoreCache(tmp_path, other, 6, writer=True).done.any()  # another scorer: scored afresh
    assert not ScoreCache(tmp_path, key, 7, writer=True).done.any()  # other rows under the same key: afresh


def test_should_stop_ends_the_pass_between_blocks_keeping_them(tmp_path: Path, models: dict[str, str],
                                                               tokenizer: Any, samples: list[dict[str, Any]],
                                                               expected: dict[str, np.ndarray]) -> None:
    model = load(models)
    install_loss_head(model, "chunked")
    accelerator, collate = distributed.build_accelerator(1, 10), padding_collator(tokenizer)
    asked: list[int] = []

    def stop() -> bool:  # a signal arrives during the second block
        asked.append(1)
        return len(asked) >= 2

    cache = ScoreCache(tmp_path, "k", len(samples), writer=True)
    assert cached_row_sums(accelerator, model, samples, collate, 1, cache=cache, block_rows=2,
                           should_stop=stop) is None
    kept = ScoreCache(tmp_path, "k", len(samples), writer=True)
    assert kept.done.tolist() == [True] * 4 + [False] * 2  # the two finished blocks
    sums = cached_row_sums(accelerator, model, samples, collate, 1, cache=kept, block_rows=2, should_stop=stop)
    assert sums is not None  # the last block completes the pass: nothing left to stop
    np.testing.assert_allclose(sums.loss, expected["sum"], rtol=1e-7)
