"""A curriculum steered by what the model can do, through whole runs of recipes/smoke_curriculum_gated.yaml: stage
'learn' (nine questions answered "blue") ends once its generation eval answers all nine exactly; stage 'overwrite'
answers them "red". With eval.all_stages every eval asks both stages' questions: the forgetting matrix.

One single-process reference run (a real process, TensorBoard on) is shared by the tests of the gate, the
completions, the trackers and the matrix; a ZeRO-3 run on 2 processes and a run killed just after its gate fired
and resumed must reproduce it. (Generation under DDP, FSDP2, ZeRO-2/3 and offload at 2 processes is checked by the
curriculum launches of tests/e2e/test_strategies.py.) The replay and required-gate runs go in this process.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

from tests.conftest import LAUNCH_TIMEOUT_S, REPO, dummy_run_args, run_env, run_launch, start_and_signal, train_forked
from tests.helpers.inprocess import Call, invoke
from toolkit.checkpoint.manager import read_meta
from toolkit.evals.forgetting import row_label
from toolkit.metrics.log import read_metrics
from toolkit.runtime.run_dir import RunLayout, committed_checkpoints

pytestmark = pytest.mark.slow

GATED = "recipes/smoke_curriculum_gated.yaml"
REPLAY = "recipes/smoke_curriculum_replay.yaml"
ONE_PROCESS = ("train.micro_batch_size=4",)  # the global batch of 2 processes x micro batch 2: 8


def argv(out: Path, *overrides: str, recipe: str = GATED) -> list[str]:
    return dummy_run_args(f"output_dir={out}", *overrides, recipe=str(REPO / recipe))


def one_process_cmd(out: Path, *overrides: str) -> list[str]:
    return [sys.executable, str(REPO / "train_curriculum.py"), *argv(out, *ONE_PROCESS, *overrides)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("steering") / "reference"
    proc = run_launch(one_process_cmd(out, "logging.trackers=[tensorboard]"), env=run_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def records(out: Path, kind: str) -> list[dict]:
    return read_metrics(out / "metrics.jsonl", kind)


def events(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "event" in r]


def completions(out: Path) -> dict[str, list[dict]]:
    """Every completions file, by stage and step, without the file paths (another output dir)."""
    return {f"{p.parent.name}/{p.name}": [{k: v for k, v in json.loads(line).items() if k != "where"}
                                          for line in p.read_text().splitlines()]
            for p in sorted(RunLayout(out).evals.glob("*/step-*.jsonl"))}


def matrix(out: Path) -> list[dict]:
    return read_metrics(RunLayout(out).eval_matrix)


def page(out: Path) -> dict:
    """The data the run's report.html draws (its one run)."""
    text = RunLayout(out).report.read_text()
    return json.loads(text.split('<script type="application/json" id="report-data">')[1].split("</script>")[0])[
        "runs"][0]


def test_the_gate_ends_stage_one_once_its_answers_are_right(reference: Path) -> None:
    train_records = records(reference, "train")
    assert [(r["step"], r["stage"]) for r in train_records] == [(s, "learn") for s in range(1, 5)] + [
        (s, "overwrite") for s in range(5, 13)]  # 'learn' may run 12 steps: its gate ended it after 4
    evals = [r for r in read_metrics(reference / "metrics.jsonl") if "facts.exact" in r]
    assert [(r["step"], r["facts.exact"]) for r in evals][:2] == [(2, 0.0), (4, 1.0)]
    assert all(r["eval_gen_seconds"] > 0 and r["eval_seconds"] >= r["eval_gen_seconds"] for r in evals)
    assert [(e["event"], e["stage"], e["step"]) for e in events(reference)] == [
        ("early_advance", "learn", 4), ("stage_end", "learn", 4), ("stage_end", "overwrite", 12)]
    advance, learnt, overwritten = events(reference)
    assert {k: advance[k] for k in ("reason", "gate", "metric", "value")} == {
        "reason": "gate", "gate": "facts.exact >= 1", "metric": "facts.exact", "value": 1.0}
    assert learnt["ended_by"] == "gate" and learnt["stage_steps"] == 4
    assert learnt["gate"] == {"metric": "facts.exact", "at_least": 1.0, "min_steps": 2, "required": False,
                              "met": True, "met_step": 4, "last": 1.0, "best": 1.0, "best_step": 4}
    assert overwritten["ended_by"] == "planned_length" and "gate" not in overwritten
    # the next stage runs its own schedule from its first step: cosine over its 8 steps, 1 of warmup, peak 1e-2
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    schedule = get_cosine_with_min_lr_schedule_with_warmup(opt, 1, 8, min_lr_rate=0.1).lr_lambdas[0]
    assert [r["lr"] for r in train_records[4:]] == pytest.approx([1e-2 * schedule(k) for k in range(8)], rel=1e-9)


