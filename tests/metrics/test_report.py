"""The report page's data and file, from run folders written here (a 10k-step run in the layout training writes);
the page as a browser draws it is tested on a real run in tests/e2e/test_steering.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from toolkit.commands import cli
from toolkit.errors import ToolkitError
from toolkit.metrics import report as page
from toolkit.metrics.log import to_json_line
from toolkit.runtime.run_dir import RunLayout

STEPS, EVERY, PROMPTS = 10_000, 500, 50


def write_run(root: Path, *, steps: int = STEPS, every: int = EVERY, prompts: int = PROMPTS,
              output_chars: int = 200) -> Path:
    """A run folder as a finished two-stage run writes it: every step logged, an eval every `every` steps with two
    generation evals of `prompts` prompts each, the forgetting matrix, final/README.md."""
    layout = RunLayout(root)
    half = steps // 2
    plans = [{"index": i, "name": n, "steps": half, "start_step": i * half, "lr": 2e-4, "global_batch": 64,
              "schedule": "cosine"} for i, n in enumerate(["general", "domain"])]
    root.mkdir(parents=True)
    layout.run_json.write_text(json.dumps({"run_name": "r", "strategy": "zero3", "num_processes": 8,
                                           "effective_batch": 64, "mixed_precision": "bf16", "stages": plans,
                                           "trainable_params": [43_646_976, 43_646_976]}))
    layout.recipe.write_text("output_dir: x\nstages:\n- name: general\n  data: [a.jsonl]\n"
                             "- name: domain\n  data: [{path: b.jsonl, weight: 9}, {path: a.jsonl, weight: 1}]\n"
                             "  order: easy_to_hard\n")
    lines, matrix = [], []
    for step in range(1, steps + 1):
        stage = int(step > half)
        header = {"step": step, "stage": plans[stage]["name"], "stage_index": stage}
        lines.append(to_json_line({**header, "stage_step": step - stage * half, "loss": 2.0 / (1 + step / 1000),
                                   "tokens": step * 262_144, "tokens_per_sec": 41_234.5 + step % 97,
                                   "samples_per_sec": 10.1, "step_time": 6.35, "mfu": 0.4123 + step % 13 / 1e4,
                                   "padding_fraction": 0.0, "peak_memory_gb": 61.25 + step % 7 / 100,
                                   "skipped": 0, "lr": 2e-4 * (1 - step / steps) + 1e-7,
                                   "grad_norm": 0.5 + step % 31 / 100, "samples": step * 64}))
        if step % every == 0:
            lines.append(to_json_line({**header, "eval_loss": 1.5, "general.eval_loss": 1.4,
                                       "domain.eval_loss": 1.6, "facts.exact": 0.5, "recall.exact": 0.25}))
            for owner in ("general", "domain"):
                matrix.append({**header, "eval_stage": owner, "eval": "loss", "metric": "eval_loss", "value": 1.4})
            folder = layout.completions(plans[stage]["name"], step)
            folder.parent.mkdir(parents=True, exist_ok=True)
            folder.write_text("".join(to_json_line(
                {"eval": e, "eval_stage": plans[k]["name"], "row": i, "where": f"e.jsonl:{i + 1}",
                 "prompt": f"<|im_start|>user\nQuestion {i} of {e}?<|im_end|>\n<|im_start|>assistant\n",
                 "output": "x" * output_chars, "reference": "x", "score": {"exact": float(i % 2)}})
                for k, e in enumerate(("facts", "recall")) for i in range(prompts)))
        if step in (half, steps):
            lines.append(to_json_line({**header, "event": "stage_end", "stage_steps": half, "stage_samples": 1,
                                       "stage_tokens": 2, "trainable_params": 3, "ended_by": "planned_length"}))
    layout.metrics.write_text("".join(lines))
    layout.eval_matrix.write_text("".join(to_json_line(r) for r in matrix))
    layout.final.mkdir()
    layout.model_card.write_text("---\nlibrary_name: peft\n---\n# r\n")
    return root


def page_data(text: str) -> dict:
    found = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', text, re.S)
    assert found is not None
    return json.loads(found.group(1))


def test_a_10k_step_run_fits_in_2_mb_with_every_step_kept(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = write_run(tmp_path / "run")
    target = page.write_report(run)
    size = target.stat().st_size
    with capsys.disabled():
        print(f"\nreport.html of a {STEPS}-step run (logged every step, 20 evals x 100 completions): "
              f"{size / 1e6:.2f} MB")
    assert size < 2_000_000
    data = page_data(target.read_text())["runs"][0]
    assert data["train"]["steps"] == list(range(1, STEPS + 1))  # every logged step, not a sample of them
    assert data["train"]["values"]["loss"][999] == float(f"{2.0 / 2:.6g}")
    assert len(data["eval"]["steps"]) == STEPS // EVERY
    assert sum(len(f["rows"]) for f in data["completions"]["files"]) == STEPS // EVERY * 2 * PROMPTS
    assert [(s["name"], s["start"], s["steps"], s["ended_by"]) for s in data["stages"]] == [
        ("general", 0, STEPS // 2, "planned_length"), ("domain", STEPS // 2, STEPS // 2, "planned_length")]
    assert data["stages"][1]["mixture"] == [{"source": "b.jsonl", "weight": 9}, {"source": "a.jsonl", "weight": 1}]
    assert data["finished"] and data["card"].startswith("---")


def test_completion_texts_are_cut_evenly_past_the_budget_and_no_row_is_dropped(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    run = write_run(tmp_path / "run", steps=40, every=10, prompts=5, output_chars=5000)
    monkeypatch.setattr(page, "COMPLETIONS_BUDGET", 20_000)
    completions = page.read_run(run)["completions"]
    assert sum(len(f["rows"]) for f in completions["files"]) == 4 * 2 * 5
    output = completions["files"][0]["rows"][0]["output"]
    limit = 20_000 // (10 + 10 + 40)  # the budget shared by 10 prompts, 10 references and 40 outputs
    assert completions["cut_to"] == limit
    assert output.startswith("x" * limit) and output.endswith(
        f"[... {5000 - limit} more characters in evals/general/step-00000010.jsonl]")


def test_a_run_in_progress_and_text_that_would_end_the_script(tmp_path: Path) -> None:
    """A run stopped in its second stage: the stage is shown running, the next one waiting; a completion holding
    `</script>` stays data (the page's JSON is read back whole)."""
    run = write_run(tmp_path / "run", steps=40, every=10, prompts=2)
    layout = RunLayout(run)
    kept = [line for line in layout.metrics.read_text().splitlines() if json.loads(line)["step"] <= 30]
    layout.metrics.write_text("\n".join(kept[:-1]) + "\n")  # the stage_end of stage 2 never came
    shutil_rmtree(layout.final)
    evil = "</script><script>document.title='owned'</script><!--"
    path = layout.completions("domain", 30)
    path.write_text(to_json_line({"eval": "evil", "row": 0, "prompt": evil, "output": evil, "score": {}}))
    text = page.write_report(run).read_text()
    data = page_data(text)["runs"][0]
    assert [(s["state"], s["steps"]) for s in data["stages"]] == [("done", 20), ("running", 10)]
    assert not data["finished"] and data["card"] is None and data["last_step"] == 30
    at_30 = next(f for f in data["completions"]["files"] if f["step"] == 30)
    assert data["completions"]["prompts"][-1]["prompt"] == evil == at_30["rows"][0]["output"]
    assert text.count("</script>") == 2  # the data's and the code's own ends


def shutil_rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path)


