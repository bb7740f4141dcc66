// The dashboard's page: polls the head's JSON API every second and redraws (no reload, no
// external assets). Text goes in with textContent, never as HTML.
"use strict";
const PAGE = 100;
let tab = "cluster", offset = 0;

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c ?? ""));
  return e;
}
function table(node, head, rows) {
  node.replaceChildren(el("tr", {}, ...head.map(h => el("th", {}, h))),
                       ...rows.map(r => el("tr", {}, ...r.map(c => c instanceof Node ? el("td", {}, c) : el("td", {}, String(c))))));
}
function stateCell(s) { return el("span", {class: s}, s); }
function num(x, d = 3) { return x === null || x === undefined ? "" : Number(x).toFixed(d); }
async function json(path) {
  const r = await fetch(path, {cache: "no-store"});
  if (!r.ok) throw new Error(`${path}: ${r.status}`);
  return r.json();
}

async function drawCluster() {
  const c = await json("/api/cluster");
  document.getElementById("cluster-summary").replaceChildren(
    el("p", {id: "node-count"}, `${c.alive} node(s) alive, ${c.dead} dead; ${c.actors} actor(s); ${c.groups} training group(s)`));
  table(document.getElementById("nodes"), ["node", "address", "head", "state", "resources (used / total)", "why dead"],
        c.nodes.map(n => [n.id, n.address, n.is_head ? "yes" : "", stateCell(n.state),
          Object.keys(n.resources).sort().map(k => k === "memory"
            ? `memory ${((n.used[k] || 0) / 2 ** 30).toFixed(1)}/${(n.resources[k] / 2 ** 30).toFixed(1)} GiB`
            : `${k} ${+(n.used[k] || 0).toFixed(2)}/${+n.resources[k].toFixed(2)}`).join(", "),
          n.death_reason]));
  document.getElementById("error").textContent = c.error || "";
}

async function drawActors() {
  const q = encodeURIComponent(document.getElementById("q").value);
  const s = document.getElementById("state").value;
  const p = await json(`/api/actors?offset=${offset}&limit=${PAGE}&state=${s}&q=${q}`);
  document.getElementById("page").textContent = `${p.total ? p.offset + 1 : 0}-${p.offset + p.actors.length} of ${p.total}`;
  table(document.getElementById("actor-table"), ["actor", "type", "name", "state", "restarts", "node", "pid", "death / pending reason"],
        p.actors.map(a => {
          const link = el("a", {href: `?tab=actors&logs=${a.id}`, class: "actor-link"}, a.id);
          link.addEventListener("click", ev => { ev.preventDefault(); logsOf = a.id; drawLogs(); });
          return [link, a.type, a.name, stateCell(a.state), a.restarts, a.node_id, a.pid || "", a.death_reason];
        }));
  if (logsOf) drawLogs();
}

let logsOf = new URLSearchParams(location.search).get("logs");
async function drawLogs() {
  const box = document.getElementById("logs");
  const r = await fetch(`/api/logs?actor=${encodeURIComponent(logsOf)}`, {cache: "no-store"});
  const body = await r.json();
  box.replaceChildren(el("h4", {}, `Output of actor ${logsOf}`),
    body.error ? el("p", {class: "error"}, body.error)
               : el("pre", {id: "log-tail"}, body.stdout + (body.stderr ? "\n--- stderr ---\n" + body.stderr : "")));
}

async function drawPgs() {
  const p = await json("/api/placement_groups");
  table(document.getElementById("pg-table"), ["group", "name", "strategy", "state", "bundles", "nodes", "pending reason"],
        p.placement_groups.map(g => [g.id, g.name, g.strategy, stateCell(g.state),
          g.bundles.map(b => Object.entries(b).map(([k, v]) => `${k} ${v}`).join(" ")).join(" | "),
          g.bundle_nodes.join(" "), g.pending_reason]));
}