def test_completions_files_and_trackers(reference: Path) -> None:
    files = completions(reference)
    assert list(files) == ["learn/step-00000002.jsonl", "learn/step-00000004.jsonl",
                           *(f"overwrite/step-{s:08d}.jsonl" for s in (6, 8, 10, 12))]
    last = files["overwrite/step-00000012.jsonl"]
    assert [line["eval"] for line in last] == ["facts"] * 9 + ["revised"] * 9  # all_stages: both stages' evals
    first = last[0]
    assert first == {"eval": "facts", "eval_stage": "learn", "row": 0,
                     "prompt": "<|im_start|>user\nWhat colour is the cat?<|im_end|>\n<|im_start|>assistant\n",
                     "output": first["output"], "reference": "blue", "score": {"exact": 0.0}}
    assert {line["output"] for line in last} == {"red"}  # stage 2 overwrote stage 1's answers
    assert last[9]["score"] == {"exact": 1.0, "says_red": 1.0}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = list((RunLayout(reference).trackers).rglob("events.out.tfevents.*"))
    assert runs
    board = EventAccumulator(str(runs[0].parent), size_guidance={"tensors": 0}).Reload()
    tags = board.Tags()["tensors"]
    assert "completions/overwrite/revised/text_summary" in tags and "facts.exact" in board.Tags()["scalars"]
    text = board.Tensors("completions/overwrite/revised/text_summary")[-1]
    assert text.step == 12 and b"What colour is the cat?" in text.tensor_proto.string_val[0]


