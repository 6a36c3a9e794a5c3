"""Tests for the deterministic dummy curriculum datasets."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from toolkit.builtin.dummy_data import _COLOURS as COLOURS
from toolkit.builtin.dummy_data import write_dummy_data, write_dummy_vl_video

ROLES = {"system", "user", "assistant"}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_writes_both_stages(tmp_path: Path) -> None:
    paths = write_dummy_data(tmp_path / "data", 50)
    assert set(paths) == {"stage1", "stage2"}
    assert paths["stage1"] == tmp_path / "data" / "stage1.jsonl"
    assert paths["stage2"] == tmp_path / "data" / "stage2.jsonl"
    for path in paths.values():
        assert path.is_file()
        assert len(_rows(path)) == 50


def test_single_sample(tmp_path: Path) -> None:
    paths = write_dummy_data(tmp_path, 1)
    assert [len(_rows(p)) for p in paths.values()] == [1, 1]


def test_deterministic(tmp_path: Path) -> None:
    a = write_dummy_data(tmp_path / "a", 40, seed=3)
    b = write_dummy_data(tmp_path / "b", 40, seed=3)
    c = write_dummy_data(tmp_path / "c", 40, seed=4)
    for stage in ("stage1", "stage2"):
        assert a[stage].read_bytes() == b[stage].read_bytes()
        assert a[stage].read_bytes() != c[stage].read_bytes()


def test_row_schema(tmp_path: Path) -> None:
    paths = write_dummy_data(tmp_path, 200)
    for path in paths.values():
        for row in _rows(path):
            assert set(row) == {"messages", "difficulty"}
            assert isinstance(row["difficulty"], float)
            messages = row["messages"]
            assert all(set(m) == {"role", "content"} and m["role"] in ROLES for m in messages)
            assert all(isinstance(m["content"], str) and m["content"] for m in messages)
            assert any(m["role"] == "assistant" for m in messages)
            assert messages[-1]["role"] == "assistant"
            assert all(m["role"] != "system" for m in messages[1:])


def test_stage_shapes(tmp_path: Path) -> None:
    paths = write_dummy_data(tmp_path, 300)
    stage1, stage2 = _rows(paths["stage1"]), _rows(paths["stage2"])
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in stage1)
    assert any(len([m for m in r["messages"] if m["role"] == "assistant"]) > 1 for r in stage2)
    assert any(r["messages"][0]["role"] == "system" for r in stage2)

    def length(row: dict) -> int:
        return sum(len(m["content"]) for m in row["messages"])

    lengths = sorted(length(r) for r in stage2)
    assert lengths[-1] > 3 * lengths[len(lengths) // 2]  # long tail
    assert max(length(r) for r in stage1) < lengths[len(lengths) // 2]


def test_arithmetic_answers_are_correct(tmp_path: Path) -> None:
    for row in _rows(write_dummy_data(tmp_path, 100)["stage1"]):
        a, op, b, _, value = row["messages"][1]["content"].rstrip(".").split(" ")
        assert (int(a) + int(b) if op == "+" else int(a) - int(b)) == int(value)


@pytest.mark.parametrize("bad", [0, -1])
def test_rejects_non_positive(tmp_path: Path, bad: int) -> None:
    with pytest.raises(ValueError, match="num_samples"):
        write_dummy_data(tmp_path, bad)


def test_pairs_are_trl_explicit_conversational_and_plainly_ranked(tmp_path: Path) -> None:
    """`dummy:pairs`: as many pairs as the other files have rows, deterministic by seed, each a question with its
    right answer chosen and a wrong one rejected."""
    from toolkit.builtin.dummy_data import write_dummy_pairs

    path = write_dummy_pairs(tmp_path / "a", 40, seed=3)
    rows = _rows(path)
    assert path.name == "pairs.jsonl" and len(rows) == 40
    assert path.read_text() == write_dummy_pairs(tmp_path / "b", 40, seed=3).read_text()
    assert path.read_text() != write_dummy_pairs(tmp_path / "c", 40, seed=4).read_text()
    for row in rows:
        assert set(row) == {"prompt", "chosen", "rejected", "difficulty"}
        [user], [chosen], [rejected] = row["prompt"], row["chosen"], row["rejected"]
        assert (user["role"], chosen["role"], rejected["role"]) == ("user", "assistant", "assistant")
        a, op, b = user["content"].removeprefix("What is ").rstrip("?").split()
        right = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert chosen["content"] == f"{a} {op} {b} = {right}."
        wrong = int(rejected["content"].rsplit("= ", 1)[1].rstrip("."))
        assert rejected["content"].startswith(f"{a} {op} {b} = ") and wrong != right


def test_use_dummy_data_gives_preference_stages_the_pairs() -> None:
    from toolkit.builtin.dummy_data import use_dummy_data
    from toolkit.config.schema import StageConfig

    stages = [StageConfig(name="sft", data=["x.jsonl"]), StageConfig(name="dpo", data=["y.jsonl"], objective="dpo"),
              StageConfig(name="more", data=["z.jsonl"])]
    use_dummy_data(stages, vision=False)
    assert [s.paths for s in stages] == [["dummy:stage1"], ["dummy:pairs"], ["dummy:stage2"]]


def test_letters_are_prompt_only_rows_whose_pass_rate_the_tiny_model_spreads(tmp_path: Path,
                                                                             models: dict[str, str]) -> None:
    """`dummy:letters`: deterministic prompt-only rows with a letter for reference; on the tiny random Qwen3, sampled
    completions (the RL rollout, scored by the `contains` reward) hold a common letter far more often than a rare
    one: a task with pass rates to learn from and to order by."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.builtin.dummy_data import LETTERS_BY_FREQUENCY, write_dummy_letters
    from toolkit.evals.rewards import build_rewards
    from toolkit.evals.rollout import rollout

    path = write_dummy_letters(tmp_path / "a", 50, seed=1)
    rows = _rows(path)
    assert path.name == "letters.jsonl" and len(rows) == 50
    assert path.read_text() == write_dummy_letters(tmp_path / "b", 50, seed=1).read_text()
    assert path.read_text() != write_dummy_letters(tmp_path / "c", 50, seed=2).read_text()
    for row in rows:
        [user] = row["prompt"]
        assert set(row) == {"prompt", "reference", "difficulty"} and user["role"] == "user"
        assert row["reference"] in user["content"] and row["reference"] in LETTERS_BY_FREQUENCY
    assert len({r["reference"] for r in rows}) > 10

    tokenizer = AutoTokenizer.from_pretrained(models["text"])
    model = AutoModelForCausalLM.from_pretrained(models["text"], dtype=torch.float32)
    (contains,) = build_rewards([{"scorer": {"kind": "contains", "lower": True}}], key="stages.0.rewards",
                                recipe_dir=tmp_path, max_completion_length=4)
    common, rare = (next(r for r in rows if r["reference"] == c) for c in ("e", "z"))
    prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                             return_dict=False) for r in (common, rare)]
    out = rollout(model, prompts, [0, 1], num_generations=32, max_completion_length=4, temperature=1.0, top_p=1.0,
                  seed=0, step=0, eos_ids=[tokenizer.eos_token_id], pad_id=tokenizer.pad_token_id,
                  prompts_per_batch=2)
    texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
    scores = contains(["p"] * 64, texts, out.completion_ids, {"reference": ["e"] * 32 + ["z"] * 32},
                      [f"letters.jsonl:{i}" for i in range(64)])
    common_rate, rare_rate = sum(scores[:32]) / 32, sum(scores[32:]) / 32  # type: ignore[arg-type]
    assert common_rate > rare_rate + 0.25 and 0 < common_rate < 1, (common_rate, rare_rate)


