//! The dashboard's page logic (put into page.html by the server): renders the whole state the
//! server embedded in the page, then each server-sent event (each carries the whole state; at
//! most one render per frame), into the figures, the loss chart (chart.js), the timeline
//! (timeline.js), the cluster table (lost hosts kept, marked lost with when), the serving jobs,
//! the actors and the failures.
"use strict";
function bytes(n) {
  if (!n) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return n.toFixed(1) + " " + units[i];
}
/** HH:MM:SS of a Unix time, in this browser's time zone. */
function clock(unix_s) {
  const d = new Date(unix_s * 1000);
  return [d.getHours(), d.getMinutes(), d.getSeconds()].map(v => String(v).padStart(2, "0")).join(":");
}
function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  tr.appendChild(td);
  return td;
}
function renderFigures(job) {
  const figures = document.getElementById("figures");
  figures.innerHTML = "";
  if (!job) return;
  const n = job.losses.length;
  const last = n ? job.losses[n - 1][1] : NaN;
  const t = job.step_times.length ? job.step_times[job.step_times.length - 1] : NaN;
  const lr = job.lrs && n ? job.lrs[n - 1] : null;
  const norm = job.grad_norms && n ? job.grad_norms[n - 1] : null;
  const items = [
    ["fig-model", job.model + " (" + job.params + " parameters), mesh " + job.mesh],
    ["fig-step", "step " + job.step + " / " + job.steps],
    ["fig-loss", "loss " + fmtValue(last)],
  ];
  if (lr !== null && lr !== undefined) items.push(["fig-lr", "lr " + fmtValue(lr)]);
  if (norm !== null && norm !== undefined) items.push(["fig-grad-norm", "grad norm " + fmtValue(norm)]);
  items.push(["fig-throughput", job.samples_per_s.toFixed(1) + " samples/s"]);
  items.push(["fig-step-time", t.toFixed(3) + " s/step"]);
  const restarts = (job.restarts || []).length;
  if (restarts) items.push(["fig-restarts", "restarted " + restarts + "× (marked on the chart)"]);
  for (const [id, text] of items) {
    const s = document.createElement("span");
    s.id = id;
    s.textContent = text;
    if (id === "fig-restarts") s.className = "restarts";
    figures.appendChild(s);
  }
}
function renderJob(job) {
  document.getElementById("job-name").textContent = job ? job.name : "(no job yet)";
  const state = document.getElementById("job-state");
  state.textContent = job ? job.state : "";
  state.className = job ? "state-" + job.state : "";
  renderFigures(job);
  renderLossChart(job);
}
/** The memory of a host's devices, one line each. */
function memoryCell(tr, h) {
  const td = cell(tr, "", "host-memory");
  if (h.state === "lost") { td.textContent = "-"; return; }
  if (!h.memory || h.memory.length === 0) { td.textContent = "no actors of the job yet"; return; }
  for (const m of h.memory) {
    const line = document.createElement("span");
    line.className = "memory-device";
    line.dataset.device = m.device;
    let text = m.device + ": " + bytes(m.state_bytes) + " (peak " + bytes(m.peak_state_bytes) + ", plan " + bytes(m.planned_bytes) + ")";
    if (m.pool_bytes !== null && m.pool_bytes !== undefined) text += ", GPU pool " + bytes(m.pool_bytes);
    line.textContent = text;
    td.appendChild(line);
  }
}
function renderCluster(hosts) {
  const body = document.querySelector("#cluster tbody");
  body.innerHTML = "";
  for (const h of hosts) {
    const tr = document.createElement("tr");
    const lost = h.state === "lost";
    tr.className = lost ? "host host-lost" : "host";
    tr.dataset.host = h.name;
    for (const text of [h.name, h.island, h.devices.join(", ")]) cell(tr, text);
    const state = cell(tr, lost ? "lost at " + clock(h.lost_unix_s) : "live", "host-state");
    if (lost) {
      state.title = new Date(h.lost_unix_s * 1000).toISOString();
      const why = document.createElement("span");
      why.className = "why";
      why.textContent = h.lost_reason || "";
      state.appendChild(why);
    }
    cell(tr, h.device_memory ? bytes(h.device_memory) : "not capped (host RAM)");
    memoryCell(tr, h);
    body.appendChild(tr);
  }
}
function renderFailures(failures) {
  const ul = document.getElementById("failures");
  ul.innerHTML = "";
  for (const f of failures) {
    const li = document.createElement("li");
    li.className = "failure";
    li.textContent = new Date(f.unix_s * 1000).toISOString() + "  " + f.message;
    ul.appendChild(li);
  }
}
function renderActors(actors) {
  document.getElementById("actors-section").hidden = !actors || actors.length === 0;
  const body = document.querySelector("#actors tbody");
  body.innerHTML = "";
  for (const a of actors || []) {
    const tr = document.createElement("tr");
    tr.className = "actor";
    tr.dataset.actor = a.host + "/" + a.id;
    for (const v of [a.name, a.type_name, a.host, a.device, a.calls_per_s.toFixed(1), a.handled, a.queue_depth, a.restarts, a.failures, a.state]) {
      cell(tr, v);
    }
    body.appendChild(tr);
  }
}
function renderServing(jobs) {
  document.getElementById("serving-section").hidden = !jobs || jobs.length === 0;
  const body = document.querySelector("#serving tbody");
  body.innerHTML = "";
  for (const s of jobs || []) {
    const tr = document.createElement("tr");
    tr.className = "serving serving-" + s.state;
    tr.dataset.job = s.job;
    const state = s.state === "failed" ? "failed: " + s.reason : s.state;
    const job = s.replicas > 1 ? s.job + " replica " + s.replica : s.job;
    for (const v of [job, s.host, s.url, state, s.waiting, s.running, s.blocks_used + " / " + s.blocks_total, s.generated_tokens, s.finished, s.summary]) {
      cell(tr, v);
    }
    body.appendChild(tr);
  }
}
/** Above everything: why the job failed, or that it restarted (the newest restart). */
function renderAlert(view) {
  const alert = document.getElementById("alert");
  const job = view.job, restarts = job ? job.restarts || [] : [];
  const failure = view.failures.length ? view.failures[view.failures.length - 1].message : "";
  let cls = "", text = "";
  if (job && job.state === "failed") {
    cls = "alert-failed";
    text = "failed after step " + job.step + ": " + failure;
  } else if (restarts.length) {
    const r = restarts[restarts.length - 1];
    cls = "alert-restarted";
    text = "restarted " + restarts.length + "× at " + clock(r.unix_s) + " after step " + r.after_step + ": " + r.message;
  }
  alert.hidden = !text;
  alert.className = cls;
  alert.textContent = text;
}
function render(view) {
  renderAlert(view);
  renderActors(view.actors);
  renderServing(view.serving);
  renderJob(view.job);
  renderTimeline(view.timeline);
  renderCluster(view.cluster);
  renderFailures(view.failures);
}
// The server embeds the state at the time of the request; rendered before the page's load event,
// then kept live by the server-sent events (the newest state, at most once per frame).
const INITIAL = /*INITIAL_STATE*/null;
if (INITIAL) render(INITIAL); else fetch("/api/state").then(r => r.json()).then(render);
let pending = null;
window.addEventListener("load", () => {
  const source = new EventSource("/events");
  source.onmessage = e => {
    if (pending === null) requestAnimationFrame(() => { render(JSON.parse(pending)); pending = null; });
    pending = e.data;
  };
});
