"""The report page as Chromium draws it, on run folders written here in the layout training writes: what a long
run, an attacker's completion text and a flood of metric keys do to it (issue 48). One browser for the three;
the page of a real run in a browser is tests/e2e/test_steering.py's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from toolkit.metrics import report as page
from toolkit.metrics.log import to_json_line
from toolkit.runtime.run_dir import RunLayout

LONG = 150_000
"""Logged steps: past the ~125k at which `Math.min(...values)` overflows Chromium's stack."""

EVIL = '<img src="x" onerror="document.title=\'owned\'"><b id="bold">bold</b>'


def _long_run(root: Path) -> Path:
    layout = RunLayout(root)
    root.mkdir()
    layout.run_json.write_text(json.dumps({"run_name": "long", "stages": [
        {"index": 0, "name": "only", "steps": LONG, "start_step": 0, "lr": 1e-4, "global_batch": 8}]}))
    layout.recipe.write_text("stages:\n- name: only\n  data: [a.jsonl]\n  objective: grpo\n"
                             "  rewards: [{scorer: contains}]\n")
    lines = [f'{{"step":{s},"stage_index":0,"loss":{2.0 / (1 + s / 1000) + (s % 7) / 100:.6g}}}\n'
             for s in range(1, LONG + 1)]
    many = {"step": LONG, "stage_index": 0, "eval_loss": 1.0} | {f"k{i}": float(i) for i in range(200)}
    lines.append(to_json_line(many))
    layout.metrics.write_text("".join(lines))
    path = layout.completions("only", LONG)
    path.parent.mkdir(parents=True)
    path.write_text(to_json_line({"eval": "facts", "eval_stage": "only", "row": 0, "prompt": EVIL, "output": EVIL,
                                  "reference": EVIL, "score": {"exact": 0.0}}))
    rollouts = layout.rollouts / "only.jsonl"  # a grpo stage's group of 2 completions, as rl_stage writes it
    rollouts.parent.mkdir()
    rollouts.write_text("".join(to_json_line(
        {"step": LONG, "stage": "only", "slot": j, "prompt": 3, "sample": j, "where": "p.jsonl:4",
         "completion": EVIL if j == 0 else "plain", "rewards": [float(j == 0)], "advantage": 0.7 - 1.4 * j,
         "truncated": False, **({"prompt_text": EVIL, "reference": "e"} if j == 0 else {})}) for j in range(2)))
    return root


def test_a_150k_step_run_an_html_completion_and_200_metric_keys_in_chromium(tmp_path: Path) -> None:
    """A 150k-step run draws every chart without a script error, its loss path thinned for drawing (at most four
    points per pixel column) while the page's data keeps every step; a completion holding `<img onerror>` shows
    as text and runs nothing, in an eval's cell and in an RL stage's group of completions (one cell, each member
    with its rewards by name and its advantage); metric keys past MAX_CURVES are named on the page, not drawn."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: pip install -e '.[browser]' (scripts/test.sh does)")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("no chromium on PATH: apt-get install chromium (.ci/run installs it)")
    target = page.write_report(_long_run(tmp_path / "run"))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium)
        try:
            tab = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            tab.on("pageerror", lambda e: errors.append(str(e)))
            tab.goto(target.as_uri())
            tab.wait_for_selector("body[data-drawn=true]", timeout=60_000)
            assert errors == []
            title = tab.title()
            kept = tab.evaluate("JSON.parse(document.getElementById('report-data').textContent)"
                                ".runs[0].train.steps.length")
            assert kept == LONG
            d = tab.locator("[data-panel=loss] path[data-series='train loss']").get_attribute("d")
            assert d is not None and 1000 < d.count("L") + 1 <= 4 * (1000 - 64 - 26)

            shown = tab.locator("[data-completion]").all_inner_texts()
            assert shown and all(EVIL in text for text in shown)  # the markup as text, whole
            assert tab.locator("#completions img, #completions #bold").count() == 0
            group = tab.locator("[data-completion][data-group='2']")  # an RL prompt's group in one cell
            assert group.count() == 1 and group.get_attribute("data-eval") == "rollout only"
            assert all(t in group.inner_text() for t in ("plain", "contains 1", "contains 0", "advantage 0.7",
                                                          "advantage -0.7"))
            assert tab.title() == title and "owned" not in title and errors == []

            note = tab.locator("[data-dropped-keys]")
            assert note.get_attribute("data-dropped-keys") == str(201 - page.MAX_CURVES)
            assert "k199" in note.inner_text()
            assert tab.locator("[data-panel]").count() < page.MAX_CURVES + 10
        finally:
            browser.close()
