"""A vision pair's images encoded once (toolkit/model/shared_media.py, the collator's `SHARED_IMAGES`): the pair's
two sides score, bitwise, as each side alone with its images, on the built-in tiny Qwen2.5-VL (padded and packed)
and Qwen3-VL (padded: its deepstack levels are gathered too), while the vision tower runs once per micro-batch on
each distinct image; and the tower's gradient is the sum over the sides. Video pairs alike (`SHARED_VIDEOS`): the
tower's video call runs once on each distinct video's frames, and both sides score as each alone with its video.

The rows are the wild vision pairs (TRL's vision DPO rows and LLaMA-Factory's RLHF-V row, tests/assets/wild/), read
as a preference stage reads them, with small PNGs written here; the video pairs are those of
tests/data/test_pair_data.py `video_pair_folder` (a clip, a frame list, an image beside a video)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from transformers import AutoModelForImageTextToText

from tests.data.test_pair_data import VIDEO_DATA, stage_of, video_pair_entries, video_pair_folder, vision_folder
from toolkit.builtin.models import TINY_QWEN3_VL_MODEL, TINY_VL_MODEL, materialize_builtin
from toolkit.config.schema import DataEntry
from toolkit.data.collate import (
    SHARED_IMAGES,
    SHARED_VIDEOS,
    _vl_samples,
    batch_collator,
    pair_collator,
    sides_collator,
)
from toolkit.data.stages import load_stage, run_stores
from toolkit.data.vision import VIDEO_REF
from toolkit.evals.scoring import forward_sums
from toolkit.model.attention import SDPA_PACKED, check_packing_support
from toolkit.model.load import load_processing
from toolkit.model.shared_media import vision_tower

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Any, list[dict[str, Any]]]]:
    """Per built-in: (processor, fp32 model with the attention training gives it on CPU (packed rows attend per
    sample), the wild vision pairs as a stage's rows, each with its pair_index)."""
    tmp = tmp_path_factory.mktemp("vision_pairs")
    folder = vision_folder(tmp)
    out = {}
    for name in (TINY_VL_MODEL, TINY_QWEN3_VL_MODEL):
        path = materialize_builtin(name, tmp / "models")
        processor = load_processing(path, vision=True, trust_remote_code=False, chat_template=None)[0]
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32,  # as training loads it
                                                            attn_implementation=SDPA_PACKED).eval()
        model.config.use_cache = model.config.get_text_config().use_cache = False
        check_packing_support(model)
        (tmp / name[8:]).mkdir()
        stage, recipe = stage_of(tmp / name[8:], path, [folder / "trl_vision_dpo.jsonl"])
        stores = run_stores([stage], recipe.data, processor.tokenizer, processor, tmp, None)
        entries = (DataEntry(str(folder / "trl_vision_dpo.jsonl")),
                   DataEntry(None, dataset="rlhf_v", dataset_dir=str(folder)))
        rows = load_stage(dataclasses.replace(stage, entries=entries), recipe.data, stores).samples
        out[name] = processor, model, [dict(rows[i], pair_index=i) for i in range(len(rows))]
    return out


@pytest.mark.parametrize(("name", "packing"), [(TINY_VL_MODEL, False), (TINY_VL_MODEL, True),
                                               (TINY_QWEN3_VL_MODEL, False)],  # Qwen3-VL: its deepstack levels
                         ids=["qwen2.5-vl-padded", "qwen2.5-vl-packed", "qwen3-vl-padded"])
def test_a_vision_pair_s_sides_score_as_each_side_alone_and_the_tower_runs_once(
        pairs: dict[str, Any], name: str, packing: bool) -> None:
    processor, model, rows = pairs[name]
    inner = batch_collator(processor, vision=True, packing=packing, model_config=model.config)
    batch = pair_collator(inner)(rows)
    batch.pop("pair_index")
    distinct = {(p, tuple(g)) for r in rows for p, g in zip(r["images"], r["image_grid_thw"], strict=True)}
    # 3 pairs, 2 images (the TRL row and LLaMA-Factory's show the same file): each passed once, shown 6 times
    assert len(distinct) == 2 and len(batch[SHARED_IMAGES]) == 6
    patches = sum(t * h * w for _, (t, h, w) in distinct)
    assert batch["pixel_values"].shape[0] == patches and len(batch["image_grid_thw"]) == 6
    seen: list[int] = []
    hook = vision_tower(model).register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    try:
        with torch.no_grad():
            together, tokens = forward_sums(model, batch, CPU)
            assert seen == [patches]  # one tower run over the distinct images
            alone = [forward_sums(model, sides_collator(inner)([side]), CPU) for r in rows for side in _vl_samples(r)]
    finally:
        hook.remove()
    assert torch.equal(together, torch.cat([s[:1] for s, _ in alone]))  # exact: the same bits, side by side
    assert torch.equal(tokens, torch.cat([t[:1] for _, t in alone]))
    # each occurrence gets its own image's embeddings: told that every occurrence shows the first image, the pairs
    # of the other image score otherwise, the first image's pairs alike (each sequence shows one image)
    if packing:  # the hook is the same for both layouts: checked once
        return
    plan = batch[SHARED_IMAGES]
    first = plan[0]
    wrong = dict(batch, pixel_values=batch["pixel_values"][:first[1] * first[2] * first[3]],
                 **{SHARED_IMAGES: [[0, *first[1:]] for _ in plan]})
    with torch.no_grad():
        misled = forward_sums(model, wrong, CPU)[0]
    for n, (image, *_) in enumerate(plan):
        assert bool(misled[n] == together[n]) is (image == 0), n


