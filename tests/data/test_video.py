"""Video rows (toolkit/data/frames.py, toolkit/data/vision.py, toolkit/data/collate.py): qwen-vl-utils' sampling
rules, the frame store (decoded once), the processor's own rendering and the model's own rotary ids, padded and
packed, on the built-in tiny Qwen2.5-VL and Qwen3-VL; bad video rows refused with advice that works."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, BatchFeature
from transformers.video_utils import VideoMetadata

from tests.helpers.video_files import frame_levels, level, write_frames, write_video
from toolkit.builtin.models import TINY_VL_MODEL, materialize_builtin
from toolkit.builtin.vl_model import write_tiny_qwen3_vl
from toolkit.data import frames as frame_store
from toolkit.data.collate import VLCollator, VLPackedCollator
from toolkit.data.frames import VideoSettings, frame_size, frames, sample_count, sample_indices
from toolkit.data.plan import packed_row
from toolkit.data.vision import VIDEO_REF, VLEncoder, process_videos, tokens_per_second
from toolkit.errors import ToolkitError
from toolkit.model.load import load_processor

SMALL = VideoSettings(min_pixels=28 * 28 * 4, max_pixels=56 * 56 * 4)  # 56x84-ish frames: a few tokens each


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"qwen2.5-vl": Path(materialize_builtin(TINY_VL_MODEL, root)),
            "qwen3-vl": write_tiny_qwen3_vl(root / "tiny-qwen3-vl")}


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("media")
    write_video(base / "clip.mp4", 20, fps=10)
    write_video(base / "long.mp4", 40, fps=20)
    Image.new("RGB", (56, 84), "red").save(base / "red.png")
    Image.new("RGB", (84, 56), "blue").save(base / "blue.png")
    return base


def encoder(processor: Any, store: Path, video: VideoSettings = SMALL) -> VLEncoder:
    return VLEncoder(processor, train_on="assistant", video=video, frame_store=store,
                     tokens_per_second=tokens_per_second(processor))


def chat(*parts: dict[str, Any], answer: str = "It gets brighter.") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What happens?"}]},
            {"role": "assistant", "content": answer}]


# --- sampling: qwen-vl-utils' rules -----------------------------------------------------------------------------

@pytest.mark.parametrize(("total", "video_fps", "given", "expected"), [
    (20, 10, {}, 4),                       # 2 s x fps 2 = 4
    (100, 10, {}, 20),                     # 10 s x 2
    (100, 10, {"max_frames": 9}, 8),       # max_frames floored to a multiple of 2
    (7, 10, {}, 4),                        # 1.4 frames: raised to min_frames 4
    (3, 10, {}, 2),                        # min_frames above the frames it has: all of them, floored to 2
    (100, 10, {"nframes": 5}, 4),          # nframes rounded to a multiple of 2 (round half to even)
    (100, 10, {"fps": 0.5, "min_frames": 7}, 8),  # min_frames ceiled to 8, above 10 s x 0.5
])
def test_frame_counts_follow_qwen_vl_utils(total: int, video_fps: float, given: dict[str, Any],
                                           expected: int) -> None:
    assert sample_count(VideoSettings().over(given, "w"), total, video_fps, "w") == expected


def test_too_few_frames_and_both_fps_and_nframes_are_refused() -> None:
    with pytest.raises(ToolkitError, match=r"w: 1 frame\(s\) in the video, and 0 would be sampled"):
        sample_count(VideoSettings(), 1, 10, "w")
    with pytest.raises(ToolkitError, match="takes fps or nframes, not both"):
        VideoSettings(fps=1).over({"nframes": 4, "fps": 2}, "w")
    with pytest.raises(ToolkitError, match=r"unknown video setting\(s\) \['frames'\]"):
        VideoSettings().over({"frames": 4}, "w")


def test_frame_size_budgets() -> None:
    """Defaults: at least 128 tokens' pixels a frame (a 64x48 video grows to 392x280 for 28-pixel merges); a
    given max_pixels and the total_pixels budget only lower the size."""
    assert frame_size(VideoSettings(), 48, 64, 4, 28, "w") == (280, 392)
    h, w = frame_size(VideoSettings(min_pixels=28 * 28, max_pixels=56 * 56), 480, 640, 4, 28, "w")
    assert h % 28 == w % 28 == 0 and h * w <= 56 * 56
    h2, w2 = frame_size(VideoSettings(min_pixels=28 * 28, total_pixels=4 * 28 * 28 * 8), 480, 640, 16, 28, "w")
    assert h2 * w2 <= 4 * 28 * 28 * 8 / 16 * 2
    with pytest.raises(ToolkitError, match=r"min_pixels .* is above its max_pixels"):
        frame_size(VideoSettings(min_pixels=10_000, max_pixels=1_000), 48, 64, 4, 28, "w")


def test_a_video_is_decoded_once_into_the_store_with_the_frames_asked_for(media: Path, tmp_path: Path) -> None:
    """The sampled frames are the frames qwen-vl-utils picks (linspace indices, read back by their grey level),
    resized once; the same video and settings come back from the store without decoding, other settings or a
    changed file decode again."""
    store = tmp_path / "frames"
    before = frame_store.DECODES["files"]
    got = frames("clip.mp4", media, SMALL, 28, store, "w")
    assert got.meta["indices"] == sample_indices(20, 4) == [0, 6, 13, 19]
    assert got.meta["fps"] == 10 and got.meta["sampled_fps"] == 2.0 and got.meta["total_frames"] == 20
    stored = got.array()
    assert stored.shape[0] == 4 and stored.shape[1] % 28 == stored.shape[2] % 28 == 0
    assert np.allclose(frame_levels(stored), [level(i) for i in got.meta["indices"]], atol=3)
    assert frames("clip.mp4", media, SMALL, 28, store, "w").folder == got.folder
    assert frame_store.DECODES["files"] == before + 1
    other = frames("clip.mp4", media, SMALL.over({"nframes": 6}, "w"), 28, store, "w")
    assert other.folder != got.folder and other.meta["indices"] == sample_indices(20, 6)
    copy = tmp_path / "copy"
    write_video(copy / "clip.mp4", 20, fps=10, size=(48, 64))  # same name, other content
    assert frames("clip.mp4", copy, SMALL, 28, store, "w").folder != got.folder
    assert frame_store.DECODES["files"] == before + 3


def test_a_frame_list_is_a_video(tmp_path: Path) -> None:
    """A list of images is a video: padded to an even count with its last frame, timed at its fps (else 2)."""
    paths = write_frames([tmp_path / f"f{k}.png" for k in range(3)])
    got = frames([p.name for p in paths], tmp_path, SMALL.over({"fps": 1.0}, "w"), 28, tmp_path / "s", "w")
    assert frame_levels(got.array()) == [level(0), level(1), level(2), level(2)]
    assert got.meta["indices"] == [0, 1, 2, 3] and got.meta["sampled_fps"] == 1.0


def test_video_pixels_have_the_processor_layout(models: dict[str, Path], tmp_path: Path) -> None:
    """A video of two identical frames gives the image processor's own patches of that frame (transformers' video
    layout puts frame pairs where an image repeats itself), so the tower sees the frames as the processor lays
    them out."""
    processor = load_processor(str(models["qwen2.5-vl"]), trust_remote_code=False, chat_template=None)
    Image.new("RGB", (56, 84), (200, 30, 90)).save(tmp_path / "a.png")
    stored = frames(["a.png", "a.png"], tmp_path, SMALL, 28, tmp_path / "s", "w")
    pixels, grid, seconds = process_videos(processor, [VIDEO_REF + str(stored.folder)])
    frame = Image.fromarray(np.array(stored.array()[0]))
    ref = processor.image_processor(images=[frame], do_resize=False, return_tensors="pt")
    assert grid.tolist() == ref["image_grid_thw"].tolist()
    torch.testing.assert_close(pixels, ref["pixel_values"], rtol=0, atol=1e-5)
    assert seconds.dtype == torch.float32 and seconds.tolist() == [1.0]  # 2 frames / 2 fps, never an int


# --- the processor's rendering, the model's rotary ids, padded and packed -----------------------------------------

class StoredFramesVideoProcessor:
    """transformers' video-processor role for frames already sampled and resized (the tiny processors have none:
    transformers' video processors need torchvision); its pixels are `process_videos`'."""

    def __init__(self, processor: Any, refs: list[str]) -> None:
        ip = processor.image_processor
        self.merge_size, self.temporal_patch_size = ip.merge_size, ip.temporal_patch_size
        self.pixels, self.grids, _ = process_videos(processor, refs)

    def __call__(self, videos: Any, **kwargs: Any) -> BatchFeature:
        return BatchFeature({"pixel_values_videos": self.pixels, "video_grid_thw": self.grids,
                             "video_metadata": kwargs.get("video_metadata")})


def processor_inputs(processor: Any, messages: list[dict[str, Any]], sample: dict[str, Any]) -> dict[str, Any]:
    """The model's own processor on the row's rendering and media (the stored frames with their metadata)."""
    refs = [p for p in sample.get("images", []) if p.startswith(VIDEO_REF)]
    images = [Image.open(p).convert("RGB") for p in sample.get("images", []) if not p.startswith(VIDEO_REF)]
    kwargs: dict[str, Any] = {}
    if refs:
        metas = [json.loads((Path(r.removeprefix(VIDEO_REF)) / "meta.json").read_text()) for r in refs]
        processor.video_processor = StoredFramesVideoProcessor(processor, refs)
        kwargs["videos"] = [list(np.load(Path(r.removeprefix(VIDEO_REF)) / "frames.npy")) for r in refs]
        kwargs["video_metadata"] = [VideoMetadata(total_num_frames=m["total_frames"], fps=m["fps"],
                                                  frames_indices=m["indices"]) for m in metas]
    if images:
        kwargs["images"] = images
    text = processor.apply_chat_template(messages, tokenize=False)
    try:
        return dict(processor(text=[text], return_tensors="pt", **kwargs))
    finally:
        processor.__dict__.pop("video_processor", None)


@pytest.mark.parametrize("arch", ["qwen2.5-vl", "qwen3-vl"])
def test_video_rows_match_the_processor_and_get_rope_index(arch: str, models: dict[str, Path], media: Path,
                                                           tmp_path: Path) -> None:
    """Video, mixed image + video, several-image (one turn and across turns) and text rows: each row's tokens are
    the model's own processor's for the same frames (Qwen3-VL: its timestamps), each row's rotary ids in a packed
    row are `get_rope_index`'s on the processor's output (Qwen2.5-VL: with second_per_grid_ts), and the packed row
    gives the padded batch's loss and gradients."""
    processor = load_processor(str(models[arch]), trust_remote_code=False, chat_template=None)
    model = AutoModelForImageTextToText.from_pretrained(models[arch], attn_implementation="sdpa")
    model.config.use_cache = model.config.get_text_config().use_cache = False
    enc = encoder(processor, tmp_path / "frames")
    video, image = {"type": "video"}, {"type": "image"}
    rows = [
        {"messages": chat(video), "videos": ["clip.mp4"]},
        {"messages": chat(image, video, answer="Red, then grey."), "images": ["red.png"], "videos": ["long.mp4"]},
        {"messages": [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi."}]},
        {"messages": [*chat(image, image, answer="Red and blue."),
                      {"role": "user", "content": [video, {"type": "text", "text": "And this?"}]},
                      {"role": "assistant", "content": "Grey."}],
         "images": ["red.png", "blue.png"], "videos": [{"video": "clip.mp4", "nframes": 6}]},
    ]
    batch = enc.encode(rows, list(range(len(rows))), lambda n: f"row {n}", media)
    samples = [batch.sample(i) for i in range(len(rows))]
    packed = VLPackedCollator(processor, model.config)([packed_row(samples)])
    padded = VLCollator(processor)(samples)
    start, seconds = 0, []
    for row, sample in zip(rows, samples, strict=True):
        n = len(sample["input_ids"])
        if "images" in sample:
            messages = [dict(m) for m in row["messages"]]
            ref = processor_inputs(processor, messages, sample)
            assert ref["input_ids"][0].tolist() == sample["input_ids"]
            extra = {k: ref[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in ref}
            seconds += list(ref.get("second_per_grid_ts", []))
            positions, _ = model.model.get_rope_index(ref["input_ids"], ref["mm_token_type_ids"], **extra)
            assert torch.equal(packed["position_ids"][1:, 0, start:start + n], positions[:, 0])
        start += n
    if arch == "qwen2.5-vl":  # the processor's, as floats (1.0 s per pair at 2 fps, 0.67 at 3)
        assert padded["second_per_grid_ts"].tolist() == pytest.approx([float(t) for t in seconds], rel=1e-6)
        assert sorted(set(padded["second_per_grid_ts"].tolist())) != [1.0] or len(seconds) == 0
    else:  # Qwen3-VL times frames by their text timestamps
        assert "second_per_grid_ts" not in padded and not seconds

    def loss_and_grads(b: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad()
        loss = model(**b, num_items_in_batch=torch.tensor(1.0)).loss
        loss.backward()
        return loss.item(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    loss_padded, grads_padded = loss_and_grads(padded)
    loss_packed, grads_packed = loss_and_grads(packed)
    assert loss_packed == pytest.approx(loss_padded, rel=1e-6)
    assert any("visual" in k for k in grads_packed)
    for k, g in grads_padded.items():
        torch.testing.assert_close(grads_packed[k], g, rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_video_run_feeds_every_batch_an_image_and_a_video(packed: bool, models: dict[str, Path], media: Path,
                                                            tmp_path: Path) -> None:
    """In a run with video rows the tower runs on images and on videos in every forward (a masked dummy of each
    where a batch has none), so ZeRO-3 / FSDP ranks gather the same parameters: a text batch and a video-only batch
    get the dummies, which change no logit of the real tokens and no loss."""
    processor = load_processor(str(models["qwen2.5-vl"]), trust_remote_code=False, chat_template=None)
    model = AutoModelForImageTextToText.from_pretrained(models["qwen2.5-vl"], attn_implementation="sdpa").eval()
    model.config.use_cache = model.config.get_text_config().use_cache = False
    rows = [{"messages": chat({"type": "video"}), "videos": ["clip.mp4"]},
            {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}]
    batch = encoder(processor, tmp_path / "f").encode(rows, [0, 1], lambda n: f"row {n}", media)
    video, text = batch.sample(0), batch.sample(1)

    def collate(samples: list[dict[str, Any]], **kw: Any) -> dict[str, torch.Tensor]:
        if packed:
            return VLPackedCollator(processor, model.config, **kw)([packed_row(samples)])
        return VLCollator(processor, **kw)(samples)

    for samples in ([text], [video]):
        with_dummies = collate(samples, videos=True)
        plain = collate(samples, dummy_image=False)
        assert "pixel_values" in with_dummies and "pixel_values_videos" in with_dummies
        n = plain["input_ids"].shape[1]
        with torch.no_grad():
            a = model(**with_dummies)
            b = model(**plain) if "pixel_values_videos" in plain else None
        if b is not None:
            torch.testing.assert_close(a.logits[:, :n], b.logits, rtol=1e-5, atol=1e-5)
    image_run = collate([text])  # an image run's text batch: the dummy image only, as before
    assert "pixel_values" in image_run and "pixel_values_videos" not in image_run


def test_temporal_positions_that_would_collapse_are_refused(models: dict[str, Path], media: Path,
                                                            tmp_path: Path) -> None:
    """Qwen2.5-VL spaces frame pairs by tokens_per_second x 2 / fps positions, floored: above that many fps two
    pairs share a position. Refused naming the fps that fits; at that fps every pair has its own position."""
    processor = load_processor(str(models["qwen2.5-vl"]), trust_remote_code=False, chat_template=None)
    most = tokens_per_second(processor) * 2  # the tiny config's tokens_per_second
    row = {"messages": chat({"type": "video"}), "videos": ["long.mp4"]}  # 40 frames at 20 fps
    fast = encoder(processor, tmp_path / "f", SMALL.over({"fps": most + 2}, "w"))
    with pytest.raises(ToolkitError, match=rf"row 0: videos\[0\]: frames sampled at {most + 2:g} fps would share "
                                           rf"temporal positions .* set video fps to at most {most:g}"):
        fast.encode([row], [0], lambda n: f"row {n}", media)
    sample = encoder(processor, tmp_path / "f", SMALL.over({"fps": most}, "w")).encode(
        [row], [0], lambda n: f"row {n}", media).sample(0)
    model_config = AutoModelForImageTextToText.from_pretrained(models["qwen2.5-vl"]).config
    positions = VLPackedCollator(processor, model_config)([sample])["position_ids"][1, 0]
    ids = torch.tensor(sample["input_ids"])
    temporal = positions[ids == processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")].unique()
    assert len(temporal) == sample["image_grid_thw"][0][0]  # one position per frame pair


# --- bad video rows: refused in one line, the advice applied --------------------------------------------------------

def test_bad_video_rows_and_their_advice(models: dict[str, Path], media: Path, tmp_path: Path) -> None:
    processor = load_processor(str(models["qwen2.5-vl"]), trust_remote_code=False, chat_template=None)
    enc = encoder(processor, tmp_path / "f")

    def encode(row: dict[str, Any], *, max_tokens: int | None = None, with_: VLEncoder = enc) -> Any:
        kw = {} if max_tokens is None else {"max_tokens": max_tokens}
        return with_.encode([row], [0], lambda n: f"rows.jsonl:{n + 1}", media, **kw)

    with pytest.raises(ToolkitError, match=r"^rows.jsonl:1: videos\[0\]: video file .*missing.mp4 does not exist"):
        encode({"messages": chat({"type": "video"}), "videos": ["missing.mp4"]})
    empty = media / "empty.mp4"
    empty.write_bytes(b"")
    with pytest.raises(ToolkitError, match=r"^rows.jsonl:1: videos\[0\]: video file .*empty.mp4 could not be "
                                           r"decoded .*re-encode it or drop the row"):
        encode({"messages": chat({"type": "video"}), "videos": ["empty.mp4"]})
    write_video(media / "one.mp4", 1)
    with pytest.raises(ToolkitError, match=r"1 frame\(s\) in the video, and 0 would be sampled"):
        encode({"messages": chat({"type": "video"}), "videos": ["one.mp4"]})
    with pytest.raises(ToolkitError, match=r"^rows.jsonl:1: 2 \{\"type\": \"video\"\} placeholder\(s\) .* but 1 "
                                           r"video\(s\) in 'videos'"):
        encode({"messages": chat({"type": "video"}, {"type": "video"}), "videos": ["clip.mp4"]})
    with pytest.raises(ToolkitError, match=r"'https://example.com/a.mp4' is a URL; videos are read from files"):
        encode({"messages": chat({"type": "video"}), "videos": ["https://example.com/a.mp4"]})
    assert encode({"messages": chat({"type": "video"}), "videos": ["clip.mp4"]}).lengths[0] > 0  # the fix

    big = VideoSettings(min_pixels=56 * 56 * 4, max_pixels=56 * 56 * 4, nframes=8)
    row = {"messages": chat({"type": "video"}), "videos": ["clip.mp4"]}
    with pytest.raises(ToolkitError, match=r"its video frames alone are \d+ tokens \(8 frames, \d+ tokens per frame "
                                           r"pair\), over the longest max_seq_len \(64\); set video.max_frames to at "
                                           r"most (\d+)") as refused:
        encode(row, max_tokens=64, with_=encoder(processor, tmp_path / "f", big))
    most = int(str(refused.value).split("video.max_frames to at most ")[1].split(" ")[0])
    fixed = encoder(processor, tmp_path / "f", big.over({"fps": 2, "max_frames": most}, "w"))
    got = encode(row, max_tokens=64, with_=fixed)
    assert got.grids[0][0][0] * 2 <= most  # the frames asked for, and their tokens fit


def test_video_settings_reach_the_store_per_entry_and_stage() -> None:
    """`video:` of a data entry wins over its stage's, which wins over data.video; each setting changes the
    entry (so the store key): a short-to-long curriculum is two stages with two max_frames."""
    from toolkit.config.schema import StageConfig

    stage = StageConfig.model_validate({"name": "s", "video": {"max_frames": 8, "fps": 1},
                                        "data": [{"path": "a.jsonl", "video": {"fps": 2}}, "b.jsonl"]})
    assert [dict(e.video) for e in stage.entries] == [{"max_frames": 8, "fps": 2}, {"max_frames": 8, "fps": 1}]
    longer = StageConfig.model_validate({"name": "t", "video": {"max_frames": 32}, "data": ["b.jsonl"]})
    assert longer.entries[0] != stage.entries[1]


# --- a run: a short-to-long video curriculum, decoded once --------------------------------------------------------

@pytest.mark.slow
def test_a_video_curriculum_trains_and_a_warm_relaunch_decodes_nothing(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Two stages on the same video rows, at most 4 then 8 frames a video: each stage's rows are prepared once
    (each video decoded once per stage setting), its data line counts its video tokens and frames, and it trains;
    a second launch sharing the cache decodes nothing."""
    import math
    import re

    import yaml

    from tests.helpers.inprocess import Call, invoke
    from tests.helpers.video_files import video_recipe, write_video_dataset
    from toolkit.metrics.log import read_metrics

    data = write_video_dataset(tmp_path / "data", 16)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(video_recipe(data, tmp_path / "run", steps=1)))
    before = frame_store.DECODES["files"]
    rc, stderr = invoke(Call(["--config", str(recipe)], tmp_path / "run"), tmp_path, monkeypatch)
    assert rc == 0, stderr[-3000:]
    assert frame_store.DECODES["files"] - before == 2 * 3  # 3 video files, once per stage setting (frame lists
    losses = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl", "train")]  # are not decoded)
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    stored = sorted((tmp_path / ".toolkit-cache" / "tokenized" / "frames").glob("*/meta.json"))
    counts = sorted({json.loads(m.read_text())["frames"] for m in stored})
    assert counts[-1] == 8 and 4 in counts  # stage 'short' capped at 4 frames, 'long' at 8
    said = {m[0]: (int(m[1]), int(m[2])) for m in re.findall(
        r"stage '(\w+)' data: .*; (\d+) video tokens \((\d+) frames\) in its kept rows", caplog.text)}
    assert said.keys() == {"short", "long"} and said["short"][1] < said["long"][1]
    assert said["short"][0] == said["short"][1] // 2 * 4  # 56x56 frames: 4 tokens a frame pair
    recipe.write_text(yaml.safe_dump(video_recipe(data, tmp_path / "again", steps=1)))
    before = frame_store.DECODES["files"]
    rc, stderr = invoke(Call(["--config", str(recipe)], tmp_path / "again"), tmp_path, monkeypatch)
    assert rc == 0, stderr[-3000:]
    assert frame_store.DECODES["files"] == before  # warm: the token stores and frames are there
    assert [r["loss"] for r in read_metrics(tmp_path / "again" / "metrics.jsonl", "train")] == losses


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_video_curriculum_on_two_processes_matches_one(strategy: str, tmp_path_factory: pytest.TempPathFactory
                                                       ) -> None:
    """Video, image + video, frame-list and text rows, a short-to-long curriculum (4 then 8 frames, stage 'long'
    easy_to_hard by its rows' sampled frames, as the 1-process resume test's): 2 processes
    give the single process's losses and final adapter (fp32); the 2-process launch, sharing the reference's
    cache, prepares nothing again (no frame is decoded: the frame store gains no entry). Under ZeRO-3, the most
    demanding strategy, the 2-process run keeps a checkpoint after each of its 4 steps (across the stage boundary)
    and is resumed from each on 2 processes: the later steps and the final adapter are the uninterrupted run's, to
    the last bit (tests/e2e/test_resume.py's check), and no resume prepares or decodes anything."""
    import yaml
    from safetensors.torch import load_file

    from tests.conftest import relaunch
    from tests.e2e.test_resume import assert_exact_from_every_checkpoint
    from tests.helpers.video_files import video_recipe, write_video_dataset
    from toolkit.metrics.log import read_metrics

    def curriculum(data: Path, out: Path) -> dict:
        recipe = video_recipe(data, out)
        recipe["stages"][1].update(order="easy_to_hard", difficulty={"by": "frames"})
        return recipe

    root = tmp_path_factory.getbasetemp() / "video-matrix"
    reference = root / "single"
    if not (reference / "final").is_dir():
        data = write_video_dataset(root / "data", 16)
        recipe = curriculum(data, reference)
        recipe["train"] = {**recipe["train"], "micro_batch_size": 4}  # 4 x 2 accum x 1 = 2 x 2 x 2 processes
        (root / "single.yaml").write_text(yaml.safe_dump(recipe))
        assert relaunch("single", [(["--config", str(root / "single.yaml")], root / "single.log")],
                        num_processes=1) == [0], (root / "single.log").read_text()[-4000:]
    frames_dir = root / ".toolkit-cache" / "tokenized" / "frames"
    stored = sorted(frames_dir.iterdir())
    out = root / strategy
    recipe = curriculum(root / "data" / "videos.jsonl", out)
    resumed = strategy == "zero3"
    if resumed:  # what is saved does not change what trains: the run still equals the single process's
        recipe["checkpoint"] = {"save_steps": 1, "keep_last": 10}
    (root / f"{strategy}.yaml").write_text(yaml.safe_dump(recipe))
    argv, log = ["--config", str(root / f"{strategy}.yaml")], root / f"{strategy}.log"
    assert relaunch(strategy, [(argv, log)], num_processes=2) == [0], log.read_text()[-4000:]
    assert sorted(frames_dir.iterdir()) == stored  # warm: nothing decoded again

    def losses(run: Path) -> list[float]:
        return [r["loss"] for r in read_metrics(run / "metrics.jsonl", "train")]

    assert len(losses(out)) == 4 and losses(out) == pytest.approx(losses(reference), rel=1e-4)
    final, ref = (load_file(run / "final" / "adapter_model.safetensors") for run in (out, reference))
    assert final.keys() == ref.keys() and any("visual.merger" in k for k in final)
    for k in ref:
        torch.testing.assert_close(final[k], ref[k], rtol=1e-3, atol=1e-5, msg=f"{strategy}: {k}")
    if resumed:
        resumes = assert_exact_from_every_checkpoint(strategy, out, argv, steps=4, mixed_precision="no")
        assert sorted(frames_dir.iterdir()) == stored  # the resumes decoded no video: the frame store is as it was
        for run in resumes:  # and prepared no token store (each read the reference's, warm)
            assert "data: prepared" not in run.with_suffix(".log").read_text(), run
