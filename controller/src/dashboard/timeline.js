//! The dashboard's timeline (put into page.html by the server): one lane per actor named
//! host/device (with its pipeline stage and replica), each instruction a bar coloured by its
//! category, a dotted line where each step began, a time axis in milliseconds, and a legend of
//! the colours shown.
"use strict";
/** What each category of the timeline is (the order of the legend). */
const CATEGORIES = [
  ["load", "load batch"],
  ["forward", "forward (F1: micro-batch 1)"],
  ["loss", "loss"],
  ["backward", "backward (B)"],
  ["backward-weight", "backward, weight gradients (W)"],
  ["send", "send activations/gradients"],
  ["recv", "receive activations/gradients"],
  ["all-reduce", "all-reduce (gradients)"],
  ["hierarchical-all-reduce", "hierarchical all-reduce"],
  ["reduce-scatter", "reduce-scatter (ZeRO)"],
  ["all-gather", "all-gather (ZeRO)"],
  ["collective-wait", "waiting for a collective"],
  ["params", "load/shard/drop parameters"],
  ["optimizer", "optimizer (and gradient norm)"],
  ["user", "user op"],
];
const TIMELINE = { w: 1200, left: 210, right: 14, top: 18, laneH: 24, axisH: 40 };
/** The legend of the categories `tl` shows, and what a gap is. */
function renderLegend(tl) {
  const legend = document.getElementById("timeline-legend");
  legend.innerHTML = "";
  const seen = new Set(tl.lanes.flatMap(l => l.spans.map(s => s.cat)));
  const known = new Set(CATEGORIES.map(c => c[0]));
  const shown = CATEGORIES.filter(([cat]) => seen.has(cat))
    .concat([...seen].filter(c => !known.has(c)).map(c => [c, c]));
  const item = (cls, cat, text) => {
    const span = document.createElement("span");
    span.className = "legend-item";
    if (cat) span.dataset.cat = cat;
    const swatch = document.createElement("span");
    swatch.className = "swatch " + cls;
    const label = document.createElement("span");
    label.className = "legend-label";
    label.textContent = text;
    span.append(swatch, label);
    legend.appendChild(span);
  };
  for (const [cat, text] of shown) item("cat-" + cat, cat, text);
  item("gap", null, "gap: idle, waiting on a peer (in a pipeline, the bubble)");
}
/** A lane's name: host/device (the device alone where the host is not known). */
function laneName(lane) {
  return lane.host ? lane.host + "/" + lane.device : lane.device;
}
/** Draws `tl` into #timeline. */
function renderTimeline(tl) {
  renderLegend(tl);
  const svg = document.getElementById("timeline");
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const t = TIMELINE, width = t.w - t.left - t.right;
  const lanesH = Math.max(1, tl.lanes.length) * t.laneH;
  const h = t.top + lanesH + t.axisH;
  svg.setAttribute("height", String(h));
  svg.setAttribute("viewBox", `0 0 ${t.w} ${h}`);
  if (tl.lanes.length === 0 || !(tl.span_s > 0)) {
    svg.appendChild(el("text", { "class": "empty", x: t.left, y: t.top + 16 }, "no steps yet"));
    return;
  }
  const ms = niceTicks(0, tl.span_s * 1000, 10, false);
  const scale = width / ms.hi;
  const x = s => t.left + s * 1000 * scale;
  tl.lanes.forEach((lane, i) => svg.appendChild(drawLane(lane, i, x, scale)));
  drawStepMarks(svg, tl, x, t.top + lanesH);
  const bottom = t.top + lanesH + 2;
  svg.appendChild(axis("timeline-axis", "time-axis", ms, v => t.left + v * scale,
    { x1: t.left, x2: t.left + width, y1: bottom, y2: bottom },
    p => ({ x1: p, x2: p, y1: bottom, y2: bottom + 5 }),
    p => ({ x: p, y: bottom + 17, "text-anchor": "middle" }),
    el("text", { "class": "axis-title", x: t.left + width / 2, y: bottom + 34, "text-anchor": "middle" },
      "time since the first step shown began (ms)")));
}
/** One actor's lane: its name, its stage and replica, its spans. */
function drawLane(lane, i, x, scale) {
  const t = TIMELINE;
  const g = el("g", { "class": "lane", "data-actor": lane.actor, "data-host": lane.host, transform: `translate(0,${t.top + i * t.laneH})` });
  g.appendChild(el("rect", { "class": "lane-bg", x: t.left, y: 1, width: t.w - t.left - t.right, height: t.laneH - 2 }));
  g.appendChild(el("text", { "class": "lane-label", x: 4, y: 16 }, laneName(lane)));
  g.appendChild(el("text", { "class": "lane-sub", x: t.left - 6, y: 16, "text-anchor": "end" },
    "s" + lane.stage + " r" + lane.replica));
  for (const s of lane.spans) {
    const r = el("rect", {
      "class": "span cat-" + s.cat, x: x(s.start_s).toFixed(2), y: 3,
      width: Math.max(0.5, s.dur_s * 1000 * scale).toFixed(2), height: t.laneH - 6,
    });
    r.appendChild(el("title", {}, laneName(lane) + "  step " + s.step + "  " + s.name + " (" + s.cat + ")  " +
      (1000 * s.start_s).toFixed(2) + " ms + " + (1000 * s.dur_s).toFixed(2) + " ms"));
    g.appendChild(r);
  }
  return g;
}
/** A dotted line where each step shown began, labelled with the step. */
function drawStepMarks(svg, tl, x, bottom) {
  for (const step of tl.steps) {
    const starts = tl.lanes.flatMap(l => l.spans.filter(s => s.step === step).map(s => s.start_s));
    if (!starts.length) continue;
    const at = x(Math.min(...starts));
    const g = el("g", { "class": "step-mark" });
    g.appendChild(el("line", { x1: at, x2: at, y1: TIMELINE.top - 4, y2: bottom }));
    g.appendChild(el("text", { x: at + 3, y: TIMELINE.top - 6 }, "step " + step));
    svg.appendChild(g);
  }
}