def test_toolkit_report_several_runs_and_what_it_refuses(tmp_path: Path) -> None:
    a, b = write_run(tmp_path / "a", steps=20, every=10), write_run(tmp_path / "b", steps=20, every=10)
    RunLayout(b).recipe.write_text(RunLayout(b).recipe.read_text().replace("order: easy_to_hard", "order: shuffle"))
    out = tmp_path / "both.html"
    assert cli.main(["report", str(a), str(b), "--out", str(out)]) == 0
    runs = page_data(out.read_text())["runs"]
    assert [r["name"] for r in runs] == ["a", "b"]
    differ = {k for k in runs[0]["recipe_flat"] if runs[0]["recipe_flat"][k] != runs[1]["recipe_flat"].get(k)}
    assert differ == {"stages.1.order"}
    assert cli.main(["report", str(a), str(b), "--out", str(out)]) == 0  # its own page: replaced
    assert page.report([a]) == RunLayout(a).report

    notes = tmp_path / "notes.html"
    notes.write_text("<html>my notes</html>")
    for runs_, target, says in (([a, b], None, "need --out FILE"), ([tmp_path], out, "is not a run's output dir"),
                                ([a], notes, "is not a report page"), ([a], tmp_path, "is a folder")):
        with pytest.raises(ToolkitError, match=re.escape(says)):
            page.report(runs_, target)
    assert notes.read_text() == "<html>my notes</html>"


