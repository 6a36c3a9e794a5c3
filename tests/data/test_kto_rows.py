"""A kto stage's rows (toolkit/data/plan.py `KtoRows`): TRL's unpaired `{prompt, completion, label}` rows, standard
and conversational, stored with their labels, each served with its KL side (its prompt, another row's completion);
a row without a true/false label refused in one line naming it."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.data.test_pair_data import stage_of, write
from toolkit.data.collate import padding_collator, pair_collator
from toolkit.data.encoding import IGNORE_INDEX
from toolkit.data.plan import KtoRows, PairSides
from toolkit.data.stages import load_stage, run_stores
from toolkit.errors import ToolkitError


@pytest.fixture(scope="module")
def tok(models: dict[str, str]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models["text"])


WILD = REPO / "tests" / "assets" / "wild" / "trl_unpaired_preference.jsonl"


def kto_stage(tmp: Path, model: str, path: Path, micro: int) -> tuple[Any, Any]:
    stage, recipe = stage_of(tmp, model, [path], objective="kto", stage={"micro_batch_size": micro})
    return stage, recipe


def completion_of(side: dict[str, list[int]]) -> list[int]:
    at = next(i for i, y in enumerate(side["labels"]) if y != IGNORE_INDEX)
    return side["input_ids"][at:]


def prompt_of(side: dict[str, list[int]]) -> list[int]:
    at = next(i for i, y in enumerate(side["labels"]) if y != IGNORE_INDEX)
    return side["input_ids"][:at]


def test_trl_unpaired_rows_train_with_their_labels_and_kl_sides(tmp_path: Path, models: dict[str, str],
                                                                tok: Any) -> None:
    path = tmp_path / WILD.name
    shutil.copy(WILD, path)
    stage, recipe = kto_stage(tmp_path, models["text"], path, micro=2)
    src = load_stage(stage, recipe.data, run_stores([stage], recipe.data, tok, None, tmp_path, None))
    [part] = src.samples.parts
    assert isinstance(part, KtoRows) and len(part) == 4 and part.desirable.tolist() == [True, False, True, False]
    sides = PairSides([part])
    own = [sides[2 * k] for k in range(4)]
    texts = [tok.decode(completion_of(s)) for s in own]
    assert texts[0] == " blue." + tok.eos_token and texts[1] == " green." + tok.eos_token  # standard: + EOS (TRL)
    assert "It is blue.<|im_end|>" in texts[2] and "It is green.<|im_end|>" in texts[3]  # conversational
    # chunks of micro_batch_size 2: rows 0, 1 swap completions, and so do 2, 3 (TRL's rotation per batch)
    for k, partner in enumerate([1, 0, 3, 2]):
        kl = sides[2 * k + 1]
        assert prompt_of(kl) == prompt_of(own[k]) and completion_of(kl) == completion_of(own[partner]), k
        assert kl["labels"][len(prompt_of(kl)):] == own[partner]["labels"][len(prompt_of(own[partner])):]
    batch = pair_collator(padding_collator(tok))([src.samples[0], src.samples[1]])
    assert batch["desirable"] == [True, False] and batch["pair_index"] == [0, 1]
    assert batch["input_ids"].shape[0] == 4  # each row and its KL side


def test_a_kl_side_over_the_limit_loses_its_completion_s_end(tmp_path: Path, models: dict[str, str],
                                                              tok: Any) -> None:
    rows = [{"prompt": "Say a word.", "completion": " ok", "label": True},
            {"prompt": "Q", "completion": " a b c d e f g h i j k l m n o p", "label": False}]
    path = write(tmp_path / "kto.jsonl", rows)
    stage, recipe = kto_stage(tmp_path, models["text"], path, micro=2)
    longest = len(tok("Q a b c d e f g h i j k l m n o p")["input_ids"]) + 1  # with its EOS
    limit = max(len(tok("Say a word.")["input_ids"]) + 4, longest)
    stage = dataclasses.replace(stage, max_seq_len=limit)
    src = load_stage(stage, recipe.data, run_stores([stage], recipe.data, tok, None, tmp_path, None))
    own, kl = src.samples.parts[0].sides(0)
    assert len(kl["input_ids"]) == limit and prompt_of(kl) == prompt_of(own)


@pytest.mark.parametrize(("row", "message"), [
    ({"prompt": "p", "completion": " c"}, r"kto\.jsonl:2: a kto stage's row needs 'label': true \(a desirable "
     r"completion\) or false"),
    ({"prompt": "p", "completion": " c", "label": "yes"}, r"kto\.jsonl:2: 'label' is 'yes', but a kto stage's label "
     r"must be true or false"),
    ({"prompt": "p", "completion": " c", "label": 1}, r"kto\.jsonl:2: 'label' is 1, but a kto stage's label"),
])
def test_a_row_without_a_true_false_label_is_refused_naming_it(tmp_path: Path, models: dict[str, str], tok: Any,
                                                              row: dict[str, Any], message: str) -> None:
    path = write(tmp_path / "kto.jsonl", [{"prompt": "q", "completion": " a", "label": True}, row])
    stage, recipe = kto_stage(tmp_path, models["text"], path, micro=2)
    with pytest.raises(ToolkitError, match=message):
        load_stage(stage, recipe.data, run_stores([stage], recipe.data, tok, None, tmp_path, None))
