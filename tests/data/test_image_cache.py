"""The image cache (toolkit/data/frames.py `ImageStore`, used by toolkit/data/vision.py `process_images` and the VL
collator): resized images cached by content give the processor's own pixel_values and grids bit for bit, a second
epoch or a relaunch resizes nothing, a corrupt entry is rebuilt, a full or unwritable store falls back."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from toolkit.builtin.models import TINY_QWEN3_VL_MODEL, TINY_VL_MODEL, materialize_builtin
from toolkit.data import frames
from toolkit.data.collate import VLCollator
from toolkit.data.frames import IMAGE_PREFIX, ImageStore
from toolkit.data.vision import caches_resized, image_grid, process_images
from toolkit.errors import ToolkitError
from toolkit.model.load import load_processor
from toolkit.templates import IMAGE_PAD, VISION_END, VISION_START

GB = 1 << 30


@pytest.fixture(scope="module")
def processors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cache = tmp_path_factory.mktemp("models")
    return {name: load_processor(materialize_builtin(model, cache), trust_remote_code=False, chat_template=None)
            for name, model in (("qwen2.5-vl", TINY_VL_MODEL), ("qwen3-vl", TINY_QWEN3_VL_MODEL))}


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Images of several modes and sizes, with noise so that resampling has something to round."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)

    def noise(h: int, w: int, c: int) -> np.ndarray:
        return rng.integers(0, 256, (h, w, c) if c > 1 else (h, w), dtype=np.uint8)

    made = {
        "rgb.png": Image.fromarray(noise(61, 83, 3)),
        "rgba.png": Image.fromarray(noise(50, 70, 4), "RGBA"),
        "gray.png": Image.fromarray(noise(45, 90, 1), "L"),
        "palette.png": Image.fromarray(noise(64, 64, 3)).quantize(colors=16),
        "photo.jpg": Image.fromarray(noise(120, 160, 3)),
        "large.png": Image.fromarray(noise(1100, 1500, 3)),  # downscaled (over max_pixels)
        "small.png": Image.fromarray(noise(9, 13, 3)),  # upscaled (under min_pixels)
    }
    for name, image in made.items():
        image.save(root / name, quality=85) if name.endswith(".jpg") else image.save(root / name)
    assert Image.open(root / "palette.png").mode == "P"
    return [str(root / name) for name in made]


def equal(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return a[0].dtype == b[0].dtype and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("arch", ["qwen2.5-vl", "qwen3-vl"])
def test_cached_resize_is_exact_and_reused(arch: str, processors: dict[str, Any], images: list[str],
                                          tmp_path: Path) -> None:
    processor = processors[arch]
    assert caches_resized(processor.image_processor)  # else the cached path below would not run
    for bounds in ({}, {"min_pixels": 48 * 48, "max_pixels": 200 * 200}):
        plain = process_images(processor, images, **bounds)  # type: ignore[arg-type]
        store = tmp_path / f"frames-{len(bounds)}"
        before = frames.RESIZES["images"]
        cold = process_images(processor, images, store=ImageStore(store, GB), **bounds)  # type: ignore[arg-type]
        assert frames.RESIZES["images"] - before == len(images)
        warm = process_images(processor, images, store=ImageStore(store, GB), **bounds)  # a relaunch's store
        assert frames.RESIZES["images"] - before == len(images)  # nothing decoded or resized again
        assert equal(cold, plain) and equal(warm, plain)
        assert len([p for p in store.iterdir() if p.name.startswith(IMAGE_PREFIX)]) == len(images)
    # other resize settings are other entries, never the first ones misread
    assert len(list(tmp_path.glob("frames-*/img-*"))) == 2 * len(images)


def test_collator_second_epoch_resizes_nothing(processors: dict[str, Any], images: list[str],
                                               tmp_path: Path) -> None:
    processor = processors["qwen2.5-vl"]
    ip, tok = processor.image_processor, processor.tokenizer
    grids = [image_grid(ip, Path(p), p) for p in images]
    rows = []
    for path, grid in zip(images, grids, strict=True):
        n = int(np.prod(grid)) // ip.merge_size ** 2
        ids = tok.convert_tokens_to_ids([VISION_START, *[IMAGE_PAD] * n, VISION_END]) + tok.encode(" hi")
        rows.append({"input_ids": ids, "labels": ids, "images": [path], "image_grid_thw": [grid]})
    plain = VLCollator(processor)(rows)
    cached = VLCollator(processor, image_store=ImageStore(tmp_path / "frames", GB))
    before = frames.RESIZES["images"]
    first = cached(rows)
    second = cached(rows)  # a second epoch
    assert frames.RESIZES["images"] - before == len(images)
    for batch in (first, second):
        assert batch.keys() == plain.keys()
        assert all(torch.equal(batch[k], plain[k]) for k in plain)
    changed = tmp_path / "changed.png"
    Image.open(images[0]).save(changed)
    cached([{**rows[0], "images": [str(changed)]}])
    Image.new("RGB", (300, 40)).save(changed)  # edited in place: another content, another entry, another grid
    with pytest.raises(ToolkitError, match=r"changed\.png no longer has the size it was tokenised with"):
        cached([{**rows[0], "images": [str(changed)]}])


def test_corrupt_entries_are_rebuilt(processors: dict[str, Any], images: list[str], tmp_path: Path) -> None:
    processor = processors["qwen3-vl"]
    paths = images[:1]
    plain = process_images(processor, paths)
    store = tmp_path / "frames"
    process_images(processor, paths, store=ImageStore(store, GB))
    (entry,) = store.glob("img-*")
    array = entry / "frames.npy"
    good = array.read_bytes()
    flipped = bytearray(good)
    flipped[-1] ^= 1
    damages = {"a changed pixel": bytes(flipped), "a truncated file": good[:len(good) // 2], "no file": None}
    for damage, content in damages.items():
        array.unlink()
        if content is not None:
            array.write_bytes(content)
        before = frames.RESIZES["images"]
        got = process_images(processor, paths, store=ImageStore(store, GB))
        assert frames.RESIZES["images"] - before == 1, damage  # detected and rebuilt
        assert equal(got, plain), damage
        assert array.read_bytes() == good, damage
    meta = json.loads((entry / "meta.json").read_text())
    (entry / "meta.json").write_text(json.dumps({**meta, "size": meta["size"][::-1]}))
    before = frames.RESIZES["images"]
    assert equal(process_images(processor, paths, store=ImageStore(store, GB)), plain)
    assert frames.RESIZES["images"] - before == 1


def test_a_full_cache_resizes_the_rest(processors: dict[str, Any], images: list[str], tmp_path: Path,
                                     caplog: pytest.LogCaptureFixture) -> None:
    processor = processors["qwen2.5-vl"]
    plain = process_images(processor, images)
    store = tmp_path / "frames"
    budget = 40_000  # room for some of the small images, not the large one
    with caplog.at_level(logging.INFO, logger="toolkit"):
        got = process_images(processor, images, store=ImageStore(store, budget))
    assert equal(got, plain)
    assert 0 < ImageStore(store, budget).used() <= budget
    assert sum("is full" in r.getMessage() for r in caplog.records) == 1


def test_a_run_chooses_its_image_cache(processors: dict[str, Any], tmp_path: Path,
                                       caplog: pytest.LogCaptureFixture) -> None:
    """data.image_cache and data.cache_dir decide; a store that cannot be written turns the cache off, said once."""
    from toolkit.config.identity import resume_invariants
    from toolkit.config.load import load_recipe
    from toolkit.train.setup import image_store

    processor = processors["qwen3-vl"]
    out = f"output_dir={tmp_path / 'run'}"
    store = image_store(load_recipe(None, [out, f"data.cache_dir={tmp_path / 'cache'}", "data.image_cache_gb=0.5"]),
                        processor)
    assert store is not None and store.store == tmp_path / "cache" / "frames" and store.budget == 500_000_000
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with caplog.at_level(logging.INFO, logger="toolkit"):
        assert image_store(load_recipe(None, [out, "data.image_cache=none"]), processor) is None
        assert image_store(load_recipe(None, [out, "data.cache_dir=none"]), processor) is None
        assert image_store(load_recipe(None, [out, f"data.cache_dir={blocked}"]), processor) is None
    assert not {"image_cache", "image_cache_gb"} & set(resume_invariants(load_recipe(None))["data"])  # exact: a
    # resume may switch it
    said = [r.getMessage() for r in caplog.records if "image cache off" in r.getMessage()]
    assert len(said) == 2 and "data.cache_dir is none" in said[0] and str(blocked) in said[1]