def test_a_failure_to_draw_never_stops_the_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    layout = RunLayout(tmp_path / "not-yet")
    page.refresh_report(layout)
    assert not layout.report.exists()
    assert "report.html was not updated: ToolkitError" in caplog.text


def test_the_page_never_reads_through_a_link(tmp_path: Path) -> None:
    """Issue 48: a linked final/README.md, recipe.yaml or completions folder (to a key outside the run) is not read;
    the page names what it left out. `toolkit report` and the live page share read_run."""
    run = write_run(tmp_path / "run", steps=20, every=10, prompts=2)
    layout = RunLayout(run)
    secret = tmp_path / "id_ed25519"
    secret.write_text('{"step": 1, "loss": 1, "output": "PRIVATE-KEY-BYTES"}\n')
    outside = tmp_path / "elsewhere"
    (outside / "general").mkdir(parents=True)
    (outside / "general" / "step-00000010.jsonl").write_text(to_json_line(
        {"eval": "facts", "row": 0, "prompt": "p", "output": "PRIVATE-KEY-BYTES", "score": {}}))
    layout.model_card.unlink()
    layout.model_card.symlink_to(secret)
    layout.recipe.unlink()
    layout.recipe.symlink_to(secret)
    shutil_rmtree(layout.evals / "domain")
    (layout.evals / "domain").symlink_to(outside / "general")
    assert cli.main(["report", str(run)]) == 0
    text = layout.report.read_text()
    assert "PRIVATE-KEY-BYTES" not in text
    data = page_data(text)["runs"][0]
    assert data["card"] is None and data["recipe"] == ""
    assert sorted(data["not_read"]) == ["evals/domain", "final/README.md", "recipe.yaml"]
    assert {f["stage"] for f in data["completions"]["files"]} == {"general"}


def test_nan_infinity_a_latin1_folder_name_and_12k_metric_keys(tmp_path: Path) -> None:
    """NaN / Infinity in metrics.jsonl and evals/matrix.jsonl and a folder name that is not UTF-8 draw a page
    (they ended `toolkit report` in a traceback); 12k distinct metric keys are capped at MAX_CURVES per kind, the
    rest named on the page (they made a 24 MB page of 0.2 MB of metrics)."""
    import os

    root = Path(os.fsdecode(bytes(tmp_path) + b"/caf\xe9-run"))
    run = write_run(root, steps=20, every=10, prompts=2)
    layout = RunLayout(run)
    with layout.metrics.open("a") as f:
        f.write('{"step": 21, "stage_index": 1, "loss": NaN, "grad_norm": Infinity}\n')
        f.write('{"step": 21, "stage_index": 1, ' + ", ".join(f'"k{i}": {i}' for i in range(12_000)) + "}\n")
        f.write('{"step": NaN, "loss": 1}\n')
    with layout.eval_matrix.open("a") as f:
        f.write('{"step": 20, "stage": "domain", "eval_stage": "general", "eval": "loss", "metric": "m", '
                '"value": NaN}\n')
    assert cli.main(["report", str(run)]) == 0
    text = layout.report.read_text(encoding="utf-8")
    assert len(text) < 400_000
    data = page_data(text)["runs"][0]
    assert data["name"] == "caf\ufffd-run"
    assert data["train"]["values"]["loss"][-1] is None and data["train"]["values"]["grad_norm"][-1] is None
    assert len(data["eval"]["values"]) == page.MAX_CURVES
    assert len(data["dropped_keys"]) == 12_000 + 5 - page.MAX_CURVES  # the 5 eval keys of write_run, then k0...
    assert data["dropped_keys"][-1] == "k11999"
    assert all(r["metric"] != "m" for r in data["matrix"])
