//! The dashboard's loss chart (put into page.html by the server): the loss by step on axes with
//! ticks and values, the learning rate as a dashed line on its own right axis, a point per step
//! whose title (and the readout under the chart, on hover) gives its step, loss, learning rate
//! and gradient norm, restarts as labelled vertical markers and a failure where the job failed.
"use strict";
const NS = "http://www.w3.org/2000/svg";
/** An SVG element with these attributes (and text). */
function el(tag, attrs, text) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
/** About `n` round tick values (1, 2 or 5 times a power of ten apart) covering lo..hi. */
function niceTicks(lo, hi, n, integer) {
  if (!(hi > lo)) { hi = lo + (integer ? 1 : Math.max(Math.abs(lo) * 0.1, 1e-6)); }
  const raw = (hi - lo) / Math.max(n, 1);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  let step = [1, 2, 5, 10].map(m => m * mag).find(s => s >= raw) || 10 * mag;
  if (integer) step = Math.max(1, Math.round(step));
  const first = Math.floor(lo / step) * step, last = Math.ceil(hi / step) * step;
  const ticks = [];
  for (let v = first; v <= last + step / 2; v += step) ticks.push(+v.toPrecision(12));
  return { lo: first, hi: last, step, ticks };
}
/** Ticks at powers of ten (and 2× and 5× them when few decades) covering lo..hi > 0. */
function logTicks(lo, hi) {
  const a = Math.floor(Math.log10(lo)), b = Math.max(Math.ceil(Math.log10(hi)), a + 1);
  const decades = b - a, every = decades > 8 ? 2 : 1;
  const ticks = [];
  for (let e = a; e <= b; e += 1) {
    for (const m of decades <= 3 ? [1, 2, 5] : [1]) {
      const v = +(m * Math.pow(10, e)).toPrecision(6);
      if (v <= Math.pow(10, b) && (m > 1 || (e - a) % every === 0)) ticks.push(v);
    }
  }
  return { lo: Math.pow(10, a), hi: Math.pow(10, b), step: 0, log: true, ticks };
}
/** The loss axis: logarithmic where the losses are positive and span two decades or more. */
function lossTicks(values) {
  if (!values.length) return niceTicks(0, 1, 5, false);
  const lo = Math.min(...values), hi = Math.max(...values);
  return lo > 0 && hi / lo >= 100 ? logTicks(lo, hi) : niceTicks(lo, hi, 6, false);
}
/** `v` with as many decimals as ticks `step` apart need. */
function fmtTick(v, step) {
  if (step === 0) return v >= 1e-3 ? String(v) : v.toExponential(0);
  if (v !== 0 && (Math.abs(v) < 1e-3 || Math.abs(v) >= 1e6)) return v.toExponential(1);
  return v.toFixed(Math.max(0, Math.min(6, -Math.floor(Math.log10(step)))));
}
function fmtValue(v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return "–";
  return Math.abs(v) < 1e-2 && v !== 0 ? v.toExponential(4) : v.toPrecision(5);
}
/** An axis group: its line, ticks with labels and title; `place(v)` gives a tick's position. */
function axis(id, cls, ticks, place, line, tick, label, title) {
  const g = el("g", { id, "class": "axis " + cls });
  g.appendChild(el("line", line));
  for (const v of ticks.ticks) {
    const p = place(v);
    g.appendChild(el("line", tick(p)));
    g.appendChild(el("text", Object.assign({ "class": "tick-label" }, label(p)), fmtTick(v, ticks.step)));
  }
  g.appendChild(title);
  return g;
}
const CHART = { w: 1200, h: 300, left: 70, right: 80, top: 22, bottom: 46 };
/** Draws `job`'s loss chart into #loss-chart. */
function renderLossChart(job) {
  const svg = document.getElementById("loss-chart");
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const c = CHART, pw = c.w - c.left - c.right, ph = c.h - c.top - c.bottom;
  const losses = job ? job.losses : [];
  if (losses.length === 0) {
    svg.appendChild(el("text", { "class": "empty", x: c.left, y: c.top + 40 }, "no steps yet"));
    return;
  }
  const lrs = job.lrs || [], norms = job.grad_norms || [];
  const steps = losses.map(l => l[0]);
  const xs = niceTicks(Math.min(steps[0], 1) - 1, Math.max(job.steps, steps[steps.length - 1]), 10, true);
  const values = losses.map(l => l[1]).filter(Number.isFinite);
  const ys = lossTicks(values);
  const x = s => c.left + (pw * (s - xs.lo)) / (xs.hi - xs.lo);
  const scaled = v => (ys.log ? Math.log10(v) : v);
  const y = l => c.top + ph - (ph * (scaled(l) - scaled(ys.lo))) / (scaled(ys.hi) - scaled(ys.lo));
  const grid = el("g", { "class": "grid" });
  for (const v of ys.ticks) grid.appendChild(el("line", { x1: c.left, x2: c.left + pw, y1: y(v), y2: y(v) }));
  svg.appendChild(grid);
  const bottom = c.top + ph;
  svg.appendChild(axis("loss-x-axis", "x-axis", xs, x,
    { x1: c.left, x2: c.left + pw, y1: bottom, y2: bottom },
    p => ({ x1: p, x2: p, y1: bottom, y2: bottom + 5 }),
    p => ({ x: p, y: bottom + 18, "text-anchor": "middle" }),
    el("text", { "class": "axis-title", x: c.left + pw / 2, y: c.h - 6, "text-anchor": "middle" }, "step")));
  svg.appendChild(axis("loss-y-axis", "y-axis", ys, y,
    { x1: c.left, x2: c.left, y1: c.top, y2: bottom },
    p => ({ x1: c.left - 5, x2: c.left, y1: p, y2: p }),
    p => ({ x: c.left - 8, y: p + 4, "text-anchor": "end" }),
    el("text", { "class": "axis-title", transform: `translate(16,${c.top + ph / 2}) rotate(-90)`, "text-anchor": "middle" }, ys.log ? "loss (log scale)" : "loss")));
  const lrValues = lrs.filter(v => v !== null && Number.isFinite(v));
  let lrY = null;
  if (lrValues.length) {
    const ls = niceTicks(0, Math.max(...lrValues), 5, false);
    lrY = v => c.top + ph - (ph * (v - ls.lo)) / (ls.hi - ls.lo);
    const right = c.left + pw;
    svg.appendChild(axis("lr-axis", "lr-axis", ls, lrY,
      { x1: right, x2: right, y1: c.top, y2: bottom },
      p => ({ x1: right, x2: right + 5, y1: p, y2: p }),
      p => ({ x: right + 8, y: p + 4, "text-anchor": "start" }),
      el("text", { "class": "axis-title", transform: `translate(${c.w - 10},${c.top + ph / 2}) rotate(90)`, "text-anchor": "middle" }, "learning rate")));
    const pts = [];
    losses.forEach((l, i) => { if (lrs[i] !== null && lrs[i] !== undefined) pts.push(x(l[0]).toFixed(1) + "," + lrY(lrs[i]).toFixed(1)); });
    svg.appendChild(el("polyline", { id: "lr-curve", points: pts.join(" ") }));
  }
  const points = losses.filter(l => Number.isFinite(l[1])).map(([s, l]) => x(s).toFixed(1) + "," + y(l).toFixed(1));
  svg.appendChild(el("polyline", { id: "loss-curve", points: points.join(" "), "data-points": String(losses.length) }));
  drawMarkers(svg, job, x, c);
  drawKey(svg, c, lrY !== null);
  const dots = el("g", { id: "loss-points" });
  const r = losses.length > 300 ? 1.5 : 2.5;
  losses.forEach(([s, l], i) => {
    if (!Number.isFinite(l)) return;
    const dot = el("circle", { "class": "point", cx: x(s).toFixed(1), cy: y(l).toFixed(1), r, "data-step": s, "data-loss": l });
    dot.appendChild(el("title", {}, describePoint(s, l, lrs[i], norms[i])));
    dots.appendChild(dot);
  });
  svg.appendChild(dots);
  hover(svg, c, losses, x, i => describePoint(losses[i][0], losses[i][1], lrs[i], norms[i]));
}
/** A step's values, as the point's title and the readout show them. */
function describePoint(step, loss, lr, norm) {
  let text = "step " + step + "  loss " + fmtValue(loss) + "  lr " + fmtValue(lr);
  if (norm !== null && norm !== undefined) text += "  grad norm " + fmtValue(norm);
  return text;
}
/** The restarts (and a failure) as vertical markers at their steps. */
function drawMarkers(svg, job, x, c) {
  const bottom = c.h - c.bottom;
  const marker = (cls, at, label, title, row) => {
    const g = el("g", { "class": cls, "data-step": at });
    g.appendChild(el("line", { x1: x(at), x2: x(at), y1: c.top, y2: bottom }));
    g.appendChild(el("text", { x: x(at) + 4, y: c.top + 10 + 13 * row }, label));
    g.appendChild(el("title", {}, title));
    svg.appendChild(g);
  };
  (job.restarts || []).forEach((r, i) => {
    const resumed = r.resumed_at_step === null ? "" : ", resumed at step " + r.resumed_at_step;
    marker("restart-marker", r.after_step, "restart " + (i + 1) + " after step " + r.after_step + resumed, r.message, i % 3);
  });
  if (job.state === "failed") marker("failure-marker", job.step, "failed after step " + job.step, "the job failed (see the failures below)", 0);
}
/** What each line is, above the plot. */
function drawKey(svg, c, withLr) {
  const g = el("g", { "class": "chart-key", transform: `translate(${c.left + 8},10)` });
  g.appendChild(el("line", { x1: 0, x2: 22, y1: 0, y2: 0, stroke: "#1565c0", "stroke-width": 2 }));
  g.appendChild(el("text", { x: 28, y: 4 }, "loss (left axis)"));
  if (withLr) {
    g.appendChild(el("line", { x1: 140, x2: 162, y1: 0, y2: 0, stroke: "#e65100", "stroke-width": 1.5, "stroke-dasharray": "5 3" }));
    g.appendChild(el("text", { x: 168, y: 4 }, "learning rate (right axis)"));
  }
  svg.appendChild(g);
}
/** On hover, the nearest step's values in #loss-readout, its point highlighted. */
function hover(svg, c, losses, x, describe) {
  const cross = el("line", { "class": "crosshair", y1: c.top, y2: c.h - c.bottom, visibility: "hidden" });
  svg.insertBefore(cross, svg.firstChild);
  const readout = document.getElementById("loss-readout");
  const dots = svg.querySelectorAll(".point");
  svg.onmousemove = e => {
    const box = svg.getBoundingClientRect();
    const px = ((e.clientX - box.left) * c.w) / box.width;
    let best = 0;
    losses.forEach((l, i) => { if (Math.abs(x(l[0]) - px) < Math.abs(x(losses[best][0]) - px)) best = i; });
    cross.setAttribute("x1", x(losses[best][0])); cross.setAttribute("x2", x(losses[best][0]));
    cross.setAttribute("visibility", "visible");
    dots.forEach(d => d.classList.toggle("hovered", +d.dataset.step === losses[best][0]));
    readout.textContent = describe(best);
  };
}