def test_forgetting_matrix_and_its_plot(reference: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    values = {(r["step"], r["eval_stage"], r["eval"], r["metric"]): r["value"] for r in matrix(reference)}
    assert {(k[1], k[2], k[3]) for k in values} == {("learn", "loss", "eval_loss"), ("overwrite", "loss", "eval_loss"),
                                                    ("learn", "facts", "exact"), ("overwrite", "revised", "exact"),
                                                    ("overwrite", "revised", "says_red")}
    assert sorted({k[0] for k in values}) == [2, 4, 6, 8, 10, 12]
    assert values[(4, "learn", "facts", "exact")] == 1.0 and values[(12, "learn", "facts", "exact")] == 0.0
    assert values[(12, "learn", "loss", "eval_loss")] > values[(4, "learn", "loss", "eval_loss")]  # forgotten
    assert values[(12, "overwrite", "revised", "exact")] == 1.0
    assert {r["stage"] for r in matrix(reference) if r["step"] <= 4} == {"learn"}
    rc, stderr = invoke(Call(["plot", str(reference)], reference, tool="toolkit"), reference, monkeypatch)
    assert rc == 0, stderr
    layout = RunLayout(reference)
    assert layout.plot.is_file() and layout.matrix_plot.read_bytes().startswith(b"\x89PNG")


ARTIFACTS = REPO / "test-artifacts"
"""Where the browser test leaves its screenshots (docs/images/report.png is its report-top.png)."""


def test_the_report_page_in_a_browser(reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The page the run kept up to date (report.html, rewritten at every eval, stage end and the run's end), in
    headless Chromium from the system's packages driven by Playwright: it draws without a console error, one band
    per stage in every chart, the forgetting matrix's cells with the values of evals/matrix.jsonl, and one
    completion per line of the files under evals/. `toolkit report` on the finished run writes the same page."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: pip install -e '.[browser]' (scripts/test.sh does)")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("no chromium on PATH: apt-get install chromium (.ci/run installs it)")
    layout = RunLayout(reference)
    again = tmp_path / "again.html"
    rc, stderr = invoke(Call(["report", str(reference), "--out", str(again)], again, tool="toolkit"), tmp_path,
                        monkeypatch)
    assert rc == 0, stderr
    assert again.read_text() == layout.report.read_text()  # the live page is the finished run's page

    stages = [e["stage"] for e in events(reference) if e["event"] == "stage_end"]
    cells = {(r["metric"], row_label(r), r["step"]): r["value"] for r in matrix(reference)}
    files = {p.relative_to(reference).as_posix(): len(p.read_text().splitlines())
             for p in sorted(layout.evals.glob("*/step-*.jsonl"))}
    losses = [r["loss"] for r in records(reference, "train")]
    assert stages == ["learn", "overwrite"] and len(cells) == 30 and sum(files.values()) == 108 and len(losses) == 12
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(layout.report.as_uri())
            page.wait_for_selector("body[data-drawn=true]", timeout=30_000)
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=ARTIFACTS / "report.png", full_page=True)
            # the README's picture (docs/images/report.png): the top of the page, down to the forgetting matrix's
            # first two heatmaps
            heatmaps = page.locator("#matrix .heatwrap").nth(1).bounding_box()
            assert heatmaps is not None
            page.screenshot(path=ARTIFACTS / "report-top.png", full_page=True,
                            clip={"x": 0, "y": 0, "width": 1280, "height": heatmaps["y"] + heatmaps["height"] + 24})
            assert errors == []
            charts = page.locator("[data-panel]")
            assert charts.count() >= 5  # loss, lr, grad norm, tokens/s, memory, generation evals (no MFU on CPU)
            for i in range(charts.count()):
                bands = charts.nth(i).locator("rect.band")
                assert [bands.nth(j).get_attribute("data-stage") for j in range(bands.count())] == stages
            assert page.locator("table.stages tbody tr").all_inner_texts()[0].count("gate: facts.exact") == 1
            train_loss = page.locator("[data-panel=loss] path[data-series='train loss']").get_attribute("d")
            assert train_loss is not None and train_loss.count("L") == len(losses) - 1  # every step drawn

            shown = page.eval_on_selector_all("g.cell", "gs => gs.map(g => [g.dataset.metric, g.dataset.row, "
                                              "Number(g.dataset.step), Number(g.dataset.value), "
                                              "g.querySelector('text').textContent])")
            assert {(m, row, step): value for m, row, step, value, _ in shown} == cells
            assert all(text == f"{value:.2f}" for *_, value, text in shown)

            def completions_shown() -> dict[str, int]:
                found = page.eval_on_selector_all("[data-completion]:not(.dim)", "ts => ts.map(t => t.dataset.file)")
                return {f: found.count(f) for f in sorted(set(found))}

            assert completions_shown() == files
            page.select_option("#completions-eval", "revised")
            assert sum(completions_shown().values()) == 9 * 6  # stage 2's 9 questions, at all 6 evaluations
            page.select_option("#completions-score", "says_red = 1")
            red = sum(1 for path in layout.evals.glob("*/step-*.jsonl") for line in path.read_text().splitlines()
                      if json.loads(line)["score"].get("says_red") == 1.0)
            assert 0 < sum(completions_shown().values()) == red

            box = page.locator("[data-panel=loss] svg.chart").bounding_box()
            assert box is not None
            page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.5)  # hover: the values
            tip = page.locator("[data-panel=loss] .tip").inner_text()
            step = int(tip.split("step ")[1].split()[0])
            assert f"train loss: {float(f'{losses[step - 1]:.4g}'):g}" in tip
            page.locator("[data-panel=loss] button.toggle").click()  # log scale: drawn again, bands and all
            assert page.locator("[data-panel=loss] rect.band").count() == len(stages) and errors == []

            both = tmp_path / "both.html"  # two runs side by side: curves overlaid, one heatmap set per run
            assert invoke(Call(["report", str(reference), str(reference), "--out", str(both)], both, tool="toolkit"),
                          tmp_path, monkeypatch)[0] == 0
            page.goto(both.as_uri())
            page.wait_for_selector("body[data-drawn=true]", timeout=30_000)
            assert page.locator("[data-panel=loss] path.series").count() == 2 * 3  # train loss and 2 eval sets
            assert page.locator("g.cell").count() == 2 * len(cells) and errors == []
        finally:
            browser.close()