def test_use_dummy_data_gives_rl_stages_the_letters() -> None:
    from types import SimpleNamespace

    from toolkit.builtin.dummy_data import use_dummy_data

    stages = [SimpleNamespace(paths=["x.jsonl"], data=["x.jsonl"], objective=o) for o in ("sft", "grpo", "dpo")]
    use_dummy_data(stages, vision=False)  # type: ignore[arg-type]
    assert [s.data for s in stages] == [["dummy:stage1"], ["dummy:letters"], ["dummy:pairs"]]


def test_dummy_video_rows_are_prepared_without_a_video_decoder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """`dummy:vl_video` (the strategy matrix's video rows): deterministic; a video, an image and a video in one turn,
    an image in each of two turns, a video then an image; its videos are frame lists, so they are prepared where
    PyAV is not installed (the lean install) and nothing is decoded; 4 frames of 56x56 (2 frame pairs of 4 tokens),
    whose square moves the way the answer says."""
    from toolkit.builtin.models import TINY_VL_MODEL, materialize_builtin
    from toolkit.data import frames
    from toolkit.data.vision import VIDEO_REF, VLEncoder, tokens_per_second
    from toolkit.model.load import load_processor

    path = write_dummy_vl_video(tmp_path / "a", 8, seed=7)
    assert path == tmp_path / "a" / "vl_video.jsonl"
    assert path.read_bytes() == write_dummy_vl_video(tmp_path / "b", 8, seed=7).read_bytes()
    assert path.read_bytes() != write_dummy_vl_video(tmp_path / "c", 8, seed=8).read_bytes()
    processor = load_processor(materialize_builtin(TINY_VL_MODEL, tmp_path / "models"), trust_remote_code=False,
                               chat_template=None)
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError, as without the video extra
    decoded = frames.DECODES["files"]
    rows = _rows(path)
    encoder = VLEncoder(processor, train_on="assistant", frame_store=tmp_path / "frames",
                        tokens_per_second=tokens_per_second(processor))
    batch = encoder.encode(rows, list(range(len(rows))), lambda i: f"vl_video.jsonl:{i + 1}", path.parent)
    assert frames.DECODES["files"] == decoded
    kinds = [["video" if m.startswith(VIDEO_REF) else "image" for m in batch.sample(i)["images"]]
             for i in range(len(rows))]
    assert kinds == [["video"], ["image", "video"], ["image", "image"], ["video", "image"]] * 2
    assert [sum(m["role"] == "user" for m in r["messages"]) for r in rows] == [1, 1, 2, 2] * 2

    def square(frame: np.ndarray) -> tuple[float, str]:
        """The column the square's pixels (those off the grey background) centre on, and its colour's name."""
        ys, xs = np.nonzero(np.abs(frame.astype(int) - 128).sum(-1) > 30)
        rgb = np.median(frame[ys, xs], axis=0)
        return float(xs.mean()), min(COLOURS, key=lambda c: float(np.abs(rgb - COLOURS[c]).sum()))

    for i, row in enumerate(rows):
        sample = batch.sample(i)
        for ref, grid in zip(sample["images"], sample["image_grid_thw"], strict=True):
            if not ref.startswith(VIDEO_REF):
                continue
            pixels = np.load(Path(ref.removeprefix(VIDEO_REF)) / "frames.npy")
            assert pixels.shape == (4, 56, 56, 3) and list(grid) == [2, 4, 4]
            (first, colour), (last, _) = square(pixels[0]), square(pixels[-1])
            answer = row["messages"][1]["content"]
            assert f"square is {colour}." in answer or f"both are {colour}." in answer or \
                f"The {colour} square moves {'right' if last > first else 'left'}." == answer, (i, answer)


