"""Bad input: a clear one-paragraph error (exit code 2, no traceback) and nothing written to the output dir."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, launch_cmd, run_env
from toolkit.metrics import read_metrics
from toolkit.tiny import write_tiny_qwen3

CHAT = {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}]}


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def recipe(tmp_path: Path, data: list[str], **top: object) -> Path:
    tree = {"output_dir": str(tmp_path / "out"), "data": {"max_seq_len": 64},
            "stages": [{"name": "only", "data": data, "max_steps": 2}],
            "train": {"micro_batch_size": 2}, "logging": {"progress_bar": False}, **top}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def run(args: list[str], launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    cmd = [*(launcher or [sys.executable]), str(REPO / "train_curriculum.py"), *args]
    return subprocess.run(cmd, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)


def assert_clean_error(proc: subprocess.CompletedProcess, out: Path, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1, proc.stderr[-3000:]
    for needle in needles:
        assert needle in error_lines[0], error_lines[0]
    assert not out.exists(), f"files were written: {list(out.rglob('*'))}"


@pytest.fixture
def good_data(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "good.jsonl", [CHAT] * 8)


def test_unknown_key(tmp_path: Path, good_data: Path) -> None:
    proc = run(["--config", str(recipe(tmp_path, [str(good_data)], optimiser={"lr": 1}))])
    assert_clean_error(proc, tmp_path / "out", "unknown key 'optimiser'", "optimizer")


def test_unknown_nested_key_from_override(tmp_path: Path, good_data: Path) -> None:
    proc = run(["--config", str(recipe(tmp_path, [str(good_data)])), "stages.0.learning_rate=1e-4"])
    assert_clean_error(proc, tmp_path / "out", "stages.0.learning_rate")


def test_wrong_type(tmp_path: Path, good_data: Path) -> None:
    proc = run(["--config", str(recipe(tmp_path, [str(good_data)])), "train.micro_batch_size=big"])
    assert_clean_error(proc, tmp_path / "out", "train.micro_batch_size", "big")


def test_missing_data_file(tmp_path: Path) -> None:
    proc = run(["--config", str(recipe(tmp_path, [str(tmp_path / "nope.jsonl")]))])
    assert_clean_error(proc, tmp_path / "out", "nope.jsonl", "does not exist")


def test_malformed_jsonl_line_names_file_and_line(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "bad.jsonl", [CHAT, CHAT, '{"messages": [oops', CHAT])
    proc = run(["--config", str(recipe(tmp_path, [str(data)]))])
    assert_clean_error(proc, tmp_path / "out", f"{data}:3", "not valid JSON")


def test_tokenizer_without_chat_template(tmp_path: Path, good_data: Path) -> None:
    model_dir = write_tiny_qwen3(tmp_path / "model")
    (model_dir / "chat_template.jinja").unlink()
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    proc = run(["--config", str(recipe(tmp_path, [str(good_data)])), f"model.name_or_path={model_dir}"])
    assert_clean_error(proc, tmp_path / "out", "no chat template", "data.chat_template")


def test_deepspeed_config_that_does_not_exist(tmp_path: Path, good_data: Path) -> None:
    acc_cfg = yaml.safe_load((REPO / "accelerate_configs" / "zero3.yaml").read_text())
    acc_cfg["deepspeed_config"]["deepspeed_config_file"] = "ds_configs/missing.json"
    cfg_path = tmp_path / "acc.yaml"
    cfg_path.write_text(yaml.safe_dump(acc_cfg))
    launcher = launch_cmd("zero3", 1)
    launcher[launcher.index("--config_file") + 1] = str(cfg_path)
    proc = run(["--config", str(recipe(tmp_path, [str(good_data)]))], launcher=launcher)
    # accelerate launch exits 1 when its child fails; the child's own message is what the user reads.
    assert proc.returncode != 0
    assert "error: The accelerate config names the DeepSpeed config 'ds_configs/missing.json'" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_rows_without_assistant_tokens_are_skipped_not_nan(tmp_path: Path) -> None:
    no_assistant = {"messages": [{"role": "user", "content": "Nothing to learn here."}]}
    data = write_jsonl(tmp_path / "mixed.jsonl", [CHAT, no_assistant] * 6)
    proc = run(["--config", str(recipe(tmp_path, [str(data)]))])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "12 rows, 6 kept" in proc.stderr and "6 skipped with no trainable tokens" in proc.stderr
    records = [r for r in read_metrics(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert len(records) == 2 and all(math.isfinite(r["loss"]) for r in records)


def test_stage_with_no_usable_rows(tmp_path: Path) -> None:
    long_only = write_jsonl(tmp_path / "long.jsonl", [{"text": "word " * 200}] * 4)
    proc = run(["--config", str(recipe(tmp_path, [str(long_only)]))])
    assert_clean_error(proc, tmp_path / "out", "Stage 'only' has no usable rows", "4 dropped over max_seq_len")


def test_non_numeric_difficulty_for_easy_to_hard(tmp_path: Path) -> None:
    rows = [dict(CHAT, difficulty=1), dict(CHAT, difficulty="hard"), dict(CHAT, difficulty=3)]
    data = write_jsonl(tmp_path / "d.jsonl", rows * 3)
    proc = run(["--config", str(recipe(tmp_path, [str(data)])), "stages.0.order=easy_to_hard"])
    assert_clean_error(proc, tmp_path / "out", f"{data}: kept row 2 has difficulty 'hard'")


@pytest.mark.parametrize(("override", "needle"), [
    ("stages.0.data=[{path: a.jsonl, weight: 0}]", "stages.0.data.0"),
    ("stages.0.data=[{path: a.jsonl, weight: 1}, b.jsonl]", "give a weight to every data file"),
    ("stages.0.pacing={kind: linear, start_fraction: 0.5}", "pacing needs order: easy_to_hard"),
    ("stages.0.schedule=continue", "the first stage has no schedule to continue"),
])
def test_bad_curriculum_settings(tmp_path: Path, good_data: Path, override: str, needle: str) -> None:
    proc = run(["--config", str(recipe(tmp_path, [str(good_data)])), override])
    assert_clean_error(proc, tmp_path / "out", needle)


def test_trainable_pattern_that_matches_nothing(tmp_path: Path, good_data: Path) -> None:
    proc = run(["--config", str(recipe(tmp_path, [str(good_data)])), "stages.0.trainable=[lora, model.nrom]"])
    assert_clean_error(proc, tmp_path / "out", "stages.0.trainable: 'model.nrom' matches no module", "model.norm")


VL_MODEL = "model.name_or_path=builtin:tiny-qwen2.5-vl"


def vl_row(*images: str) -> dict:
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": "What colour?"}]
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "Red."}],
            "images": list(images)}


@pytest.mark.parametrize(("row", "needle"), [
    (vl_row("images/nope.png"), "image file {base}/images/nope.png does not exist"),
    (vl_row("broken.png"), "image file {base}/broken.png could not be read as an image"),
    (vl_row() | {"images": ["broken.png"]}, "0 {{\"type\": \"image\"}} placeholder(s) in 'messages' but 1 path(s)"),
])
def test_bad_image_rows_name_file_and_line(tmp_path: Path, row: dict, needle: str) -> None:
    (tmp_path / "broken.png").write_bytes(b"not an image")
    data = write_jsonl(tmp_path / "vl.jsonl", [CHAT, CHAT, row, CHAT])
    proc = run(["--config", str(recipe(tmp_path, [str(data)])), VL_MODEL])
    assert_clean_error(proc, tmp_path / "out", f"{data}:3: " + needle.format(base=tmp_path))


def test_packing_with_a_vision_language_model(tmp_path: Path, good_data: Path) -> None:
    proc = run(["--config", str(recipe(tmp_path, [str(good_data)])), VL_MODEL, "data.packing=true"])
    assert_clean_error(proc, tmp_path / "out", "data.packing is not supported for vision-language models")
