"""Vision-language side: tiny VL models (toolkit/builtin/vl_model.py), dummy image data, row encoding
(toolkit/data/vision.py),
over-length policies and the collator (toolkit/data/collate.py)."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from tests.conftest import REPO, launch_cmd, run_env, signal_tree, stock_template
from tests.helpers.vl_mixed_batches import vision_module_names
from toolkit.builtin.dummy_data import write_dummy_vl_data
from toolkit.builtin.models import TINY_VL_MODEL, materialize_builtin
from toolkit.builtin.vl_model import Qwen2_5_VLImageOnlyProcessor, write_tiny_qwen2_5_vl, write_tiny_qwen3_vl
from toolkit.data.collate import VLCollator
from toolkit.data.encoding import IGNORE_INDEX, DataStats
from toolkit.data.vision import encode_vl_row, process_images
from toolkit.errors import ToolkitError
from toolkit.model.load import apply_lora
from toolkit.templates import IMAGE_PAD, VISION_TOKENS

WHERE = "rows.jsonl:3"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`builtin:tiny-qwen2.5-vl`, built as a run builds it (by `write_tiny_qwen2_5_vl`)."""
    return Path(materialize_builtin(TINY_VL_MODEL, tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="module")
def processor(model_dir: Path) -> Any:
    return AutoProcessor.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Any:
    return AutoModelForImageTextToText.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_dummy_vl_data(tmp_path_factory.mktemp("vl-data"), 30)


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def encode(row: dict[str, Any], processor: Any, base_dir: Path, **kw: Any) -> dict[str, Any] | None:
    args: dict[str, Any] = {"train_on": "assistant", "max_seq_len": 1024, "overlength": "error"} | kw
    return encode_vl_row(row, processor, base_dir=base_dir, where=WHERE, **args)


def image_row(n: int, base: Path, *, answer: str = "It is red.") -> dict[str, Any]:
    """A row with `n` images, reusing the dummy data's image files."""
    images = sorted(p.relative_to(base).as_posix() for p in (base / "images").glob("s1_*.png"))[:n]
    return {"messages": [{"role": "user", "content": [*({"type": "image"} for _ in range(n)),
                                                      {"type": "text", "text": "What colour is this?"}]},
                         {"role": "assistant", "content": answer}],
            "images": images}


TEXT_ROWS = [
    {"messages": [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "3."}]},
    {"messages": [{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": [{"type": "text", "text": "What is 10 + 20, and why?"}]},
                  {"role": "assistant", "content": "30, since ten and twenty make thirty."}]},
]


def n_image_tokens(ids: list[int] | torch.Tensor, processor: Any) -> int:
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    return sum(int(t) == image_id for t in ids)


# --- tiny model and processor ---

def test_round_trip(model_dir: Path, processor: Any, model: Any) -> None:
    assert isinstance(processor, Qwen2_5_VLImageOnlyProcessor)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    tok, cfg = processor.tokenizer, model.config
    ids = dict(zip(VISION_TOKENS, tok.convert_tokens_to_ids(VISION_TOKENS), strict=True))
    assert (cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id, cfg.video_token_id) == (
        ids["<|vision_start|>"], ids["<|vision_end|>"], ids["<|image_pad|>"], ids["<|video_pad|>"])
    assert cfg.text_config.vocab_size % 64 == 0 and cfg.text_config.vocab_size >= len(tok)
    assert cfg.vision_config.out_hidden_size == cfg.text_config.hidden_size == 64
    assert processor.image_processor.size["longest_edge"] == 56 * 56 * 4
    assert processor.chat_template == stock_template("qwen2.5-vl")  # its family's stock template, as the real one


FRESH_LOAD = """
import sys
from pathlib import Path

from transformers import AutoProcessor, ProcessorMixin

import toolkit.data.collate, toolkit.data, toolkit.builtin.dummy_data, toolkit.data.vision  # the production VL modules
from toolkit.builtin.models import TINY_VL_MODEL
from toolkit.model.load import load_processor
from toolkit.builtin.models import materialize_builtin

path = materialize_builtin(TINY_VL_MODEL, Path(sys.argv[1]))  # already built: nothing is built, only found
built = {"toolkit.builtin.text_model", "toolkit.builtin.vl_model"} & set(sys.modules)
assert not built, "a production import loaded a test-model builder"
assert not isinstance(AutoProcessor.from_pretrained(path), ProcessorMixin), "an import registered the processor"
processor = load_processor(path, trust_remote_code=False, chat_template=None)
print(type(processor).__name__, processor.image_processor.patch_size)
"""


def test_a_fresh_process_loads_the_builtin_processor(model_dir: Path) -> None:
    """In a process that never built a tiny model, importing the model, data and collator modules imports no
    test-model builder and registers no processor class, yet `load_processor` loads `builtin:tiny-qwen2.5-vl` as
    its image-only processor (unregistered, AutoProcessor would silently give the bare tokenizer)."""
    proc = subprocess.run([sys.executable, "-c", FRESH_LOAD, str(model_dir.parent)], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-2:] == ["Qwen2_5_VLImageOnlyProcessor", "14"]


def test_deterministic_weights(tmp_path: Path, model_dir: Path) -> None:
    again = write_tiny_qwen2_5_vl(tmp_path / "again")
    other = write_tiny_qwen2_5_vl(tmp_path / "other", seed=1)
    ref = (model_dir / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == ref
    assert (other / "model.safetensors").read_bytes() != ref
    for name in ("tokenizer.json", "processor_config.json", "chat_template.jinja"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes()


def test_vision_module_names(model: Any, model_dir: Path) -> None:
    names = vision_module_names(model)
    assert names == {"vision_tower": "model.visual", "projector": "model.visual.merger"}
    modules = dict(model.named_modules())
    assert type(modules[names["projector"]]).__name__ == "Qwen2_5_VLPatchMerger"
    peft = apply_lora(AutoModelForImageTextToText.from_pretrained(model_dir), r=2, alpha=4, dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], modules_to_save=[])
    wrapped = vision_module_names(peft)
    assert wrapped["vision_tower"].endswith("model.visual") and wrapped["projector"] in dict(peft.named_modules())
    # the language-model attention names do not occur in the vision tower (it uses qkv / proj)
    assert not [n for n, _ in peft.named_modules() if n.startswith(wrapped["vision_tower"]) and "lora_" in n]


# --- encoding ---

def test_forward_on_an_image_row(processor: Any, model: Any, data: dict[str, Path]) -> None:
    path = data["vl_stage1"]
    sample = encode(rows(path)[0], processor, path.parent)
    assert sample is not None
    batch = VLCollator(processor)([sample])
    with torch.no_grad():
        loss = model(**batch).loss
    assert math.isfinite(loss.item())


def test_labels_are_assistant_text_and_im_end(processor: Any, data: dict[str, Path]) -> None:
    base = data["vl_stage1"].parent
    row = image_row(1, base, answer="It is red.")
    row["messages"] += [{"role": "user", "content": "And now?"}, {"role": "assistant", "content": "Still red."}]
    sample = encode(row, processor, base)
    assert sample is not None
    ids, labels = sample["input_ids"], sample["labels"]
    assert len(ids) == len(labels) and labels[0] == IGNORE_INDEX
    kept = [t for t in labels if t != IGNORE_INDEX]
    assert processor.tokenizer.decode(kept) == "It is red.<|im_end|>Still red.<|im_end|>"
    assert all(label in (IGNORE_INDEX, t) for t, label in zip(ids, labels, strict=True))


def test_image_tokens_match_grid_and_are_never_labelled(processor: Any, data: dict[str, Path]) -> None:
    base = data["vl_stage1"].parent
    vision = set(processor.tokenizer.convert_tokens_to_ids(VISION_TOKENS))
    for n in (1, 2):
        for train_on in ("assistant", "all"):
            sample = encode(image_row(n, base), processor, base, train_on=train_on)
            assert sample is not None
            grid = torch.tensor(sample["image_grid_thw"])
            assert grid.shape == (n, 3) and len(sample["images"]) == n
            merge = processor.image_processor.merge_size ** 2
            assert n_image_tokens(sample["input_ids"], processor) == int(grid.prod(-1).sum()) // merge
            pixels, again = process_images(processor, sample["images"])  # what the collator will compute
            assert torch.equal(again, grid) and pixels.shape[0] == int(grid.prod(-1).sum())
            assert not [t for t in sample["labels"] if t in vision]
    text = encode(TEXT_ROWS[1], processor, base)
    assert text is not None and set(text) == {"input_ids", "labels"}


def test_pixel_bounds_override(processor: Any, data: dict[str, Path]) -> None:
    base = data["vl_stage1"].parent
    small = encode(image_row(1, base), processor, base, max_pixels=28 * 28, min_pixels=28 * 28)
    assert small is not None and small["image_grid_thw"] == [[1, 2, 2]]
    assert n_image_tokens(small["input_ids"], processor) == 1


def test_missing_and_unreadable_images(processor: Any, tmp_path: Path, data: dict[str, Path]) -> None:
    base = data["vl_stage1"].parent
    row = image_row(1, base)
    row["images"] = ["images/nope.png"]
    with pytest.raises(ToolkitError, match=rf"{WHERE}: image file .*images/nope.png does not exist"):
        encode(row, processor, base)
    (tmp_path / "bad.png").write_bytes(b"not a png")
    row["images"] = ["bad.png"]
    with pytest.raises(ToolkitError, match=rf"{WHERE}: image file .*bad.png could not be read"):
        encode(row, processor, tmp_path)


def test_placeholder_count_and_images_type(processor: Any, data: dict[str, Path]) -> None:
    base = data["vl_stage1"].parent
    two_paths = image_row(1, base) | {"images": image_row(2, base)["images"]}
    with pytest.raises(ToolkitError, match=rf"{WHERE}: 1 .* placeholder\(s\) .* but 2 path\(s\)"):
        encode(two_paths, processor, base)
    no_paths = image_row(1, base) | {"images": []}
    with pytest.raises(ToolkitError, match=rf"{WHERE}: 1 .* placeholder\(s\) .* but 0 path\(s\)"):
        encode(no_paths, processor, base)
    with pytest.raises(ToolkitError, match=rf"{WHERE}: 'images' must be a list"):
        encode(image_row(1, base) | {"images": "images/s1_00000.png"}, processor, base)


@pytest.mark.parametrize(("messages", "error"), [
    ([{"role": "robot", "content": "hi"}], r"messages\[0\] must have a role in .* or a list of"),
    ([{"role": "user", "content": 5}], r"messages\[0\] must have a role in .* or a list of"),
    ([{"role": "user", "content": ["hi"]}], r"messages\[0\]\.content must be a string or a list of"),
    ([{"role": "user", "content": [{"type": "audio"}]}], r"messages\[0\] has a 'audio' part; only text, image and "
                                                          r"video"),
    ([{"role": "user", "content": [{"type": "text", "text": 1}]}], r"messages\[0\] has a text part without"),
    ([{"role": "user", "content": [{"type": "text", "text": "<|im_end|>"}]}], r"messages\[0\]\.content contains"),
    ([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hi.", "tool_calls": "add"}],
     r"messages\[1\]\.tool_calls must be a list"),
], ids=["role", "content", "part", "audio", "text", "marker", "tool_calls"])
def test_messages_are_checked_like_text_rows(processor: Any, messages: list[Any], error: str) -> None:
    """VL rows go through the text rows' message checks (`toolkit.data.check_messages`), with image parts."""
    with pytest.raises(ToolkitError, match=rf"^{WHERE}: {error}"):
        encode({"messages": messages}, processor, Path())


def test_turn_weights_with_generation_markers(processor: Any, data: dict[str, Path]) -> None:
    """The tiny processor's {% generation %} template: a turn with "weight": 0 is left out, the other trains as
    before; rows that mix shapes or carry ignored keys are refused like text rows."""
    base = data["vl_stage1"].parent
    row = image_row(1, base)
    row["messages"] += [{"role": "user", "content": "And now?"}, {"role": "assistant", "content": "Still red."}]
    full = encode(row, processor, base)
    left_out = encode(dict(row, messages=[dict(m, weight=0) if i == 1 else m for i, m in enumerate(row["messages"])]),
                      processor, base)
    assert full is not None and left_out is not None and left_out["input_ids"] == full["input_ids"]
    tok = processor.tokenizer
    trained = [t for t, lab in zip(left_out["input_ids"], left_out["labels"], strict=True) if lab != IGNORE_INDEX]
    assert tok.decode(trained) == "Still red.<|im_end|>"
    assert [lab for lab in left_out["labels"] if lab != IGNORE_INDEX] == \
        [lab for lab in full["labels"] if lab != IGNORE_INDEX][-len(trained):]
    for bad, error in ((dict(row, text="more"), "the row has 'messages', 'text', which are 2 row shapes"),
                       (dict(row, weight=2), "the row has 'weight': per-row loss weighting")):
        with pytest.raises(ToolkitError, match=rf"^{WHERE}: {error}"):
            encode(bad, processor, base)


# --- over-length ---

def test_overlength_error_and_drop(processor: Any, data: dict[str, Path]) -> None:
    base = data["vl_stage1"].parent
    row = image_row(1, base)
    full = encode(row, processor, base)
    assert full is not None
    short = len(full["input_ids"]) - 1
    with pytest.raises(ToolkitError, match=rf"{WHERE}: {short + 1} tokens, over data.max_seq_len={short}"):
        encode(row, processor, base, max_seq_len=short)
    stats = DataStats()
    assert encode(row, processor, base, max_seq_len=short, overlength="drop", stats=stats) is None
    assert stats.dropped_overlength == 1 and stats.truncated == 0


def test_truncate_only_after_the_last_image(processor: Any, data: dict[str, Path]) -> None:
    base = data["vl_stage1"].parent
    row = image_row(2, base, answer="No: the first is red and the second is blue, as anyone can see.")
    full = encode(row, processor, base)
    assert full is not None
    vision = set(processor.tokenizer.convert_tokens_to_ids(VISION_TOKENS))
    last_vision = max(i for i, t in enumerate(full["input_ids"]) if t in vision)
    stats = DataStats()
    cut = last_vision + 5  # after the last image: ids and labels cut, the images untouched
    kept = encode(row, processor, base, max_seq_len=cut, overlength="truncate", stats=stats)
    assert kept is not None and stats.truncated == 1
    assert kept["input_ids"] == full["input_ids"][:cut] and kept["labels"] == full["labels"][:cut]
    assert n_image_tokens(kept["input_ids"], processor) == n_image_tokens(full["input_ids"], processor)
    assert kept["images"] == full["images"] and kept["image_grid_thw"] == full["image_grid_thw"]
    for inside in (last_vision, last_vision - 3, 5):  # the cut would split an image: dropped instead
        assert encode(row, processor, base, max_seq_len=inside, overlength="truncate", stats=stats) is None
    assert stats.dropped_overlength == 3 and stats.truncated == 1


# --- collator ---

def test_collator_mixed_batch(processor: Any, model: Any, data: dict[str, Path]) -> None:
    base = data["vl_stage1"].parent
    samples = [encode(TEXT_ROWS[0], processor, base), encode(image_row(2, base), processor, base),
               encode(TEXT_ROWS[1], processor, base), encode(image_row(1, base), processor, base)]
    assert all(s is not None for s in samples)
    batch = VLCollator(processor)(samples)  # type: ignore[arg-type]
    width = max(len(s["input_ids"]) for s in samples)  # type: ignore[index]
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (4, width)
    paths = [p for s in samples if s is not None for p in s.get("images", [])]
    assert len(paths) == 3
    pixels, grid = process_images(processor, paths)  # the rows' images, in row order
    assert torch.equal(batch["pixel_values"], pixels) and torch.equal(batch["image_grid_thw"], grid)
    for i, s in enumerate(samples):  # rows unchanged, right padded; no dummy image in a batch with images
        assert s is not None
        n = len(s["input_ids"])
        assert batch["input_ids"][i, :n].tolist() == s["input_ids"]
        assert batch["labels"][i, :n].tolist() == s["labels"]
        assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (width - n)
        assert (batch["labels"][i, n:] == IGNORE_INDEX).all()
    assert n_image_tokens(batch["input_ids"].flatten(), processor) == int(batch["image_grid_thw"].prod(-1).sum()) // 4
    assert torch.equal(batch["mm_token_type_ids"].bool(), batch["input_ids"] == model.config.image_token_id)
    with torch.no_grad():
        assert math.isfinite(model(**batch).loss.item())


def test_collator_refuses_an_image_changed_since_tokenisation(processor: Any, tmp_path: Path,
                                                              data: dict[str, Path]) -> None:
    base = data["vl_stage1"].parent
    row = image_row(1, base)
    copy = tmp_path / "img.png"
    copy.write_bytes((base / row["images"][0]).read_bytes())
    sample = encode(row | {"images": ["img.png"]}, processor, tmp_path)
    assert sample is not None and sample["images"] == [str(copy)]
    VLCollator(processor)([sample])  # unchanged: fine
    Image.new("RGB", (300, 40)).save(copy)  # another size: another grid than the row's image tokens
    with pytest.raises(ToolkitError, match=r"Image .*img\.png no longer has the size it was tokenised with"):
        VLCollator(processor)([sample])


@pytest.mark.parametrize("order", [(0, 1), (1, 0)], ids=["first-row-shorter", "first-row-longer"])
def test_collator_text_only_batch_gets_a_dummy_image(processor: Any, model: Any, order: tuple[int, int]) -> None:
    samples = [encode(TEXT_ROWS[i], processor, Path()) for i in order]
    batch = VLCollator(processor)(samples)  # type: ignore[arg-type]
    plain = VLCollator(processor, dummy_image=False)(samples)  # type: ignore[arg-type]
    assert "pixel_values" not in plain and "pixel_values" in batch and batch["image_grid_thw"].shape == (1, 3)
    first = samples[0]
    assert first is not None
    n = len(first["input_ids"])
    dummy = batch["input_ids"][0, n:][batch["attention_mask"][0, n:] == 0]
    assert n_image_tokens(dummy, processor) == int(batch["image_grid_thw"].prod()) // 4 >= 1
    assert batch["attention_mask"][0, n:].sum() == 0 and (batch["labels"][0, n:] == IGNORE_INDEX).all()
    for key in ("input_ids", "labels", "attention_mask"):  # real tokens unchanged
        w = plain[key].shape[1]
        assert torch.equal(batch[key][:, :w][batch["attention_mask"][:, :w] == 1],
                           plain[key][plain["attention_mask"] == 1])
    calls: list[int] = []
    hook = model.model.visual.register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad():
            with_dummy = model(**batch).loss
            assert calls, "the vision tower did not run on the dummy image"
            without = model(input_ids=plain["input_ids"], attention_mask=plain["attention_mask"],
                            labels=plain["labels"]).loss
    finally:
        hook.remove()
    assert abs(with_dummy.item() - without.item()) < 1e-6


# --- Qwen3-VL: the same rows, collator and dummy image through another architecture (16-pixel patches, DeepStack) ---

def test_qwen3_vl_rows_collate_and_train(tmp_path: Path, data: dict[str, Path]) -> None:
    model_dir = write_tiny_qwen3_vl(tmp_path / "tiny-qwen3-vl")
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert vision_module_names(model) == {"vision_tower": "model.visual", "projector": "model.visual.merger"}
    base = data["vl_stage1"].parent
    image = encode(image_row(2, base), processor, base)
    texts = [encode(row, processor, base) for row in TEXT_ROWS]
    assert image is not None and None not in texts
    assert n_image_tokens(image["input_ids"], processor) == sum(t * h * w for t, h, w in image["image_grid_thw"]) // 4
    batch = VLCollator(processor)([image, *texts])  # type: ignore[list-item]
    loss = model(**batch).loss
    loss.backward()
    assert math.isfinite(loss.item())
    assert all(p.grad is not None for n, p in model.named_parameters() if "visual.merger" in n)
    model.zero_grad()
    with_dummy = VLCollator(processor)(texts)  # type: ignore[arg-type]
    plain = VLCollator(processor, dummy_image=False)(texts)  # type: ignore[arg-type]
    assert with_dummy["image_grid_thw"].tolist() == [[1, 2, 2]]  # one 32 x 32 px image: 16-px patches, 2x2 merge
    with torch.no_grad():
        assert abs(model(**with_dummy).loss.item() - model(**plain).loss.item()) < 1e-6


# --- dummy data ---

def test_dummy_data_deterministic(tmp_path: Path) -> None:
    a = write_dummy_vl_data(tmp_path / "a", 20, seed=3)
    b = write_dummy_vl_data(tmp_path / "b", 20, seed=3)
    c = write_dummy_vl_data(tmp_path / "c", 20, seed=4)
    assert set(a) == {"vl_stage1", "vl_stage2"} and a["vl_stage1"] == tmp_path / "a" / "vl_stage1.jsonl"
    for stage in a:
        assert a[stage].read_bytes() == b[stage].read_bytes() != c[stage].read_bytes()
    images_a = sorted(p.name for p in (tmp_path / "a" / "images").iterdir())
    assert images_a == sorted(p.name for p in (tmp_path / "b" / "images").iterdir())
    assert all((tmp_path / "a" / "images" / n).read_bytes() == (tmp_path / "b" / "images" / n).read_bytes()
               for n in images_a)


def test_dummy_data_shape(processor: Any, data: dict[str, Path]) -> None:
    stage1, stage2 = rows(data["vl_stage1"]), rows(data["vl_stage2"])
    assert len(stage1) == len(stage2) == 30
    assert all(len(r["images"]) == 1 for r in stage1)
    counts = [len(r.get("images", [])) for r in stage2]
    assert counts.count(0) >= 3 and counts.count(1) >= 3 and counts.count(2) >= 3
    base = data["vl_stage2"].parent
    for r in stage1 + stage2:
        assert all((base / p).is_file() for p in r.get("images", []))
        sample = encode(r, processor, base)
        assert sample is not None and any(t != IGNORE_INDEX for t in sample["labels"])


# --- multi-process: text-only batches on one rank, image batches on the other ---

@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_mixed_batches_across_ranks_do_not_hang(strategy: str, tmp_path: Path) -> None:
    """Rank 0 only sees text-only batches, rank 1 image batches; without the collator's dummy image the ranks'
    vision-tower all-gathers mismatch (a hang on NCCL, a gloo size error here). A hang fails at the timeout."""
    cmd = [*launch_cmd(strategy, 2), str(REPO / "tests" / "helpers" / "vl_mixed_batches.py"), str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        signal_tree(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{strategy}: mixed text/image batches hung for 600 s")
    assert proc.returncode == 0, f"{strategy} failed (rc={proc.returncode}):\n{output[-6000:]}"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["real_images"] for r in results] == [False, True]
    for r in results:
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"]), r
        assert r["strategy"] == ("zero3" if strategy == "zero3" else "fsdp2")


# --- packing (data.packing for Qwen2.5-VL / Qwen3-VL) ---

def _vl_rows(base: Path) -> list[dict[str, Any]]:
    return [image_row(1, base), TEXT_ROWS[0], image_row(2, base, answer="Both are red."), TEXT_ROWS[1],
            image_row(1, base, answer="Red, like the others.")]


@pytest.mark.parametrize("arch", ["qwen2.5-vl", "qwen3-vl"])
def test_packed_vl_loss_and_gradients_equal_unpacked(tmp_path: Path, data: dict[str, Path], model_dir: Path,
                                                     arch: str) -> None:
    """One flattened row of image and text samples (multimodal rotary ids per sample, text positions restarting)
    gives the padded batch's summed loss and gradients: no sample attends to another, and every image token gets
    its own image's features."""
    from toolkit.data.collate import VLPackedCollator
    from toolkit.data.plan import packed_row

    path = model_dir if arch == "qwen2.5-vl" else write_tiny_qwen3_vl(tmp_path / "tiny-qwen3-vl")
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, attn_implementation="sdpa")
    model.config.use_cache = model.config.get_text_config().use_cache = False
    base = data["vl_stage1"].parent
    samples = [encode(r, processor, base) for r in _vl_rows(base)]
    padded = VLCollator(processor)(samples)  # type: ignore[arg-type]
    packed = VLPackedCollator(processor, model.config)([packed_row(samples[:3]), packed_row(samples[3:])])
    assert "attention_mask" not in packed and packed["input_ids"].shape == (1, sum(len(s["input_ids"])
                                                                                   for s in samples))
    assert packed["position_ids"].shape == (4, 1, packed["input_ids"].shape[1])
    assert torch.equal(packed["image_grid_thw"], padded["image_grid_thw"])
    starts = (packed["position_ids"][0, 0] == 0).nonzero().flatten().tolist()
    assert starts == [0, *np.cumsum([len(s["input_ids"]) for s in samples])[:-1].tolist()]

    def loss_and_grads(batch: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad()
        loss = model(**batch, num_items_in_batch=torch.tensor(1.0)).loss  # the sum over label tokens
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss_padded, grads_padded = loss_and_grads(padded)
    loss_packed, grads_packed = loss_and_grads(packed)
    assert loss_packed == pytest.approx(loss_padded, rel=1e-6)  # wrong rotary ids move it by ~5e-6
    assert grads_packed.keys() == grads_padded.keys() and any("visual" in n for n in grads_packed)
    for name, grad in grads_padded.items():
        torch.testing.assert_close(grads_packed[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    text_only = VLPackedCollator(processor, model.config)([packed_row(samples[1:2]), samples[3]])
    assert "pixel_values" in text_only  # the dummy image, a sample of its own: the vision tower runs on every rank
    plain = VLPackedCollator(processor, model.config, dummy_image=False)([packed_row(samples[1:2]), samples[3]])
    n = plain["input_ids"].shape[1]
    with torch.no_grad():
        logits_dummy = model(**text_only).logits[0, :n]
        logits_plain = model(**plain).logits[0]
    torch.testing.assert_close(logits_dummy, logits_plain, rtol=1e-5, atol=1e-5)


def test_image_grids_from_headers_match_processing(processor: Any, tmp_path: Path) -> None:
    """The grid a row is prepared with (from the image file's size alone) is the grid decoding and resizing the
    image gives, over sizes, aspect ratios and pixel bounds."""
    from toolkit.data.vision import image_grid

    for i, (w, h) in enumerate([(56, 56), (300, 40), (17, 90), (640, 480), (28, 28), (1000, 10)]):
        path = tmp_path / f"{i}.png"
        Image.new("RGB", (w, h), "red").save(path)
        for bounds in ({}, {"min_pixels": 56 * 56, "max_pixels": 112 * 112}):
            _, grid = process_images(processor, [str(path)], **bounds)
            assert image_grid(processor.image_processor, path, "f:1", **bounds) == grid[0].tolist(), (w, h, bounds)


def test_packed_vl_run_in_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    """recipes/smoke_vl.yaml with data.packing: true trains end to end: VL rows prepared into stores (grids from
    image headers), packed whole, images decoded in the DataLoader's workers, one flattened row per micro-batch.
    Its final/ carries a model card of an image-text-to-text adapter."""
    from huggingface_hub import ModelCard

    from tests.helpers.inprocess import Call, invoke
    from toolkit.checkpoint.model_card import MODEL_CARD
    from toolkit.metrics.log import read_metrics

    out = tmp_path / "run"
    rc, stderr = invoke(Call(["--config", str(REPO / "recipes" / "smoke_vl.yaml"), "--create_dummy_data",
                              "--num_dummy_samples", "32", f"output_dir={out}", "data.packing=true",
                              "stages.0.max_steps=1", "stages.1.max_steps=1", "logging.trackers=[]"], out),
                        tmp_path, monkeypatch)
    assert rc == 0, stderr[-3000:]
    assert "packed into" in caplog.text
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl", "train")]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert (out / "final" / "adapter_model.safetensors").is_file()
    card = ModelCard.load(out / "final" / MODEL_CARD)
    assert (card.data.library_name, card.data.pipeline_tag, card.data.base_model) == ("peft", "image-text-to-text",
                                                                                        None)
    assert "| 1 | align | sft | `dummy:vl_stage1` |" in card.text
    assert "| 2 | instruct | sft | `dummy:vl_stage2` |" in card.text
    assert "`visual.merger`" in card.text and "A LoRA adapter (PEFT) for `builtin:tiny-qwen2.5-vl`" in card.text


def test_a_vision_row_cut_by_the_size_guard_is_never_truncated(processor: Any, data: dict[str, Path],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A VL row far over max_seq_len is stored as its first max_tokens + 1 tokens (the guard's floor lowered to
    test it at a small size); its images may lie past the cut, so truncation drops it instead of cutting it."""
    import toolkit.data.encoding as encoding_mod
    from toolkit.data.plan import select_rows
    from toolkit.data.sources import Entry, resolve_source
    from toolkit.data.store import open_store
    from toolkit.data.vision import VLEncoder

    monkeypatch.setattr(encoding_mod, "GUARD_MIN_CHARS", 5000)
    row = rows(data["vl_stage1"])[0]
    long = dict(row, messages=[*row["messages"][:-1], {"role": "assistant", "content": "red " * 20000}])
    path = data["vl_stage1"].parent / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [row, long]))
    store = open_store(resolve_source(Entry(str(path)), Path()), VLEncoder(processor, train_on="assistant"), None,
                       num_proc=1, max_tokens=300)
    assert list(store.capped) == [1] and store.lengths[1] == 301 and store.uncuttable[1] == 301
    assert store.lengths[0] < 300 and store.uncuttable[0] > 0
    stats = select_rows(store, max_seq_len=300, overlength="truncate").stats
    assert (stats.kept, stats.dropped_overlength, stats.truncated) == (1, 1, 0)


def test_a_vision_row_over_the_byte_cap_is_stored_unread(processor: Any, data: dict[str, Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A VL row over the row byte cap is stored with no tokens and no images among the rows around it, which keep
    theirs; drop drops it (the floors lowered to test it at a small size)."""
    import toolkit.data.encoding as encoding_mod
    import toolkit.data.sources as sources_mod
    from toolkit.data.plan import select_rows
    from toolkit.data.sources import Entry, resolve_source
    from toolkit.data.store import open_store
    from toolkit.data.vision import VLEncoder

    monkeypatch.setattr(encoding_mod, "GUARD_MIN_CHARS", 5000)
    monkeypatch.setattr(sources_mod, "ROW_BYTES_FLOOR", 1200)
    encoder = VLEncoder(processor, train_on="assistant")
    cap = sources_mod.row_byte_cap(encoding_mod.SizeGuard(encoder, 300).limit or 0)
    row = rows(data["vl_stage1"])[0]
    huge = dict(row, messages=[*row["messages"][:-1], {"role": "assistant", "content": "red " * (cap // 4)}])
    path = data["vl_stage1"].parent / "huge.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [row, huge, row]))
    store = open_store(resolve_source(Entry(str(path)), Path()), encoder, None, num_proc=1, max_tokens=300)
    assert list(store.oversize) == [1] and store.lengths[1] == 0 and store.uncuttable[1] == 0
    assert store.lengths[0] == store.lengths[2] > 0 and store.sample(2)["images"] == store.sample(0)["images"]
    stats = select_rows(store, max_seq_len=300, overlength="drop").stats
    assert (stats.kept, stats.dropped_overlength) == (2, 1)
