"""The labelling page: one self-contained HTML file (no build step, no external assets), served
by `review.build_app` at `/`. It talks to the app's JSON API only."""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Label rollouts - lightning-middleware</title>
<style>
  body { font: 14px/1.45 system-ui, sans-serif; margin: 0; color: #1d2330; background: #f6f7f9; }
  header { display: flex; gap: 1em; align-items: center; padding: .6em 1em; background: #1d2330; color: #fff; }
  header button { background: #394156; color: #fff; border: 0; padding: .35em .8em; border-radius: 4px; }
  header button.on { background: #4f7cff; }
  #stats { margin-left: auto; opacity: .8; }
  main { padding: 1em; }
  .panes { display: grid; grid-template-columns: 1fr; gap: 1em; }
  .panes.two { grid-template-columns: 1fr 1fr; }
  .pane { background: #fff; border: 1px solid #dde1e8; border-radius: 6px; padding: .8em 1em; }
  .meta { color: #5a6477; font-size: 12px; }
  .msg { border-left: 3px solid #ccd2dd; padding: .2em .6em; margin: .4em 0; white-space: pre-wrap; }
  .msg.assistant { border-color: #4f7cff; } .msg.tool { border-color: #e0a030; } .msg.user { border-color: #3aa76d; }
  .role { font-weight: 600; font-size: 12px; text-transform: uppercase; color: #5a6477; }
  .final { background: #eef3ff; padding: .5em; border-radius: 4px; white-space: pre-wrap; }
  table.components td { padding: 0 .8em 0 0; }
  .actions { margin-top: 1em; display: flex; flex-wrap: wrap; gap: .4em; align-items: center; }
  .actions button { min-width: 2.6em; padding: .4em .6em; border: 1px solid #b9c1d0; background: #fff;
                    border-radius: 4px; }
  .actions button.chosen { background: #4f7cff; color: #fff; border-color: #4f7cff; }
  input[type=text] { padding: .35em; border: 1px solid #b9c1d0; border-radius: 4px; }
  #status { margin-left: 1em; color: #3aa76d; } #status.error { color: #c0392b; }
  #empty { color: #5a6477; }
  [hidden] { display: none !important; }
</style>
</head>
<body>
<header>
  <strong>Label rollouts</strong>
  <button id="mode-score" class="on">Score one</button>
  <button id="mode-compare">Compare two</button>
  <label>labeler <input id="labeler" type="text" size="12"></label>
  <span id="stats"></span>
</header>
<main>
  <div id="panes" class="panes"></div>
  <p id="empty" hidden>Nothing left to label.</p>
  <div class="actions" id="score-actions">
    <span>score 0-10:</span>
    <span id="score-buttons"></span>
    <input id="note" type="text" size="40" placeholder="note (optional)">
    <button id="save">Save</button>
    <button id="skip">Skip</button>
    <span id="status"></span>
  </div>
  <div class="actions" id="compare-actions" hidden>
    <button id="prefer-a">A is better</button>
    <button id="tie">Tie</button>
    <button id="prefer-b">B is better</button>
    <button id="skip-pair">Skip</button>
  </div>
</main>
<script>
"use strict";
const token = new URLSearchParams(location.hash.slice(1)).get("token");
const base = location.pathname.replace(/[/]+$/, "");  // "" standalone, "/review" on the gateway
const state = { mode: "score", shown: [], score: null, skipped: [], labelId: null, saving: false };
const $ = (id) => document.getElementById(id);
// crypto.randomUUID needs a secure context; a gateway is often plain http on another host
const newId = () => Array.from(crypto.getRandomValues(new Uint8Array(16)),
                               (b) => b.toString(16).padStart(2, "0")).join("");

async function api(path, body) {
  const headers = { "content-type": "application/json" };
  if (token) headers.authorization = "Bearer " + token;
  const resp = await fetch(base + path, body === undefined ? { headers } :
                           { method: "POST", headers, body: JSON.stringify(body) });
  const data = await resp.json();
  if (!resp.ok) throw new Error((data.error && data.error.message) || resp.statusText);
  return data;
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function pane(r, label) {
  const p = el("section", "pane");
  p.dataset.rolloutId = r.id;
  p.appendChild(el("h3", "", (label ? label + ": " : "") + "task " + r.task_id));
  p.appendChild(el("div", "meta", "rollout " + r.id + " - " + r.status + " - final reward " +
                   (r.final_reward === null ? "none" : r.final_reward)));
  if (r.input !== null) p.appendChild(el("pre", "meta", JSON.stringify(r.input, null, 1)));
  const transcript = el("div", "transcript");
  for (const m of r.messages) {
    const box = el("div", "msg " + m.role);
    box.appendChild(el("div", "role", m.role));
    const calls = m.tool_calls.map((c) => "-> " + c);
    box.appendChild(el("div", "", [m.content, ...calls].filter((x) => x).join("\\n")));
    transcript.appendChild(box);
  }
  p.appendChild(transcript);
  p.appendChild(el("div", "role", "final output"));
  p.appendChild(el("div", "final final-output", r.final_output || "(none)"));
  const names = Object.keys(r.components);
  if (names.length) {
    const t = el("table", "components");
    for (const n of names) {
      const row = el("tr");
      row.appendChild(el("td", "", n));
      row.appendChild(el("td", "", String(r.components[n])));
      t.appendChild(row);
    }
    p.appendChild(t);
  }
  if (r.labels.length) p.appendChild(el("div", "meta", "labels so far: " + r.labels.map((x) => x.value).join(", ")));
  return p;
}

function status(text, error) {
  $("status").textContent = text;
  $("status").className = error ? "error" : "";
}

async function refreshStats() {
  const s = await api("/api/stats");
  $("stats").textContent = s.labelled + " of " + s.rollouts + " labelled" +
    (s.interval ? " - queue " + s.queued_left + " left" : "") +
    (s.agreement && s.agreement.rank_correlation !== null
      ? " - model vs human rank correlation " + s.agreement.rank_correlation.toFixed(2) : "");
}

async function load() {
  const panes = $("panes");
  panes.replaceChildren();
  state.score = null;
  document.querySelectorAll("#score-buttons button").forEach((b) => b.classList.remove("chosen"));
  const skip = "?skip=" + encodeURIComponent(state.skipped.join(","));
  let shown = [];
  if (state.mode === "score") {
    const data = await api("/api/next" + skip);
    if (data.rollout) shown = [data.rollout];
  } else {
    const data = await api("/api/pair" + skip);
    if (data.pair) shown = data.pair;
  }
  state.shown = shown;
  state.labelId = newId();  // one per item shown: a double click or a retry stores one label
  panes.className = shown.length === 2 ? "panes two" : "panes";
  shown.forEach((r, i) => panes.appendChild(pane(r, shown.length === 2 ? "AB"[i] : "")));
  $("empty").hidden = shown.length > 0;
  $("score-actions").hidden = state.mode !== "score";
  $("compare-actions").hidden = state.mode !== "compare";
  await refreshStats();
}

async function save(body, path) {
  if (state.saving) return;  // a second click while the first is on its way
  state.saving = true;
  document.querySelectorAll("button").forEach((b) => { b.disabled = true; });
  try {
    const out = await api(path, { ...body, label_id: state.labelId });
    status(out.replayed ? "already saved" : "saved (" + out.stored + ")");
    await load();
  } catch (err) {
    status(err.message, true);
  } finally {
    state.saving = false;
    document.querySelectorAll("button").forEach((b) => { b.disabled = false; });
  }
}

function setMode(mode) {
  state.mode = mode;
  $("mode-score").classList.toggle("on", mode === "score");
  $("mode-compare").classList.toggle("on", mode === "compare");
  load().catch((err) => status(err.message, true));
}

for (let i = 0; i <= 10; i++) {
  const b = el("button", "score-btn", String(i));
  b.dataset.value = String(i);
  b.addEventListener("click", () => {
    state.score = i / 10;
    document.querySelectorAll("#score-buttons button").forEach((x) => x.classList.toggle("chosen", x === b));
  });
  $("score-buttons").appendChild(b);
}
$("save").addEventListener("click", () => {
  if (!state.shown.length) return;
  if (state.score === null) { status("choose a score first", true); return; }
  save({ score: state.score, labeler: $("labeler").value, note: $("note").value },
       "/api/rollouts/" + encodeURIComponent(state.shown[0].id) + "/score").then(() => { $("note").value = ""; });
});
$("skip").addEventListener("click", () => {
  if (state.shown.length) state.skipped.push(state.shown[0].id);
  load();
});
const compare = (winner) => () => {
  if (state.shown.length !== 2) return;
  save({ a: state.shown[0].id, b: state.shown[1].id, winner, labeler: $("labeler").value }, "/api/compare");
};
$("prefer-a").addEventListener("click", compare("a"));
$("prefer-b").addEventListener("click", compare("b"));
$("tie").addEventListener("click", compare("tie"));
$("skip-pair").addEventListener("click", () => { state.shown.forEach((r) => state.skipped.push(r.id)); load(); });
$("mode-score").addEventListener("click", () => setMode("score"));
$("mode-compare").addEventListener("click", () => setMode("compare"));
$("labeler").value = localStorage.getItem("labeler") || "";
$("labeler").addEventListener("change", () => localStorage.setItem("labeler", $("labeler").value));
load().catch((err) => status(err.message, true));
</script>
</body>
</html>
"""