function lossCurve(points) {
  const W = 420, H = 120, svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("width", W); svg.setAttribute("height", H); svg.setAttribute("class", "loss-curve");
  const pts = points.filter(p => p[1] !== null);
  if (pts.length > 1) {
    const xs = pts.map(p => p[0]), ys = pts.map(p => p[1]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
    const sx = x => 30 + (W - 40) * (x - x0) / ((x1 - x0) || 1), sy = y => H - 15 - (H - 25) * (y - y0) / ((y1 - y0) || 1);
    const path = document.createElementNS(svg.namespaceURI, "polyline");
    path.setAttribute("points", pts.map(p => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" "));
    path.setAttribute("fill", "none"); path.setAttribute("stroke", "#4aa3ff"); path.setAttribute("stroke-width", "2");
    svg.append(path);
    for (const [y, v] of [[sy(y1), y1], [sy(y0), y0]]) {
      const t = document.createElementNS(svg.namespaceURI, "text");
      t.setAttribute("x", 0); t.setAttribute("y", y + 4); t.setAttribute("font-size", "10"); t.textContent = v.toFixed(2);
      svg.append(t);
    }
  }
  return svg;
}

function splitBars(rank) {
  const colors = {compute_s: "#4aa3ff", comm_s: "#f0a030", wait_s: "#b070d0", snapshot_s: "#60b060"};
  const span = el("span", {});
  const total = Object.keys(colors).reduce((s, k) => s + (rank[k] || 0), 0) || 1;
  for (const [k, c] of Object.entries(colors)) {
    const b = el("span", {class: "bar", title: `${k} ${num(rank[k])} s`});
    b.style.width = `${Math.round(200 * (rank[k] || 0) / total)}px`; b.style.background = c;
    span.append(b);
  }
  return span;
}

async function drawTraining() {
  const {groups} = await json("/api/groups");
  const root = document.getElementById("groups");
  if (!groups.length) { root.replaceChildren(el("p", {class: "muted"}, "No training group.")); return; }
  root.replaceChildren(...groups.map(g => {
    const card = el("div", {class: "card group", "data-group": g.name});
    card.append(el("h3", {}, `${g.name} `, el("span", {class: g.state}, g.state)),
      el("p", {class: "group-step"}, `step ${g.step} · world size ${g.world_size} (${g.min_workers}..${g.max_workers}) · ` +
         `loss ${num(g.loss, 4)} · ${num(g.samples_per_s, 1)} samples/s · epoch ${g.epoch} · ${g.recovery_count} recoveries`),
      el("p", {class: "muted"}, "members per node: " + Object.entries(g.members_per_node).map(([n, c]) => `${n}: ${c}`).join(", ")),
      lossCurve(g.curve));
    const slow = new Set(g.stragglers.map(s => s.rank));
    const ranks = el("table", {});
    table(ranks, ["rank", "compute s", "communication s", "data wait s", "snapshot s", "split", ""],
          g.ranks.map(r => [r.rank, num(r.compute_s), num(r.comm_s), num(r.wait_s), num(r.snapshot_s), splitBars(r),
                            slow.has(r.rank) ? el("span", {class: "DEAD straggler"}, "straggler") : ""]));
    if (g.stragglers.length) {
      card.append(el("p", {class: "DEAD stragglers"}, "Stragglers: " + g.stragglers.map(s =>
        `rank ${s.rank} (Trainer ${s.trainer}) ${num(s.compute_s)} s per step, ${num(s.ratio, 1)}x the others' median`).join("; ")));
    }
    const rec = el("table", {class: "recoveries"});
    table(rec, ["recovered at step", "took s"], g.recoveries.map(r => [r.step, num(r.recovery_s, 2)]));
    const tuner = el("table", {});
    table(tuner, ["action", "world size", "target", "predicted samples/s", "at current size", "why"],
          g.tuner_decisions.map(d => [d.action, d.world_size, d.target, num(d.predicted_samples_per_s, 1),
                                      num(d.predicted_current_samples_per_s, 1), d.reason]));
    const events = el("table", {class: "events"});
    table(events, ["time", "event"], g.events.slice().reverse().map(e => [new Date(e.time_ms).toLocaleTimeString(), e.text]));
    card.append(el("h4", {}, "Step time per rank"), ranks, el("h4", {}, "Recoveries"), rec,
                el("h4", {}, "Tuner decisions"), tuner, el("h4", {}, "Events"), events);
    return card;
  }));
}

async function refresh() {
  try {
    await ({cluster: drawCluster, actors: drawActors, pgs: drawPgs, training: drawTraining})[tab]();
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    document.getElementById("error").textContent = String(e);
  }
}

for (const a of document.querySelectorAll("nav a")) {
  a.addEventListener("click", () => {
    tab = a.dataset.tab;
    for (const b of document.querySelectorAll("nav a")) b.classList.toggle("on", b === a);
    for (const s of document.querySelectorAll("section")) s.classList.toggle("on", s.id === tab);
    refresh();
  });
}
document.getElementById("prev").addEventListener("click", () => { offset = Math.max(0, offset - PAGE); refresh(); });
document.getElementById("next").addEventListener("click", () => { offset += PAGE; refresh(); });
document.getElementById("q").addEventListener("input", () => { offset = 0; refresh(); });
document.getElementById("state").addEventListener("change", () => { offset = 0; refresh(); });
const initial = new URLSearchParams(location.search).get("tab");
if (initial) document.querySelector(`nav a[data-tab="${initial}"]`)?.click();
refresh();
setInterval(refresh, 1000);
