// The report page's drawing (toolkit/metrics/report.py embeds it with the run's data): plain DOM and SVG, no
// library. Sections: runs, stage timeline, curves with stage bands (hover, log scale), forgetting matrix,
// completions by stage and step, recipe (diffed between runs), model card.
(function () {
  "use strict";
  const DATA = JSON.parse(document.getElementById("report-data").textContent);
  const RUNS = DATA.runs;
  const MULTI = RUNS.length > 1;
  const SVGNS = "http://www.w3.org/2000/svg";
  const SERIES_COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#db2777", "#0891b2", "#65a30d"];
  const RUN_COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2"];
  const DASHES = ["", "6 3", "2 3", "8 3 2 3", "1 2"];
  const BANDS = ["#eef2ff", "#fef3c7", "#ecfdf5", "#fce7f3", "#e0f2fe", "#f3e8ff"];
  const BAND_TEXT = ["#4338ca", "#b45309", "#047857", "#be185d", "#0369a1", "#7e22ce"];
  const LABELS = {
    loss: "loss", lr: "learning rate", grad_norm: "grad norm", tokens_per_sec: "tokens / s", mfu: "MFU",
    peak_memory_gb: "peak memory (GiB)",
  };
  const W = 1000, PAD = { l: 64, r: 26, t: 22, b: 28 };

  function el(tag, attrs, parent, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v !== undefined && v !== null) node.setAttribute(k, v);
    }
    if (text !== undefined && text !== null) node.textContent = text;
    if (parent) parent.appendChild(node);
    return node;
  }
  function svg(tag, attrs, parent, text) {
    const node = document.createElementNS(SVGNS, tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v !== undefined && v !== null) node.setAttribute(k, v);
    }
    if (text !== undefined && text !== null) node.textContent = text;
    if (parent) parent.appendChild(node);
    return node;
  }
  function fmt(v) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    const a = Math.abs(v);
    if (a === 0) return "0";
    if (a >= 1e5 || a < 1e-3) return v.toExponential(3).replace(/\.?0+e/, "e").replace("e+", "e");
    return String(Number(v.toPrecision(4)));
  }
  // Never Math.min(...array): an argument spread of a long run's values (~125k logged steps) overflows the stack.
  function minOf(vals) {
    let m = Infinity;
    for (const v of vals) if (v < m) m = v;
    return m;
  }
  function maxOf(vals) {
    let m = -Infinity;
    for (const v of vals) if (v > m) m = v;
    return m;
  }
  function section(id, title, note) {
    const s = el("section", { id: id, class: "card" }, app);
    el("h2", {}, s, title);
    if (note) el("p", { class: "note" }, s, note);
    return s;
  }
  function runLabel(run, i) {
    return MULTI ? `${run.name}` : run.name;
  }
  function swatch(color, parent) {
    return el("span", { class: "swatch", style: `background:${color}` }, parent);
  }

  const app = document.getElementById("app");

  // --- header ------------------------------------------------------------------------------------------------
  const head = el("header", {}, app);
  el("h1", {}, head, RUNS.map((r) => r.name).join("  vs  "));
  const nav = el("nav", {}, head);
  for (const [id, name] of [["timeline", "Stages"], ["curves", "Curves"], ["matrix", "Forgetting matrix"],
    ["completions", "Completions"], ["recipe", "Recipe"], ["card", "Model card"]]) {
    el("a", { href: `#${id}` }, nav, name);
  }
  const runs = el("div", { class: "runs" }, head);
  RUNS.forEach((run, i) => {
    const box = el("div", { class: "run" }, runs);
    if (MULTI) swatch(RUN_COLORS[i % RUN_COLORS.length], box);
    el("strong", {}, box, run.name);
    const total = run.stages.reduce((a, s) => a + (s.state === "done" ? s.steps : Math.max(s.steps, s.planned || 0)), 0);
    const status = run.finished ? "finished" : `no final model yet: running, or stopped at step ${run.last_step}`;
    el("span", { class: run.finished ? "pill ok" : "pill warn" }, box, status);
    const r = run.run || {};
    const facts = [
      `step ${run.last_step} of ${total}`, r.strategy && `strategy ${r.strategy}`,
      r.num_processes && `${r.num_processes} process${r.num_processes > 1 ? "es" : ""}`,
      r.effective_batch && `batch ${r.effective_batch}`, r.mixed_precision && `precision ${r.mixed_precision}`,
      run.skipped ? `${run.skipped} steps skipped` : null,
      r.versions && Object.entries(r.versions).map(([k, v]) => `${k} ${v}`).join(", "),
    ].filter(Boolean);
    el("div", { class: "facts" }, box, facts.join(" · "));
    el("div", { class: "path" }, box, run.path);
  });

  // --- stage timeline ------------------------------------------------------------------------------------------
  const tl = section("timeline", "Stage timeline",
    "Each stage as it ran against its plan: the solid bar is the steps it trained (ran / planned when a gate or " +
    "patience ended it early), a dashed outline the rest of a running stage's planned length.");
  RUNS.forEach((run, ri) => {
    if (MULTI) el("h3", {}, tl, run.name);
    const end = Math.max(1, maxOf(run.stages.map((s) => s.start + Math.max(s.steps, s.planned || 0))));
    const bar = svg("svg", { viewBox: `0 0 ${W} 58`, class: "timeline", "data-run": ri }, tl);
    const x = (s) => PAD.l + (s / end) * (W - PAD.l - PAD.r);
    run.stages.forEach((s, i) => {
      const g = svg("g", { "data-stage": s.name }, bar);
      if (s.planned && s.planned > s.steps && s.state !== "done") {  // ended early (a gate): the next stage is there
        svg("rect", { x: x(s.start), y: 8, width: Math.max(1, x(s.start + s.planned) - x(s.start)), height: 26,
          fill: "none", stroke: BAND_TEXT[i % BANDS.length], "stroke-dasharray": "4 3", rx: 3 }, g);
      }
      svg("rect", { x: x(s.start), y: 8, width: Math.max(1, x(s.start + s.steps) - x(s.start)), height: 26,
        fill: BANDS[i % BANDS.length], stroke: BAND_TEXT[i % BANDS.length], rx: 3 }, g);
      svg("text", { x: x(s.start) + 6, y: 25, class: "bartext", fill: BAND_TEXT[i % BANDS.length] }, g,
        `${s.name} · ${s.steps}${s.planned ? "/" + s.planned : ""} steps`);
      svg("text", { x: x(s.start), y: 50, class: "tick", "text-anchor": "middle" }, bar, s.start);
    });
    svg("text", { x: x(end), y: 50, class: "tick", "text-anchor": "end" }, bar, end);
    const table = el("table", { class: "stages" }, tl);
    const hr = el("tr", {}, el("thead", {}, table));
    for (const h of ["stage", "objective", "steps (ran / planned)", "steps", "ended by", "mixture", "order", "trainable",
      "lr · schedule", "batch", "tokens", "trainable params"]) el("th", {}, hr, h);
    const body = el("tbody", {}, table);
    run.stages.forEach((s, i) => {
      const tr = el("tr", { "data-stage": s.name }, body);
      const name = el("td", {}, tr);
      swatch(BANDS[i % BANDS.length], name).style.border = `1px solid ${BAND_TEXT[i % BANDS.length]}`;
      el("strong", {}, name, s.name);
      // the entry's scoring pass (a dpo stage's reference), apart from the first step's tokens/s and step time
      const entryPass = s.entry_pass_seconds != null ? ` · entry scoring pass ${fmt(s.entry_pass_seconds)} s` : "";
      el("td", { class: "objective" }, tr, (s.objective || "sft") + entryPass);
      el("td", { class: "num" }, tr, `${s.steps} / ${s.planned ?? "?"}`);
      el("td", { class: "num" }, tr, s.state === "waiting" ? "not reached" : `${s.start + 1}–${s.start + s.steps}`);
      el("td", {}, tr, endedBy(s));
      el("td", {}, tr, s.mixture.map((m) => m.weight != null ? `${m.source} ×${m.weight}` : m.source).join(", "));
      el("td", {}, tr, (s.order || "") + (s.pacing ? " (paced)" : ""));
      el("td", {}, tr, (s.trainable || []).join(", "));
      el("td", {}, tr, `${fmt(s.lr)} · ${s.schedule || ""}`);
      el("td", { class: "num" }, tr, s.global_batch ?? "");
      el("td", { class: "num" }, tr, s.tokens != null ? s.tokens.toLocaleString("en") : "");
      el("td", { class: "num" }, tr, s.trainable_params != null ? s.trainable_params.toLocaleString("en") : "");
    });
  });
  function endedBy(s) {
    if (s.state === "running") return "running";
    if (s.state === "waiting") return "";
    const g = s.gate;
    if (s.ended_by === "gate" && g) {
      const rule = g.at_least != null ? `≥ ${fmt(g.at_least)}` : `≤ ${fmt(g.at_most)}`;
      return `gate: ${g.metric} ${rule}, reached ${fmt(g.last)} at step ${g.met_step}`;
    }
    if (s.ended_by === "patience") {
      const best = s.advance && s.advance.best_eval_loss != null ? `, best eval_loss ${fmt(s.advance.best_eval_loss)}` : "";
      return `patience${best}`;
    }
    if (g) {
      const rule = g.at_least != null ? `≥ ${fmt(g.at_least)}` : `≤ ${fmt(g.at_most)}`;
      return `its length; gate ${g.metric} ${rule} not met (best ${fmt(g.best)})`;
    }
    return "its planned length";
  }

  // --- curves --------------------------------------------------------------------------------------------------
  const cv = section("curves", "Curves",
    "One band per stage" + (MULTI ? ` (of ${RUNS[0].name}; the other runs' stage starts are dashed lines)` : "") +
    ". Hover a chart for the values at a step; each chart's log button switches its scale.");
  RUNS.forEach((run) => {  // keys past the page's cap (MAX_CURVES in report.py): named, not drawn
    const dropped = run.dropped_keys || [];
    if (dropped.length) {
      el("p", { class: "note", "data-dropped-keys": dropped.length }, cv, `${MULTI ? run.name + ": " : ""}` +
        `${dropped.length} more metric keys are in metrics.jsonl but not drawn: ${dropped.join(", ")}`);
    }
  });
  const panels = [];
  const trainKeys = [];
  RUNS.forEach((run) => Object.keys(run.train.values).forEach((k) => { if (!trainKeys.includes(k)) trainKeys.push(k); }));
  const evalKeys = [];
  RUNS.forEach((run) => Object.keys(run.eval.values).forEach((k) => { if (!evalKeys.includes(k)) evalKeys.push(k); }));
  const perSetLoss = evalKeys.filter((k) => k.endsWith(".eval_loss"));
  const lossKeys = perSetLoss.length ? perSetLoss : evalKeys.filter((k) => k === "eval_loss");
  // A preference stage's evals (pref_accuracy, eval_rewards/...) have a chart of their own; eval_pairs is a count
  // of pairs, not a score, and is charted nowhere (it would squash the accuracy's axis).
  const isPairEval = (k) => /(^|\.)(pref_accuracy|eval_rewards\/.*)$/.test(k);
  const isCount = (k) => /(^|\.)eval_pairs$/.test(k);
  const scoreKeys = evalKeys.filter((k) => !k.endsWith("eval_loss") && !isPairEval(k) && !isCount(k));
  const pairEvalKeys = evalKeys.filter(isPairEval);
  // Each objective's loss on its own axis (sft's cross-entropy near 6, dpo's near ln 2 = 0.69): one loss chart per
  // objective, each over its stages' steps only (the first objective's keeps the key "loss").
  const kinds = [];
  RUNS[0].stages.forEach((s) => { const k = (s.objective || "sft").split(" ")[0]; if (!kinds.includes(k)) kinds.push(k); });
  const rangesOf = (kind) => RUNS[0].stages.filter((s) => (s.objective || "sft").split(" ")[0] === kind)
    .map((s) => [s.start, s.start + Math.max(s.steps, s.state === "done" ? 0 : s.planned || 0)]);
  const GROUPS = { "rewards/chosen": "rewards", "rewards/rejected": "rewards", "rewards/margins": "rewards",
    "logps/chosen": "logps", "logps/rejected": "logps" };  // as `toolkit plot` draws them: one panel each
  const GROUP_TITLES = { rewards: "rewards (chosen, rejected, margins)", logps: "log-probs (chosen, rejected)" };
  for (const key of trainKeys) {
    if (key === "loss") {
      kinds.forEach((kind, ki) => {
        const ranges = kinds.length > 1 ? rangesOf(kind) : null;
        const series = [{ source: "train", key: "loss", label: "train loss", ranges: ranges }];
        lossKeys.forEach((k) => series.push({ source: "eval", key: k, label: k, dots: true, ranges: ranges }));
        panels.push({ title: kinds.length > 1 ? `loss · ${kind}` : "loss", series: series,
          key: ki === 0 ? "loss" : `loss-${kind}`, wide: true });
      });
      continue;
    }
    const group = GROUPS[key];
    if (group) {
      let panel = panels.find((p) => p.key === group);
      if (!panel) { panel = { title: GROUP_TITLES[group], series: [], key: group }; panels.push(panel); }
      panel.series.push({ source: "train", key: key, label: key });
      continue;
    }
    panels.push({ title: LABELS[key] || key, series: [{ source: "train", key: key, label: LABELS[key] || key }],
      key: key });
  }
  if (scoreKeys.length) {
    panels.push({ title: "generation evals", key: "scores",
      series: scoreKeys.map((k) => ({ source: "eval", key: k, label: k, dots: true })) });
  }
  if (pairEvalKeys.length) {
    panels.push({ title: "pair evals", key: "pair-evals",
      series: pairEvalKeys.map((k) => ({ source: "eval", key: k, label: k, dots: true })) });
  }
  const missing = [];
  const grid = el("div", { class: "panels" }, cv);
  for (const p of panels) {
    const lines = [];
    RUNS.forEach((run, ri) => p.series.forEach((s, si) => {
      const src = run[s.source];
      const vals = src.values[s.key];
      if (!vals) return;
      const pts = [];
      const inside = (step) => !s.ranges || s.ranges.some(([a, b]) => step > a && step <= b);
      for (let i = 0; i < vals.length; i++) if (vals[i] !== null && inside(src.steps[i])) pts.push([src.steps[i], vals[i]]);
      if (!pts.length) return;
      lines.push({ run: ri, label: MULTI ? `${run.name}: ${s.label}` : s.label, pts: pts, dots: s.dots,
        color: MULTI ? RUN_COLORS[ri % RUN_COLORS.length] : SERIES_COLORS[si % SERIES_COLORS.length],
        dash: MULTI ? DASHES[si % DASHES.length] : "" });
    }));
    if (!lines.length) { missing.push(p.title); continue; }
    drawPanel(grid, p, lines);
  }
  if (missing.length) el("p", { class: "note" }, cv, `Not logged by ${MULTI ? "these runs" : "this run"}: ${missing.join(", ")}.`);

  function niceTicks(lo, hi, n) {
    if (!(hi > lo)) { hi = lo + 1; }
    const span = hi - lo, step0 = Math.pow(10, Math.floor(Math.log10(span / n)));
    const err = (n * step0) / span;
    const step = step0 * (err <= 0.15 ? 10 : err <= 0.35 ? 5 : err <= 0.75 ? 2 : 1);
    const out = [];
    // a tick summed to within float noise of zero (+-1e-20 after steps of 0.1) is zero, and labelled 0
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) {
      out.push(Math.abs(v) < step * 1e-9 ? 0 : Number(v.toPrecision(12)));
    }
    return out;
  }
  function decimate(pts, x0, x1, columns) {
    // at most first / lowest / highest / last point of each pixel column: the drawn line looks the same
    if (pts.length <= columns * 4) return pts;
    const out = [], span = (x1 - x0) || 1;
    let col = -1, bucket = [];
    const flush = () => {
      if (!bucket.length) return;
      let lo = bucket[0], hi = bucket[0];
      for (const p of bucket) { if (p[1] < lo[1]) lo = p; if (p[1] > hi[1]) hi = p; }
      const keep = [bucket[0], lo, hi, bucket[bucket.length - 1]].sort((a, b) => a[0] - b[0]);
      for (const p of keep) if (out[out.length - 1] !== p) out.push(p);
    };
    for (const p of pts) {
      const c = Math.floor(((p[0] - x0) / span) * columns);
      if (c !== col) { flush(); bucket = []; col = c; }
      bucket.push(p);
    }
    flush();
    return out;
  }
  function nearest(pts, step) {
    let lo = 0, hi = pts.length - 1;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (pts[mid][0] < step) lo = mid + 1; else hi = mid; }
    if (lo > 0 && Math.abs(pts[lo - 1][0] - step) <= Math.abs(pts[lo][0] - step)) lo -= 1;
    return pts[lo];
  }

  function drawPanel(parent, panel, lines) {
    // the loss and the evals' scores across the page, the others two to a row
    const wide = panel.wide || panel.key === "loss" || panel.key === "scores";
    const W = wide ? 1000 : 560, H = wide ? 240 : 190;
    const box = el("div", { class: wide ? "panel wide" : "panel", "data-panel": panel.key }, parent);
    const bar = el("div", { class: "panelhead" }, box);
    el("h3", {}, bar, panel.title);
    const legend = el("div", { class: "legend" }, bar);
    lines.forEach((l) => { const item = el("span", {}, legend); swatch(l.color, item); item.append(l.label); });
    const logBtn = el("button", { type: "button", class: "toggle", "aria-pressed": "false" }, bar, "log");
    const chart = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "chart" }, box);
    const tip = el("div", { class: "tip" }, box);
    let log = false;
    const stages = RUNS[0].stages;
    const allSteps = lines.flatMap((l) => [l.pts[0][0], l.pts[l.pts.length - 1][0]]);
    const extent = (s) => s.start + (s.state === "done" ? s.steps : Math.max(s.steps, s.planned || 0));
    const stageEnd = Math.max(0, maxOf(RUNS.flatMap((r) => r.stages.map(extent))));  // a live run: its whole plan
    const x0 = 0, x1 = Math.max(stageEnd, maxOf(allSteps), 1);
    const X = (s) => PAD.l + ((s - x0) / (x1 - x0)) * (W - PAD.l - PAD.r);
    function draw() {
      chart.textContent = "";
      const vals = lines.flatMap((l) => l.pts.map((p) => p[1])).filter((v) => !log || v > 0);
      let lo = minOf(vals), hi = maxOf(vals);
      if (!vals.length) { lo = 1; hi = 10; }
      let Y, ticks;
      if (log) {
        const a = Math.floor(Math.log10(lo)), b = Math.ceil(Math.log10(hi)) + (lo === hi ? 1 : 0);
        Y = (v) => H - PAD.b - ((Math.log10(v) - a) / Math.max(b - a, 1e-9)) * (H - PAD.t - PAD.b);
        ticks = [];
        for (let e = a; e <= b; e++) {
          ticks.push(Math.pow(10, e));
          if (b - a <= 2 && e < b) ticks.push(2 * Math.pow(10, e), 5 * Math.pow(10, e));
        }
      } else {
        if (lo === hi) { lo -= Math.abs(lo) * 0.1 || 1; hi += Math.abs(hi) * 0.1 || 1; }
        const pad = (hi - lo) * 0.06;
        lo -= pad; hi += pad;
        if (lo < 0 && minOf(vals) >= 0) lo = 0;
        Y = (v) => H - PAD.b - ((v - lo) / (hi - lo)) * (H - PAD.t - PAD.b);
        ticks = niceTicks(lo, hi, 5);
      }
      stages.forEach((s, i) => {  // a stage not ended yet: its band spans its plan, paler
        const a = X(s.start), b = X(extent(s));
        svg("rect", { x: a, y: PAD.t, width: Math.max(b - a, 1), height: H - PAD.t - PAD.b,
          fill: BANDS[i % BANDS.length], "fill-opacity": s.state === "done" ? 1 : 0.45, class: "band",
          "data-stage": s.name }, chart);
        svg("text", { x: a + 4, y: PAD.t - 6, class: "bandlabel", fill: BAND_TEXT[i % BANDS.length] }, chart, s.name);
      });
      RUNS.slice(1).forEach((run, k) => run.stages.slice(1).forEach((s) => {
        if (s.state === "waiting") return;
        svg("line", { x1: X(s.start), x2: X(s.start), y1: PAD.t, y2: H - PAD.b,
          stroke: RUN_COLORS[(k + 1) % RUN_COLORS.length], "stroke-dasharray": "4 3" }, chart);
      }));
      for (const t of ticks) {
        const y = Y(t);
        if (y < PAD.t - 1 || y > H - PAD.b + 1) continue;
        svg("line", { x1: PAD.l, x2: W - PAD.r, y1: y, y2: y, class: "grid" }, chart);
        svg("text", { x: PAD.l - 6, y: y + 4, class: "tick", "text-anchor": "end" }, chart, fmt(t));
      }
      for (const t of niceTicks(x0, x1, wide ? 10 : 6)) {
        if (t !== Math.round(t)) continue;
        svg("text", { x: X(t), y: H - 8, class: "tick", "text-anchor": "middle" }, chart, t);
      }
      svg("line", { x1: PAD.l, x2: W - PAD.r, y1: H - PAD.b, y2: H - PAD.b, class: "axis" }, chart);
      for (const l of lines) {
        const pts = decimate(l.pts.filter((p) => !log || p[1] > 0), x0, x1, W - PAD.l - PAD.r);
        if (!pts.length) continue;
        const d = pts.map((p, i) => `${i ? "L" : "M"}${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join("");
        svg("path", { d: d, fill: "none", stroke: l.color, "stroke-width": 1.8, "stroke-dasharray": l.dash || null,
          class: "series", "data-series": l.label }, chart);
        if (l.dots && pts.length <= 200) {
          for (const p of pts) svg("circle", { cx: X(p[0]), cy: Y(p[1]), r: 2.8, fill: l.color }, chart);
        }
      }
      const cursor = svg("line", { x1: 0, x2: 0, y1: PAD.t, y2: H - PAD.b, class: "cursor", visibility: "hidden" }, chart);
      const hit = svg("rect", { x: PAD.l, y: PAD.t, width: W - PAD.l - PAD.r, height: H - PAD.t - PAD.b,
        fill: "transparent", class: "hit" }, chart);
      hit.addEventListener("mousemove", (ev) => {
        const rect = chart.getBoundingClientRect();
        const sx = ((ev.clientX - rect.left) * W) / rect.width;
        const step = x0 + ((sx - PAD.l) / (W - PAD.l - PAD.r)) * (x1 - x0);
        const rows = lines.map((l) => { const p = nearest(l.pts, step); return [l, p]; });
        const at = rows.reduce((best, [, p]) => (Math.abs(p[0] - step) < Math.abs(best - step) ? p[0] : best), rows[0][1][0]);
        cursor.setAttribute("x1", X(at)); cursor.setAttribute("x2", X(at)); cursor.setAttribute("visibility", "visible");
        const stage = stages.find((s) => at > s.start && at <= s.start + s.steps);
        tip.textContent = "";
        el("div", { class: "tiphead" }, tip, `step ${at}${stage ? " · " + stage.name : ""}`);
        for (const [l, p] of rows) {
          const row = el("div", {}, tip);
          swatch(l.color, row);
          row.append(`${l.label}: ${fmt(p[1])}${p[0] !== at ? ` (step ${p[0]})` : ""}`);
        }
        tip.style.display = "block";
        const left = ((X(at) / W) * rect.width);
        tip.style.left = `${Math.min(left + 12, rect.width - tip.offsetWidth - 4)}px`;
      });
      hit.addEventListener("mouseleave", () => { tip.style.display = "none"; cursor.setAttribute("visibility", "hidden"); });
    }
    logBtn.addEventListener("click", () => {
      log = !log;
      logBtn.setAttribute("aria-pressed", String(log));
      draw();
    });
    draw();
  }

  // --- forgetting matrix ---------------------------------------------------------------------------------------
  const mx = section("matrix", "Forgetting matrix",
    "Every stage's eval sets at every evaluation (eval.all_stages): one row per eval set, one column per evaluation. " +
    "Bright is good in every panel (a loss's colours are reversed): a row that pales while a later stage trains is " +
    "that stage overwriting what an earlier one taught.");
  const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  function viridis(t) {
    t = Math.max(0, Math.min(1, t));
    const f = t * (VIRIDIS.length - 1), i = Math.min(Math.floor(f), VIRIDIS.length - 2), u = f - i;
    const c = VIRIDIS[i].map((a, k) => Math.round(a + (VIRIDIS[i + 1][k] - a) * u));
    return [`rgb(${c.join(",")})`, 0.299 * c[0] + 0.587 * c[1] + 0.114 * c[2] < 128];
  }
  function rowLabel(r) { return r.eval_stage == null ? String(r.eval) : `${r.eval_stage}: ${r.eval}`; }
  let anyMatrix = false;
  RUNS.forEach((run, ri) => {
    if (!run.matrix.length) return;
    anyMatrix = true;
    if (MULTI) el("h3", {}, mx, run.name);
    const metrics = [...new Set(run.matrix.map((r) => r.metric))];
    const steps = [...new Set(run.matrix.map((r) => r.step))].sort((a, b) => a - b);
    const stageAt = {};
    run.matrix.forEach((r) => { stageAt[r.step] = r.stage; });
    const stageIndex = Object.fromEntries(run.stages.map((s, i) => [s.name, i]));
    for (const metric of metrics) {
      const recs = run.matrix.filter((r) => r.metric === metric);
      const rows = [...new Set(recs.map(rowLabel))];
      const vals = recs.map((r) => r.value);
      const loss = metric.includes("loss");
      const unit = !loss && vals.every((v) => v >= 0 && v <= 1);
      const lo = unit ? 0 : minOf(vals), hi = unit ? 1 : maxOf(vals);
      const CW = 52, CH = 30, LW = Math.max(120, 7.2 * maxOf(rows.map((r) => r.length)) + 16), TOP = 40;
      const wrap = el("div", { class: "heatwrap" }, mx);
      el("h3", {}, wrap, metric + (loss ? " (lower is better)" : ""));
      const width = LW + CW * steps.length + 10, height = TOP + CH * rows.length + 24;
      const hm = svg("svg", { width: width, height: height, viewBox: `0 0 ${width} ${height}`, class: "heatmap",
        "data-run": ri, "data-metric": metric }, wrap);
      steps.forEach((s, j) => {
        const i = stageIndex[stageAt[s]] ?? 0;
        svg("rect", { x: LW + j * CW, y: 4, width: CW, height: 14, fill: BANDS[i % BANDS.length] }, hm);
      });
      steps.forEach((s, j) => {  // the labels over every band (drawn after them, so no band hides one)
        const i = stageIndex[stageAt[s]] ?? 0;
        if (j === 0 || stageAt[steps[j - 1]] !== stageAt[s]) {
          svg("text", { x: LW + j * CW + 3, y: 15, class: "bandlabel", fill: BAND_TEXT[i % BANDS.length] }, hm, stageAt[s]);
          if (j > 0) svg("line", { x1: LW + j * CW, x2: LW + j * CW, y1: 4, y2: TOP + CH * rows.length, class: "stageline" }, hm);
        }
        svg("text", { x: LW + j * CW + CW / 2, y: TOP - 6, class: "tick", "text-anchor": "middle" }, hm, s);
      });
      rows.forEach((name, i) => {
        svg("text", { x: LW - 8, y: TOP + i * CH + CH / 2 + 4, class: "rowlabel", "text-anchor": "end" }, hm, name);
      });
      for (const r of recs) {
        const i = rows.indexOf(rowLabel(r)), j = steps.indexOf(r.step);
        let t = hi > lo ? (r.value - lo) / (hi - lo) : 0.5;
        if (loss) t = 1 - t;
        const [color, dark] = viridis(t);
        const g = svg("g", { class: "cell", "data-step": r.step, "data-row": rowLabel(r), "data-metric": metric,
          "data-value": r.value }, hm);
        svg("rect", { x: LW + j * CW + 1, y: TOP + i * CH + 1, width: CW - 2, height: CH - 2, fill: color, rx: 2 }, g);
        svg("text", { x: LW + j * CW + CW / 2, y: TOP + i * CH + CH / 2 + 4, "text-anchor": "middle",
          class: "cellvalue", fill: dark ? "#fff" : "#111" }, g, r.value.toFixed(2));
        svg("title", {}, g, `${rowLabel(r)} at step ${r.step} (${r.stage}): ${metric} = ${r.value}`);
      }
      svg("text", { x: LW, y: height - 6, class: "tick" }, hm, "step (the stage being trained above)");
    }
  });
  if (!anyMatrix) el("p", { class: "note" }, mx, "No forgetting matrix: it needs eval.all_stages in the recipe, " +
    "and grows at each evaluation.");

  // --- completions ---------------------------------------------------------------------------------------------
  const cp = section("completions", "Completions by stage and step",
    "Each generation eval's prompts (rows) at every evaluation (columns), from evals/<stage>/step-N.jsonl, and " +
    "each RL stage's prompts at every step that drew them (eval \"rollout <stage>\", from rollouts/<stage>.jsonl: " +
    "the prompt's group of completions, each with its rewards and advantage): green where every scorer gave 1, " +
    "red where every scorer gave 0, amber in between. Filter by eval and score.");
  const controls = el("div", { class: "controls" }, cp);
  let runSelect = null;
  if (MULTI) {
    const lab = el("label", {}, controls, "run ");
    runSelect = el("select", { id: "completions-run" }, lab);
    RUNS.forEach((r, i) => el("option", { value: i }, runSelect, r.name));
  }
  const evalLabel = el("label", {}, controls, "eval ");
  const evalSelect = el("select", { id: "completions-eval" }, evalLabel);
  const scoreLabel = el("label", {}, controls, "score ");
  const scoreSelect = el("select", { id: "completions-score" }, scoreLabel);
  const countLine = el("span", { class: "count" }, controls);
  const gridBox = el("div", { class: "gridbox" }, cp);
  function readable(prompt) {
    // a ChatML prompt as "role: text" lines, without the template's markers and the open assistant turn
    if (!prompt.includes("<|im_start|>")) return prompt;
    return prompt.replace(/<\|im_end\|>\n?/g, "").replace(/<\|im_start\|>(\w+)\n/g, "$1: ")
      .replace(/\n?assistant: ?$/, "").trim();
  }
  function verdict(score) {
    const vals = Object.values(score || {}).filter((v) => v !== null);
    if (!vals.length) return "none";
    if (vals.every((v) => v >= 1)) return "pass";
    if (vals.every((v) => v <= 0)) return "fail";
    return "part";
  }
  function drawCompletions() {
    const ri = runSelect ? Number(runSelect.value) : 0;
    const c = RUNS[ri].completions;
    const evalsHere = [...new Set(c.prompts.map((p) => p.eval))];
    const scorers = [...new Set(c.files.flatMap((f) => f.rows.flatMap((r) => Object.keys(r.score || {}))))];
    for (const [sel, options] of [[evalSelect, ["all", ...evalsHere]],
      [scoreSelect, ["any", ...scorers.flatMap((s) => [`${s} = 1`, `${s} < 1`])]]]) {
      const keep = options.includes(sel.value) ? sel.value : options[0];
      sel.textContent = "";
      options.forEach((o) => el("option", { value: o }, sel, o === "all" ? "every eval" : o === "any" ? "any score" : o));
      sel.value = keep;
    }
    const ev = evalSelect.value, sc = scoreSelect.value;
    const match = (r) => {
      if (sc === "any") return true;
      const [name, op] = sc.split(" ");
      const v = (r.score || {})[name];
      return v !== undefined && v !== null && (op === "=" ? v >= 1 : v < 1);
    };
    gridBox.textContent = "";
    const total = c.files.reduce((a, f) => a + f.rows.length, 0);
    if (!c.files.length) {
      el("p", { class: "note" }, gridBox, "No completions: the run has no generation evals, or has not evaluated yet.");
      countLine.textContent = "";
      return;
    }
    const cells = {};  // prompt id -> file index -> its rows there (an RL prompt's group: several)
    c.files.forEach((f, fi) => f.rows.forEach((r) => {
      const at = (cells[r.p] = cells[r.p] || {});
      (at[fi] = at[fi] || []).push(r);
    }));
    const shownPrompts = c.prompts.map((p, i) => [p, i]).filter(([p, i]) => (ev === "all" || p.eval === ev) &&
      Object.values(cells[i] || {}).some((rows) => rows.some(match)));
    const shownFiles = c.files.map((f, fi) => [f, fi]).filter(([, fi]) => shownPrompts.some(([, i]) => (cells[i] || {})[fi]));
    const table = el("table", { class: "grid" }, gridBox);
    const h = el("tr", {}, el("thead", {}, table));
    el("th", { class: "sticky" }, h, "prompt");
    el("th", {}, h, "reference");
    const stageIndex = Object.fromEntries(RUNS[ri].stages.map((s, i) => [s.name, i]));
    for (const [f] of shownFiles) {
      const th = el("th", { title: f.file }, h);
      const i = stageIndex[f.stage] ?? 0;
      el("span", { class: "stagetag", style: `background:${BANDS[i % BANDS.length]};color:${BAND_TEXT[i % BANDS.length]}` }, th, f.stage);
      el("div", {}, th, `step ${f.step}`);
    }
    const body = el("tbody", {}, table);
    let shown = 0;
    for (const [p, i] of shownPrompts) {
      const tr = el("tr", {}, body);
      const ptd = el("td", { class: "sticky prompt" }, tr);
      el("div", { class: "evaltag" }, ptd, `${p.eval} #${p.row}`);
      el("pre", { title: p.prompt }, ptd, readable(p.prompt));
      el("td", { class: "ref" }, tr, p.reference ?? "");
      for (const [f, fi] of shownFiles) {
        const rows = (cells[i] || {})[fi];
        if (!rows) { el("td", { class: "empty" }, tr, "—"); continue; }
        const ok = rows.filter(match).length;
        shown += ok;
        const kinds = new Set(rows.map((r) => verdict(r.score)));
        const kind = kinds.size === 1 ? [...kinds][0] : "part";
        const td = el("td", { class: `out ${kind}${ok ? "" : " dim"}`, "data-completion": "",
          "data-file": f.file, "data-eval": p.eval, "data-row": p.row, "data-group": rows.length }, tr);
        for (const r of rows) {
          el("pre", { class: rows.length > 1 ? `member ${verdict(r.score)}` : null }, td, r.output);
          el("div", { class: "score" }, td, Object.entries(r.score || {}).map(([k, v]) => `${k} ${fmt(v)}`)
            .concat(r.advantage !== undefined ? [`advantage ${fmt(r.advantage)}`] : []).join(" · "));
        }
      }
    }
    countLine.textContent = `${total} completions in ${c.files.length} files; ${shown} match` +
      (c.cut_to ? `; texts over ${c.cut_to} characters are cut (the files hold them whole)` : "");
  }
  [runSelect, evalSelect, scoreSelect].forEach((s) => s && s.addEventListener("change", drawCompletions));
  drawCompletions();

  // --- recipe --------------------------------------------------------------------------------------------------
  const rc = section("recipe", "Recipe", MULTI ? "The keys whose values differ between the runs, then each run's " +
    "resolved recipe (defaults and overrides applied: the run folder's recipe.yaml)." :
    "As resolved (defaults and overrides applied): the run folder's recipe.yaml.");
  if (MULTI) {
    const keys = [...new Set(RUNS.flatMap((r) => Object.keys(r.recipe_flat)))].sort();
    const differ = keys.filter((k) => new Set(RUNS.map((r) => r.recipe_flat[k] ?? "(absent)")).size > 1);
    const table = el("table", { class: "diff" }, rc);
    const h = el("tr", {}, el("thead", {}, table));
    el("th", {}, h, "key");
    RUNS.forEach((r, i) => { const th = el("th", {}, h); swatch(RUN_COLORS[i % RUN_COLORS.length], th); th.append(r.name); });
    const body = el("tbody", {}, table);
    for (const k of differ) {
      const tr = el("tr", { "data-key": k }, body);
      el("td", { class: "key" }, tr, k);
      RUNS.forEach((r) => el("td", {}, tr, r.recipe_flat[k] ?? "(absent)"));
    }
    if (!differ.length) el("p", { class: "note" }, rc, "The recipes are the same.");
  }
  RUNS.forEach((run) => {
    const d = el("details", { open: MULTI ? null : "" }, rc);
    el("summary", {}, d, MULTI ? `${run.name}: recipe.yaml` : "recipe.yaml");
    el("pre", { class: "code" }, d, run.recipe || "(no recipe.yaml in the run folder)");
  });

  // --- model card ----------------------------------------------------------------------------------------------
  const mc = section("card", "Model card", "final/README.md, written with the final model at the end of the run.");
  RUNS.forEach((run) => {
    const d = el("details", {}, mc);
    el("summary", {}, d, MULTI ? `${run.name}: final/README.md` : "final/README.md");
    el("pre", { class: "code" }, d, run.card || "Not written yet: final/ and its model card come at the end of the run.");
  });
  RUNS.forEach((run) => {  // files of the run folder that are links: never followed, so not shown
    if ((run.not_read || []).length) {
      el("p", { class: "note", "data-not-read": run.not_read.join(" ") }, mc, `${MULTI ? run.name + ": " : ""}` +
        `not read (links, never followed out of the run folder): ${run.not_read.join(", ")}`);
    }
  });
  document.body.setAttribute("data-drawn", "true");
})();