def test_two_processes_under_zero3_decide_and_generate_alike(reference: Path, tmp_path: Path) -> None:
    """Rank 0's metrics decide the gate on every rank: the stage ends at the same step on both, and losses,
    completions (nine prompts in batches of 4, 4 and 1: 8 on one rank, 1 on the other) and matrix are the single
    process's."""
    out = tmp_path / "zero3"
    train_forked("zero3", 2, out, "logging.trackers=[]", recipe=GATED)
    got, expected = records(out, "train"), records(reference, "train")
    assert [(r["step"], r["stage"]) for r in got] == [(r["step"], r["stage"]) for r in expected]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], rel=1e-5)
    assert [(e["event"], e["step"], e.get("gate")) for e in events(out)] == [
        (e["event"], e["step"], e.get("gate")) for e in events(reference)]
    assert completions(out) == completions(reference)
    assert [{k: v for k, v in r.items() if k != "value"} for r in matrix(out)] == [
        {k: v for k, v in r.items() if k != "value"} for r in matrix(reference)]
    assert [r["value"] for r in matrix(out)] == pytest.approx([r["value"] for r in matrix(reference)], rel=1e-5)


def test_sigkill_just_after_the_gate_resumes_in_the_next_stage_exactly(reference: Path, tmp_path: Path) -> None:
    """Checkpoints at stage ends only: the one written where the gate ended 'learn' (step 4) is the newest when the
    run is killed in 'overwrite'. The resumed run must place step 5 in 'overwrite' (the stage lengths the gate made),
    with its schedule, and redo the same evals."""
    out = tmp_path / "killed"
    cmd = one_process_cmd(out, "logging.trackers=[]")
    proc = start_and_signal(cmd, out, 5, signal.SIGKILL)
    proc.wait(timeout=60)
    assert [read_meta(c)["step"] for c in committed_checkpoints(out / "checkpoints")] == [4]
    assert read_meta(committed_checkpoints(out / "checkpoints")[0])["curriculum"]["stage_steps"] == [4, 8]
    killed = page(out)  # the page of its last evaluation and stage end (a SIGKILL leaves no time for another)
    assert not killed["finished"] and [(s["name"], s["state"]) for s in killed["stages"]] == [
        ("learn", "done"), ("overwrite", "waiting")] and len(killed["completions"]["files"]) == 2
    resumed = run_launch(cmd, env=run_env(), timeout=LAUNCH_TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed (exact) from" in resumed.stderr and "step 4 of 12, stage 'learn'" in resumed.stderr
    got, expected = records(out, "train"), records(reference, "train")
    assert [(r["step"], r["stage"]) for r in got] == [(r["step"], r["stage"]) for r in expected]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], rel=1e-6)
    assert [r["lr"] for r in got] == pytest.approx([r["lr"] for r in expected], rel=1e-9)
    assert [(e["event"], e["step"]) for e in events(out)] == [(e["event"], e["step"]) for e in events(reference)]
    assert completions(out) == completions(reference)
    assert [(r["step"], r["eval"], r["metric"]) for r in matrix(out)] == [
        (r["step"], r["eval"], r["metric"]) for r in matrix(reference)]
    assert page(out)["finished"] and page(out)["matrix"] == matrix(out)