def test_the_tower_s_gradient_is_the_sum_over_a_shared_image_s_occurrences(pairs: dict[str, Any]) -> None:
    """With the vision tower trained (a user's `trainable: [visual.merger]`, say), a pair's image passed once gets
    the gradient two runs of the tower, one per side, would give it: the gather's backward adds the sides'."""
    processor, model, rows = pairs[TINY_VL_MODEL]
    inner = sides_collator(batch_collator(processor, vision=True, packing=False))
    samples = [side for r in rows for side in _vl_samples(r)]
    tower = vision_tower(model)
    grads = []
    for batch in (pair_collator(inner)(rows), inner(samples)):  # images once per pair; once per side
        batch.pop("pair_index", None)
        model.zero_grad()
        forward_sums(model, batch, CPU)[0].sum().backward()
        grads.append({n: p.grad.clone() for n, p in tower.named_parameters() if p.grad is not None})
    assert SHARED_IMAGES not in inner(samples) and grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[1].items():
        torch.testing.assert_close(grads[0][name], grad, rtol=1e-5, atol=1e-7, msg=name)
    model.zero_grad()


@pytest.fixture(scope="module")
def video_pairs(pairs: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Per built-in: the video pairs as a preference stage's rows, each with its pair_index."""
    tmp = tmp_path_factory.mktemp("video_pairs")
    folder = video_pair_folder(tmp)
    out = {}
    for name, (processor, model, _) in pairs.items():
        (tmp / name[8:]).mkdir()
        stage, recipe = stage_of(tmp / name[8:], model.name_or_path, [folder / "trl.jsonl"], **VIDEO_DATA)
        stores = run_stores([stage], recipe.data, processor.tokenizer, processor, tmp, None)
        rows = load_stage(dataclasses.replace(stage, entries=video_pair_entries(folder)), recipe.data, stores).samples
        out[name] = [dict(rows[i], pair_index=i) for i in range(len(rows))]
    return out


@pytest.mark.parametrize(("name", "packing"), [(TINY_VL_MODEL, False), (TINY_VL_MODEL, True),
                                               (TINY_QWEN3_VL_MODEL, False)],
                         ids=["qwen2.5-vl-padded", "qwen2.5-vl-packed", "qwen3-vl-padded"])
def test_a_video_pair_s_sides_score_as_each_side_alone_and_the_tower_runs_once_per_video(
        pairs: dict[str, Any], video_pairs: dict[str, Any], name: str, packing: bool) -> None:
    """Three video pairs (a clip, a frame list, the clip beside an image): each distinct video's frames are passed
    once and encoded by one tower call over them (after the image call), and every side's fp32 log-prob is, bitwise,
    that side's scored alone with its video (Qwen2.5-VL: its `second_per_grid_ts` per occurrence)."""
    processor, model, _ = pairs[name]
    rows = video_pairs[name]
    inner = batch_collator(processor, vision=True, packing=packing, model_config=model.config, videos=True)
    batch = pair_collator(inner)(rows)
    batch.pop("pair_index")
    media = [(p, tuple(g)) for r in rows for p, g in zip(r["images"], r["image_grid_thw"], strict=True)]
    videos = {m for m in media if m[0].startswith(VIDEO_REF)}
    images = {m for m in media if not m[0].startswith(VIDEO_REF)}
    # 2 distinct videos shown 6 times (twice per pair), 1 image shown twice
    assert len(videos) == 2 and len(batch[SHARED_VIDEOS]) == 6 and len(batch["video_grid_thw"]) == 6
    assert len(images) == 1 and len(batch[SHARED_IMAGES]) == 2
    video_patches = sum(t * h * w for _, (t, h, w) in videos)
    image_patches = sum(t * h * w for _, (t, h, w) in images)
    assert batch["pixel_values_videos"].shape[0] == video_patches
    if "second_per_grid_ts" in batch:
        assert len(batch["second_per_grid_ts"]) == 6
    seen: list[int] = []
    hook = vision_tower(model).register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    try:
        with torch.no_grad():
            together, tokens = forward_sums(model, batch, CPU)
            assert seen == [image_patches, video_patches]  # one tower run over the image, one over the videos
            alone = [forward_sums(model, sides_collator(inner)([side]), CPU) for r in rows for side in _vl_samples(r)]
    finally:
        hook.remove()
    assert torch.equal(together, torch.cat([s[:1] for s, _ in alone]))  # exact: the same bits, side by side
    assert torch.equal(tokens, torch.cat([t[:1] for _, t in alone]))
    if packing:
        return
    # each occurrence gets its own video's embeddings: told that every occurrence shows the first video, the pairs
    # of the other video score otherwise, the first video's pairs alike
    plan = batch[SHARED_VIDEOS]
    first = plan[0]
    wrong = dict(batch, pixel_values_videos=batch["pixel_values_videos"][:first[1] * first[2] * first[3]],
                 **{SHARED_VIDEOS: [[0, *first[1:]] for _ in plan]})
    with torch.no_grad():
        misled = forward_sums(model, wrong, CPU)[0]
    for n, (video, *_) in enumerate(plan):
        assert bool(misled[n] == together[n]) is (video == 0), n
