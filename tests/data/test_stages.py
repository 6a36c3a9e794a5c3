"""A stage's rows by difficulty (toolkit/data/stages.py:load_stage): `difficulty.by` (a named row field, or token
length over a `difficulty` key the rows also carry), `drop` of the easiest and hardest shares ranked over all the
stage's sources together, counted in the stage's data line, and packed rows built from what is left."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from transformers import AutoTokenizer

from toolkit.config.identity import resume_invariants
from toolkit.config.load import load_recipe
from toolkit.config.schema import Recipe
from toolkit.config.stages import resolve_stages
from toolkit.data.stages import load_stage, run_stores, stage_summary


def _rows(path: Path, n: int, offset: int) -> None:
    """n rows: `score` counts down, `difficulty` up, and the answer grows with the row (its length)."""
    rows = [{"messages": [{"role": "user", "content": f"q{offset + i}"},
                          {"role": "assistant", "content": "a " * (1 + offset + i)}],
             "difficulty": float(offset + i), "score": float(100 - offset - i)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _recipe(tmp_path: Path, model: str, **stage: Any) -> Recipe:
    _rows(tmp_path / "a.jsonl", 6, 0)
    _rows(tmp_path / "b.jsonl", 4, 6)
    tree = {"output_dir": str(tmp_path / "run"), "model": {"name_or_path": model},
            "data": {"max_seq_len": 512, "num_proc": 1, **stage.pop("data", {})},
            "stages": [{"name": "s", "data": [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], "max_steps": 1,
                        **stage}]}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(tree))
    return load_recipe(tmp_path / "recipe.yaml")


def _load(recipe: Recipe, model: str) -> tuple[Any, str]:
    [stage] = resolve_stages(recipe)
    stores = run_stores([stage], recipe.data, AutoTokenizer.from_pretrained(model), None, Path("unused"), None)
    src = load_stage(stage, recipe.data, stores)
    return src, stage_summary(stage, src, recipe.data)


def _questions(src: Any) -> list[int]:
    """Which rows (by the number in their question) the stage kept, in stage order."""
    out = []
    for part in src.samples.parts:
        out += [int(part.store.where(int(i)).split(":")[-1]) - 1 + (6 if part.store.source.entry.path.endswith(
            "b.jsonl") else 0) for i in part.selection.index]
    return out


def test_drop_ranks_all_sources_together_and_says_how_many(tmp_path: Path, models: dict[str, str]) -> None:
    recipe = _recipe(tmp_path, models["text"], order="easy_to_hard", difficulty={"by": "field", "field": "score"},
                     drop={"easiest": 0.2, "hardest": 0.1})
    src, line = _load(recipe, models["text"])
    # score = 100 - row: the easiest (lowest score) are the last rows of b.jsonl, the hardest row 0 of a.jsonl
    assert _questions(src) == [1, 2, 3, 4, 5, 6, 7]
    np.testing.assert_array_equal(src.difficulty, [99, 98, 97, 96, 95, 94, 93])
    assert "10 rows, 7 kept" in line and "3 dropped by difficulty (drop)" in line


def test_a_drop_by_a_models_score_keeps_every_row_and_plans_its_counts(tmp_path: Path,
                                                                      models: dict[str, str]) -> None:
    """The scores exist only at training: the stage keeps all its rows (the model ranks them all) and carries
    how many the drop will leave out at each end, which the data line says."""
    recipe = _recipe(tmp_path, models["text"], difficulty={"by": "ifd", "model": "current"},
                     drop={"easiest": 0.2, "hardest": 0.15})
    src, line = _load(recipe, models["text"])
    assert _questions(src) == list(range(10)) and src.difficulty is None
    assert src.dropped_by_score == (2, 1) and src.planned_rows == 7
    assert "drop by ifd of the current model: 2 easiest and 1 hardest of 10 rows once scored, 7 kept" in line


def test_by_length_ignores_the_rows_difficulty_and_hard_to_easy_keeps_it_descending(
        tmp_path: Path, models: dict[str, str]) -> None:
    recipe = _recipe(tmp_path, models["text"], order="hard_to_easy", difficulty={"by": "length"},
                     drop={"hardest": 0.5})
    src, line = _load(recipe, models["text"])
    assert src.difficulty is None  # the sampler sorts by length
    assert _questions(src) == [0, 1, 2, 3, 4]  # the five longest answers (rows 5-9) dropped
    assert "5 dropped by difficulty" in line


def test_packed_rows_are_built_from_the_kept_rows(tmp_path: Path, models: dict[str, str]) -> None:
    recipe = _recipe(tmp_path, models["text"], order="easy_to_hard", drop={"easiest": 0.3},
                     data={"packing": True, "max_seq_len": 64})
    src, _ = _load(recipe, models["text"])
    kept = {(j, m) for j, part in enumerate(src.samples.parts) for k in range(len(part))
            for m in part.selection.index[part.members(k)].tolist()}
    assert sum(len(p.selection.index) for p in src.samples.parts) == 7 and len(kept) == 7
    assert len(src.difficulty) == len(src.samples)  # a packed row's difficulty: its hardest member's


def test_the_new_keys_bind_a_checkpoint_only_when_set(tmp_path: Path, models: dict[str, str]) -> None:
    plain = resume_invariants(_recipe(tmp_path, models["text"]))
    assert "difficulty" not in plain["stages"][0] and "drop" not in plain["stages"][0]  # earlier hashes unchanged
    assert not {"identical_pairs", "completion_newline", "renderer"} & plain["data"].keys()  # defaults: unbound
    assert resume_invariants(_recipe(tmp_path, models["text"], data={"identical_pairs": "skip"}))["data"][
        "identical_pairs"] == "skip"  # dropping pairs changes what trains: bound when set
    dropped = resume_invariants(_recipe(tmp_path, models["text"], drop={"easiest": 0.1}))
    assert dropped["stages"][0]["drop"] == {"easiest": 0.1, "hardest": 0.0}
    by_field = resume_invariants(_recipe(tmp_path, models["text"], order="easy_to_hard",
                                         difficulty={"by": "field", "field": "score"}))
    assert by_field["stages"][0]["difficulty"] == {"by": "field", "field": "score"}  # as before difficulty.model
    scored = resume_invariants(_recipe(tmp_path, models["text"], order="easy_to_hard",
                                       difficulty={"by": "ifd", "model": "current"}))
    assert scored["stages"][0]["difficulty"] == {"by": "ifd", "field": None, "model": "current"}  # the scorer binds


@pytest.mark.parametrize("stage, message", [
    ({"order": "easy_to_hard", "difficulty": {"by": "loss"}}, "name the scorer with difficulty.model"),
    ({"order": "easy_to_hard", "difficulty": {"by": "loss", "model": "Base"}}, "Did you mean: base"),
    ({"order": "easy_to_hard", "difficulty": {"by": "field", "field": "x", "model": "base"}},
     "difficulty.model scores rows only with"),
    ({"order": "easy_to_hard", "difficulty": {"by": "length", "field": "x"}}, "read only with by: field"),
    ({"order": "easy_to_hard", "drop": {"easiest": -0.1}}, "drop.easiest"),
    ({"order": "easy_to_hard", "drop": {"hardest": 1}}, "drop.hardest"),
    ({"order": "easy_to_hard", "drop": {"hardest": 0.1, "oldest": 0.1}}, "oldest"),
])
def test_bad_values_name_the_key(tmp_path: Path, models: dict[str, str], stage: dict[str, Any],
                                 message: str) -> None:
    from toolkit.errors import ToolkitError

    with pytest.raises(ToolkitError, match=message):
        _recipe(tmp_path, models["text"], **stage)


# --- a video stage by its frames: difficulty: {by: frames} over the stage's own frame caps -------------------------

CLIP_SECONDS = (6, 2, 3, 4)
"""The clips of `_video_rows` (8 fps): at the default 2 fps, 12, 4, 6 and 8 frames (min_frames 4)."""


def _video_rows(folder: Path) -> Path:
    """Rows in this order: a 6 s clip, a text row, a 2 s clip, two clips (2 s and 3 s) in one row, a 4 s clip, a 3 s
    clip."""
    from tests.helpers.video_files import write_video

    clips = [write_video(folder / f"c{s}.mp4", 8 * s, fps=8).name for s in CLIP_SECONDS]

    def row(*videos: str) -> dict[str, Any]:
        tags = "<video>" * len(videos)
        return {"messages": [{"role": "user", "content": f"{tags}What happens?"},
                             {"role": "assistant", "content": "It gets brighter."}], "videos": list(videos)}

    rows = [row(clips[0]), {"messages": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]},
            row(clips[1]), row(clips[1], clips[2]), row(clips[3]), row(clips[2])]
    path = folder / "videos.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _video_stages(tmp_path: Path, model: str, stages: list[dict[str, Any]]) -> tuple[Recipe, list[Any], Any]:
    """The recipe of `stages` over `_video_rows` (56x56 frames: 4 tokens a frame pair), its resolved stages and
    their stores (prepared in memory)."""
    from toolkit.model.load import load_processor

    data = _video_rows(tmp_path) if not (tmp_path / "videos.jsonl").is_file() else tmp_path / "videos.jsonl"
    tree = {"output_dir": str(tmp_path / "run"), "model": {"name_or_path": model},
            "data": {"max_seq_len": 512, "num_proc": 1, "overlength": "drop",
                     "video": {"min_pixels": 3136, "max_pixels": 12544}},
            "stages": [{"data": [str(data)], "max_steps": 1, **stage} for stage in stages]}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(tree))
    recipe = load_recipe(tmp_path / "recipe.yaml")
    resolved = resolve_stages(recipe)
    processor = load_processor(model, trust_remote_code=False, chat_template=None)
    return recipe, resolved, run_stores(resolved, recipe.data, processor.tokenizer, processor, Path("unused"), None)


def test_a_video_stage_is_ordered_and_dropped_by_the_frames_its_own_caps_sample(tmp_path: Path,
                                                                              models: dict[str, str]) -> None:
    """`difficulty: {by: frames}` ranks a stage's rows by the frames its video settings sample (all of a row's
    videos; a text row has none): two stages over the same rows, at most 6 then 12 frames a video, rank them
    differently, and each caps its rows' frames and video tokens (the short-to-long curriculum's lever). A stage
    with no video is refused."""
    from toolkit.errors import ToolkitError

    recipe, stages, stores = _video_stages(tmp_path, models["vl"], [
        {"name": "short", "video": {"max_frames": 6}, "order": "easy_to_hard", "difficulty": {"by": "frames"}},
        {"name": "long", "video": {"max_frames": 12}, "order": "easy_to_hard", "difficulty": {"by": "frames"},
         "drop": {"hardest": 0.2}}])
    short, long = (load_stage(s, recipe.data, stores) for s in stages)
    # 2 fps, within [4, cap], a multiple of 2; the two-clip row sums its videos
    np.testing.assert_array_equal(short.difficulty, [6, 0, 4, 4 + 6, 6, 6])
    np.testing.assert_array_equal(long.difficulty, [0, 4, 4 + 6, 8, 6])  # the hardest fifth (the 6 s clip) dropped
    [s_part], [l_part] = short.samples.parts, long.samples.parts
    assert l_part.selection.index.tolist() == [1, 2, 3, 4, 5]
    # the caps change the rows' tokens: 56x56 frames, 4 tokens a frame pair; the text row is the same in both
    s_tokens, s_frames = s_part.store.video_counts()
    l_tokens, l_frames = l_part.store.video_counts()
    np.testing.assert_array_equal(s_tokens, s_frames // 2 * 4)
    np.testing.assert_array_equal(l_tokens, l_frames // 2 * 4)
    np.testing.assert_array_equal(l_part.store.lengths - s_part.store.lengths, l_tokens - s_tokens)
    assert (l_tokens - s_tokens).tolist() == [12, 0, 0, 0, 4, 0]
    said = [stage_summary(s, src, recipe.data) for s, src in zip(stages, (short, long), strict=True)]
    assert "6 rows, 6 kept" in said[0] and "64 video tokens (32 frames)" in said[0]
    assert "1 dropped by difficulty (drop)" in said[1] and "56 video tokens (28 frames)" in said[1]

    (tmp_path / "text").mkdir()
    text = _recipe(tmp_path / "text", models["text"], order="easy_to_hard", difficulty={"by": "frames"})
    with pytest.raises(ToolkitError, match=r"^Stage 's' has difficulty.by frames but none of its rows holds a video "
                                           r"\(.*a.jsonl, .*b.jsonl\); order it by length or a field"):
        _load(text, models["text"])


def test_a_stage_whose_frame_caps_cannot_fit_its_max_seq_len_is_refused_and_the_advice_fits(
        tmp_path: Path, models: dict[str, str]) -> None:
    """A first stage of 20 tokens given the long stage's 12 frames a video (the 6 s clip: 24 video tokens, which the
    long stage's 512 hold) could only drop that row unseen: loading the stage refuses it in one line naming the row,
    the stage and the max_frames that fits; with that max_frames the stage loads (rows over 20 tokens in all are
    dropped by data.overlength as usual)."""
    from toolkit.errors import ToolkitError

    long = {"name": "long", "video": {"max_frames": 12}}
    recipe, [short, _], stores = _video_stages(tmp_path, models["vl"], [
        {"name": "short", "max_seq_len": 20, "video": {"max_frames": 12}}, long])
    with pytest.raises(ToolkitError, match=r"videos.jsonl:1: its video frames alone are 24 tokens \(12 frames, 4 "
                                           r"tokens per frame pair\), over stage 'short''s max_seq_len \(20\); set "
                                           r"video.max_frames to at most (\d+) \(") as refused:
        load_stage(short, recipe.data, stores)
    most = int(re.search(r"at most (\d+)", str(refused.value)).group(1))
    recipe, [short, _], stores = _video_stages(tmp_path, models["vl"], [
        {"name": "short", "max_seq_len": 20, "video": {"max_frames": most}}, long])
    assert load_stage(short, recipe.data, stores).stats.rows == 6