@pytest.mark.usefixtures("one_thread")
def test_replay_keeps_stage_ones_answers(reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """recipes/smoke_curriculum_replay.yaml: stage 1's data mixed into stage 2 at weight 1 in 4. At the end of
    stage 2, stage 1's questions are still answered right and their eval loss is lower than without replay."""
    out = tmp_path / "replay"
    rc, stderr = invoke(Call(argv(out, *ONE_PROCESS, "logging.trackers=[]", recipe=REPLAY), out), tmp_path,
                        monkeypatch)
    assert rc == 0, stderr[-3000:]

    def at_end(run: Path) -> dict[tuple[str, str], float]:
        return {(r["eval_stage"], r["metric"]): r["value"] for r in matrix(run) if r["step"] == 12}

    replayed, plain = at_end(out), at_end(reference)
    assert replayed[("learn", "exact")] == 1.0 and plain[("learn", "exact")] == 0.0
    assert replayed[("learn", "eval_loss")] < plain[("learn", "eval_loss")]
    assert replayed[("overwrite", "eval_loss")] > plain[("overwrite", "eval_loss")]  # the price: slower stage 2


@pytest.mark.usefixtures("one_thread")
def test_a_required_gate_left_unmet_stops_the_run_and_its_resume(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "required"
    call = Call(argv(out, *ONE_PROCESS, "logging.trackers=[]", "stages.0.max_steps=2",
                     "stages.0.advance_when={metric: facts.exact, at_least: 1.0, required: true}"), out)
    rc, stderr = invoke(call, tmp_path, monkeypatch)
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert rc == 2 and len(errors) == 1, stderr[-3000:]
    assert errors[0].startswith("error: stage 'learn' reached its length (2 steps, step 2) without meeting "
                                "advance_when facts.exact >= 1 (last 0, best 0 at step 2), and the gate is required")
    assert [read_meta(c)["step"] for c in committed_checkpoints(out / "checkpoints")] == [2]  # nothing lost
    summary = events(out)[-1]
    assert summary["event"] == "stage_end" and summary["gate"]["met"] is False and not (out / "final").exists()
    stopped = page(out)  # rewritten as the run stopped: how far it got, and why
    assert not stopped["finished"] and stopped["last_step"] == 2 and stopped["stages"][0]["gate"]["met"] is False
    before = (out / "metrics.jsonl").read_text()
    rc, stderr = invoke(call, tmp_path, monkeypatch)  # the same command resumes at the stage end: it stops again
    assert rc == 2 and [line for line in stderr.splitlines() if line.startswith("error: ")] == errors
    assert (out / "metrics.jsonl").read_text() == before and not (out / "final").exists()


def test_generation_evals_run_over_a_bf16_base_under_bf16_mixed_precision(tmp_path: Path) -> None:
    """The GPU launch's precision (a bf16 base, fp32 adapters, bf16 autocast): the generation eval generates under
    the launch's autocast, as the training forward runs. Outside it the adapters, whose input casts are off for
    the run, were fed bf16 hidden states and the first eval failed ('expected m1 and m2 to have the same dtype')."""
    out = tmp_path / "bf16"
    proc = train_forked("single", 1, out, "model.dtype=bfloat16", "stages.0.max_steps=2", "stages.1.max_steps=1",
                        "eval.every_steps=2", "logging.trackers=[]", recipe=str(REPO / GATED),
                        mixed_precision="bf16", check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["facts.exact"] for r in records(out, "eval") if "facts.exact" in r], records(out, "eval")