def test_dummy_vision_pairs_ask_about_their_prompt_s_image_and_video(tmp_path: Path) -> None:
    """`dummy:vl_pairs` (the VL strategy matrix's dpo stage): deterministic TRL vision pairs whose prompts hold an
    image, a frame-list video (with `VIDEO_PIXELS`), or both, in turn; the chosen answer is right about the picture's
    colour and the square's direction (read back from the written pixels), the rejected one is not."""
    from PIL import Image

    from toolkit.builtin.dummy_data import VIDEO_PIXELS, write_dummy_vl_pairs

    path = write_dummy_vl_pairs(tmp_path / "a", 9, seed=7)
    assert path == tmp_path / "a" / "vl_pairs.jsonl"
    assert path.read_bytes() == write_dummy_vl_pairs(tmp_path / "b", 9, seed=7).read_bytes()
    assert path.read_bytes() != write_dummy_vl_pairs(tmp_path / "c", 9, seed=8).read_bytes()

    def colour_of(rgb: np.ndarray) -> str:
        return min(COLOURS, key=lambda c: float(np.abs(rgb - COLOURS[c]).sum()))

    def square(frame: Path) -> tuple[float, str]:
        pixels = np.asarray(Image.open(tmp_path / "a" / frame).convert("RGB")).astype(int)
        ys, xs = np.nonzero(np.abs(pixels - 128).sum(-1) > 30)
        return float(xs.mean()), colour_of(np.median(pixels[ys, xs], axis=0))

    rows = _rows(path)
    for i, row in enumerate(rows):
        [user] = row["prompt"]
        parts = [p["type"] for p in user["content"]]
        assert parts == [["image", "text"], ["video", "text"], ["image", "video", "text"]][i % 3]
        good, bad = row["chosen"][0]["content"][0]["text"], row["rejected"][0]["content"][0]["text"]
        assert good != bad
        if "image" in parts:
            [image] = row["images"]
            centre = np.asarray(Image.open(tmp_path / "a" / image).convert("RGB"))
            picture = colour_of(centre[centre.shape[0] // 2, centre.shape[1] // 2].astype(int))
        if "video" in parts:
            [video] = row["videos"]
            assert video == {"video": video["video"], **VIDEO_PIXELS} and len(video["video"]) in (3, 4)
            (first, colour), (last, _) = square(video["video"][0]), square(video["video"][-1])
            direction = "right" if last > first else "left"
        if parts[0] == "image" and len(parts) == 2:
            assert good == f"It is {picture}.", (i, good)
        elif parts[0] == "video":
            assert good == f"The {colour} square moves {direction}.", (i, good)
        else:
            assert good == ("Yes." if picture == colour else "No."), (i, good, picture, colour)
