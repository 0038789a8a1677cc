// The oomcast dashboard: three views on the service's own /v1 API (docs/dashboard.md).
//   #/ (or #/fleet?node=..&job=..)  every live domain, riskiest first, virtualised
//   #/domain/<node>/<device>        one domain: memory, forecast, alerts, cause
//   #/alerts                        the alert log
//   #/scorecard                     how each scored model did on the fleet's own jobs
// Plain ES module, no build step, no library; charts are in charts.js.

import { sparkline, stackedBars, svgEl, timeChart } from "./charts.js";

const TOKEN_KEY = "oomcast.api_token";
const FLEET_POLL_MS = 1500;
const DOMAIN_POLL_MS = 2000;
const ALERTS_POLL_MS = 3000;
const SCORE_POLL_MS = 30000; // outcomes come a few an hour: no need to ask more often
const ROW_H = 36; // px; must match .rows .row height in style.css
const PAGE = 200; // domains per /v1/devices request
const OVERSCAN = 8; // rows drawn above and below the visible ones
const SPARK_POINTS = 60;
const GIB = 2 ** 30;

// --- the API, with the token ----------------------------------------------------------

class Unauthorized extends Error {}

async function api(path) {
  const headers = { Accept: "application/json" };
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  const r = await fetch(path, { headers });
  if (r.status === 401) throw new Unauthorized(token ? "refused" : "missing");
  if (!r.ok) {
    let detail = r.statusText;
    try {
      const body = await r.json();
      detail = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
    } catch { /* not JSON: keep the status text */ }
    const err = new Error(`${path.split("?")[0]} answered ${r.status}: ${detail}`);
    err.status = r.status;
    throw err;
  }
  return r.json();
}

const q = (params) => {
  const s = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== null && v !== "") s.set(k, v);
  return s.toString();
};
const domainPath = (node, device) => `${encodeURIComponent(node)}/${encodeURIComponent(device)}`;
const domainHref = (node, device) => `#/domain/${domainPath(node, device)}`;

// --- small helpers --------------------------------------------------------------------

function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") el.className = v;
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.appendChild(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

// replaceChildren, with arrays flattened and null / false left out
function put(el, ...children) {
  el.replaceChildren(...children.flat(2).filter((c) => c !== null && c !== undefined && c !== false));
}

const gib = (b) => (b / GIB).toFixed(b >= 100 * GIB ? 0 : 1);
const pct = (p) => `${Math.round(p * 100)}%`;
const clock = (ts) => new Date(ts * 1000).toLocaleTimeString([], { hour12: false });
const pad2 = (n) => String(n).padStart(2, "0");
// an unambiguous date (2026-12-04 14:15:02) whatever the browser's locale: 12/4 reads two ways
const stamp = (ts) => {
  const d = new Date(ts * 1000);
  const day = `${d.getFullYear()}-${pad2(d.getMonth() + 1)}-${pad2(d.getDate())}`;
  return `${day} ${pad2(d.getHours())}:${pad2(d.getMinutes())}:${pad2(d.getSeconds())}`;
};

function duration(s) {
  if (s === null || s === undefined) return "—";
  if (s < 90) return `${Math.round(s)} s`;
  if (s < 5400) return `${Math.round(s / 60)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

function riskAt(alert) {
  const r = alert.risk || {};
  const key = alert.horizon_s !== undefined ? String(alert.horizon_s) : Object.keys(r)[0];
  return r[key];
}

function setStatus(text, cls = "") {
  const el = document.getElementById("status");
  el.textContent = text;
  el.className = `status ${cls}`;
}

// The cause and remedies of a summary or an alert, when the service computed them: `cause`
// (a word: leak, fragmentation, phase:eval, ...), `remedies` (sentences), `evidence` (one
// sentence) and `thin` (what evidence was missing), at the top level or under `diagnosis`.
function causeBlock(obj) {
  const src = obj.diagnosis && typeof obj.diagnosis === "object" ? { ...obj, ...obj.diagnosis } : obj;
  const box = h("div", { class: "cause-body" });
  const cause = src.cause;
  if (cause === undefined || cause === null || cause === "") {
    // a summary with no OOM in sight names no cause; its evidence says so (and the shape)
    box.append(h("p", { class: "cause-none" }, typeof src.evidence === "string" && src.evidence ? src.evidence : "no cause computed"));
    return box;
  }
  const nested = typeof cause === "object" ? cause : {};
  const kind = typeof cause === "string" ? cause : nested.kind || nested.name || nested.cause || JSON.stringify(cause);
  box.append(h("p", {}, h("strong", {}, "Cause: "), h("span", { class: "cause-kind" }, kind)));
  const evidence = src.evidence ?? src.cause_evidence ?? nested.evidence ?? nested.summary;
  if (evidence) {
    box.append(h("p", { class: "evidence" }, typeof evidence === "string" ? evidence : JSON.stringify(evidence)));
  }
  const thin = src.thin ?? src.cause_thin ?? nested.thin;
  if (Array.isArray(thin) && thin.length) {
    box.append(h("p", { class: "thin" }, `The evidence is thin: ${thin.join("; ")}.`));
  }
  const remedies = src.remedies ?? nested.remedies;
  if (Array.isArray(remedies) && remedies.length) {
    box.append(h("p", {}, h("strong", {}, "What to do:")));
    box.append(h("ul", { class: "remedies" }, remedies.map((r) => {
      if (typeof r === "string") return h("li", {}, r);
      const head = r.title || r.action || r.text || r.summary || r.kind || "";
      const more = r.detail || r.command || r.env || r.why || "";
      return h("li", {}, head, more ? h("code", {}, ` ${typeof more === "string" ? more : JSON.stringify(more)}`) : null);
    })));
  } else {
    box.append(h("p", { class: "cause-none" }, "no remedy given"));
  }
  return box;
}

// --- polling --------------------------------------------------------------------------

// Calls `fn` every `ms` after the previous call ended; paused while the tab is hidden.
// A 401 stops it and asks for the token; any other error is shown and polling goes on.
function poller(fn, ms) {
  let timer = null;
  let stopped = false;
  let running = false;
  let again = false;
  async function tick() {
    if (stopped) return;
    timer = null;
    if (document.hidden) {
      timer = setTimeout(tick, ms);
      return;
    }
    running = true;
    try {
      await fn();
      setStatus(`live · updated ${clock(Date.now() / 1000)}`, "ok");
    } catch (e) {
      if (e instanceof Unauthorized) {
        stopped = true;
        askToken(e.message);
        return;
      }
      setStatus(`${e.message} — retrying`, "error");
    } finally {
      running = false;
    }
    if (stopped) return;
    if (again) {
      again = false;
      timer = setTimeout(tick, 0);
    } else {
      timer = setTimeout(tick, ms);
    }
  }
  timer = setTimeout(tick, 0);
  return {
    stop() { stopped = true; if (timer) clearTimeout(timer); },
    now() {
      if (running) { again = true; return; }
      if (timer) clearTimeout(timer);
      timer = setTimeout(tick, 0);
    },
  };
}

// --- the token ------------------------------------------------------------------------

function askToken(why) {
  const panel = document.getElementById("token-panel");
  const msg = document.getElementById("token-message");
  msg.textContent = why === "refused"
    ? "The service refused the token this tab holds (401 Unauthorized). Enter the right "
      + "one (OOMCAST_API_TOKEN)."
    : "This service has OOMCAST_API_TOKEN set, and every /v1 request needs it "
      + "(401 Unauthorized without it). Enter it once.";
  panel.hidden = false;
  setStatus("401 Unauthorized: API token needed", "error");
  document.getElementById("token-input").focus();
}

function setupToken() {
  const form = document.getElementById("token-form");
  const forget = document.getElementById("forget-token");
  forget.hidden = !sessionStorage.getItem(TOKEN_KEY);
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const input = document.getElementById("token-input");
    sessionStorage.setItem(TOKEN_KEY, input.value.trim());
    input.value = "";
    document.getElementById("token-panel").hidden = true;
    forget.hidden = false;
    route();
  });
  forget.addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    forget.hidden = true;
    route();
  });
}

// --- fleet ----------------------------------------------------------------------------

// Risk values per domain, oldest first: seeded from the domain's history the first time
// its row is drawn, then one value per new sample the polls see.
const sparks = new Map();
const seeding = { queue: [], busy: 0, done: new Set() };

function recordSpark(d) {
  const key = `${d.node}/${d.device}`;
  let s = sparks.get(key);
  if (!s) { s = { at: 0, values: [] }; sparks.set(key, s); }
  if (d.observed_at > s.at) {
    s.at = d.observed_at;
    s.values.push(d.alert_risk);
    if (s.values.length > SPARK_POINTS) s.values.splice(0, s.values.length - SPARK_POINTS);
  }
}

function seedSpark(d, visible) {
  const key = `${d.node}/${d.device}`;
  if (seeding.done.has(key)) return;
  seeding.done.add(key);
  seeding.queue.push({ d, key, visible });
  pumpSeeds();
}

function pumpSeeds() {
  while (seeding.busy < 4 && seeding.queue.length) {
    const { d, key, visible } = seeding.queue.shift();
    if (!visible(key)) { seeding.done.delete(key); continue; } // scrolled past: later
    seeding.busy += 1;
    api(`v1/devices/${domainPath(d.node, d.device)}?history=${SPARK_POINTS * 5}`)
      .then((body) => {
        const hist = body.history || [];
        const stepN = Math.max(1, Math.floor(hist.length / SPARK_POINTS));
        const values = hist.filter((_, i) => (hist.length - 1 - i) % stepN === 0).map((p) => p.alert_risk);
        const s = sparks.get(key);
        const newer = s ? s.values.slice(-1) : [];
        sparks.set(key, { at: body.observed_at, values: [...values.slice(-SPARK_POINTS), ...newer].slice(-SPARK_POINTS) });
      })
      .catch(() => { seeding.done.delete(key); })
      .finally(() => { seeding.busy -= 1; pumpSeeds(); });
  }
}

function fleetRow(d, index) {
  const key = `${d.node}/${d.device}`;
  const firing = d.alert && d.alert.firing;
  const cls = ["row", firing ? "firing" : "", !firing && d.alert_risk >= 0.5 ? "risky" : ""];
  const fill = h("span", { class: "fill" });
  fill.style.width = `${Math.min(100, d.used_frac * 100).toFixed(1)}%`;
  const rules = firing
    ? Object.entries(d.alert.rules || {}).filter(([, r]) => r.firing).map(([n]) => n).join(", ")
    : "";
  const cause = d.cause ? ` · cause: ${typeof d.cause === "string" ? d.cause : d.cause.kind || ""}` : "";
  const alert = firing
    ? h("span", { class: "alert-text" }, `FIRING ${rules}`, d.alert.fired_at ? ` since ${clock(d.alert.fired_at)}` : "", cause)
    : h("span", { class: "quiet" }, d.ooms_seen ? `ok · ${d.ooms_seen} OOM seen` : "ok");
  const s = sparks.get(key);
  const row = h("div", { class: cls.join(" "), role: "row", "data-key": key, "data-index": index },
    h("span", { class: "name", role: "cell" },
      h("a", { href: domainHref(d.node, d.device) }, key), h("small", {}, ` ${d.kind}`)),
    h("span", { role: "cell", class: "job" }, d.job || "—"),
    h("span", { role: "cell", class: "mem" },
      h("span", { class: "bar" }, fill),
      h("small", {}, `${gib(d.used_bytes)} / ${gib(d.total_bytes)} GiB · ${pct(d.used_frac)}`)),
    h("span", { role: "cell", class: "risk" }, pct(d.alert_risk)),
    h("span", { role: "cell", class: "trend" }, sparkline(s ? s.values : [d.alert_risk])),
    h("span", { role: "cell", class: "tto" }, duration(d.time_to_oom_s)),
    h("span", { role: "cell", class: "alert" }, alert));
  row.style.transform = `translateY(${index * ROW_H}px)`;
  return row;
}

function mountFleet(root, params) {
  root.replaceChildren(document.getElementById("tpl-fleet").content.cloneNode(true));
  const form = root.querySelector("#filters");
  const scroll = root.querySelector("#fleet-scroll");
  const rows = root.querySelector("#fleet-rows");
  const summary = root.querySelector("#fleet-summary");
  const filters = {
    node: params.get("node") || "", job: params.get("job") || "",
    kind: params.get("kind") || "", firing: params.get("firing") === "true",
  };
  form.node.value = filters.node;
  form.job.value = filters.job;
  form.kind.value = filters.kind;
  form.firing.checked = filters.firing;

  // cursors[k] is the cursor of page k ("" for the first, null past the end); pages[k] its rows.
  let gen = 0;
  let cursors = [""];
  let pages = new Map();
  let matched = null;
  let total = 0;
  let firingCount = 0;
  let horizon = null;
  let shown = new Set();

  const visibleRange = () => {
    const first = Math.max(0, Math.floor(scroll.scrollTop / ROW_H) - OVERSCAN);
    const last = Math.floor((scroll.scrollTop + scroll.clientHeight) / ROW_H) + OVERSCAN;
    return [first, matched === null ? last : Math.min(last, matched - 1)];
  };

  function render() {
    const [first, last] = visibleRange();
    rows.style.height = `${Math.max(1, matched || 0) * ROW_H}px`;
    const out = [];
    shown = new Set();
    for (let i = first; i <= last; i++) {
      const page = pages.get(Math.floor(i / PAGE));
      const d = page && page[i % PAGE];
      if (!d) continue;
      out.push(fleetRow(d, i));
      shown.add(`${d.node}/${d.device}`);
      seedSpark(d, (key) => shown.has(key));
    }
    rows.replaceChildren(...out);
    if (matched === 0) rows.replaceChildren(h("p", { class: "empty" }, total ? "No live domain matches these filters." : "No live domain yet: nothing has reported in the last OOMCAST_LIVE_AFTER_S seconds."));
    const what = [filters.node && `node ${filters.node}`, filters.job && `job ${filters.job}`, filters.kind, filters.firing && "firing"].filter(Boolean).join(", ");
    summary.textContent = matched === null ? "loading…"
      : `${matched} of ${total} live domains${what ? ` match ${what}` : ""} · ${firingCount} firing in the whole fleet · `
        + `risk is the chance of an OOM within ${horizon} s (the alert horizon), riskiest first`;
  }

  const url = (cursor, extra = {}) => `v1/devices?${q({
    limit: PAGE, cursor: cursor || undefined, node: filters.node || undefined,
    job: filters.job || undefined, kind: filters.kind || undefined,
    firing: filters.firing ? "true" : undefined, ...extra,
  })}`;

  async function fetchPage(k, mine) {
    const body = await api(url(cursors[k]));
    if (mine !== gen) return;
    pages.set(k, body.devices);
    cursors[k + 1] = body.next === null ? null : body.next;
    if (k === 0) { matched = body.matched; total = body.total; horizon = body.alert_horizon_s; }
    for (const d of body.devices) recordSpark(d);
  }

  async function refresh() {
    const mine = gen;
    const [first, last] = visibleRange();
    const need = new Set();
    for (let k = Math.floor(first / PAGE); k <= Math.floor(last / PAGE); k++) need.add(k);
    const count = await api(`v1/devices?${q({ limit: 1, firing: "true" })}`);
    firingCount = count.matched;
    if (need.has(0) || matched === null) {
      await fetchPage(0, mine);
      need.add(0);
    } else { // scrolled down: the counts only (the first page is not on screen)
      const head = await api(url(null, { limit: 1 }));
      if (mine !== gen) return;
      matched = head.matched; total = head.total; horizon = head.alert_horizon_s;
    }
    const wanted = [...need].filter((k) => k > 0 && matched !== null && k * PAGE < matched).sort((a, b) => a - b);
    // Pages whose cursor is not known yet are reached by walking from the last known one.
    for (const k of wanted) {
      let j = k;
      while (j > 0 && cursors[j] === undefined) j -= 1;
      for (; j < k && cursors[j + 1] === undefined; j++) await fetchPage(j, mine);
    }
    await Promise.all(wanted.filter((k) => cursors[k]).map((k) => fetchPage(k, mine)));
    if (mine !== gen) return;
    for (const k of [...pages.keys()]) if (!need.has(k)) pages.delete(k); // stale: refetched on sight
    render();
  }

  const poll = poller(refresh, FLEET_POLL_MS);
  let scrollTimer = null;
  scroll.addEventListener("scroll", () => {
    render();
    clearTimeout(scrollTimer);
    scrollTimer = setTimeout(() => poll.now(), 120);
  });
  let inputTimer = null;
  form.addEventListener("submit", (ev) => ev.preventDefault());
  form.addEventListener("input", () => {
    clearTimeout(inputTimer);
    inputTimer = setTimeout(() => {
      filters.node = form.node.value.trim();
      filters.job = form.job.value.trim();
      filters.kind = form.kind.value;
      filters.firing = form.firing.checked;
      history.replaceState(null, "", `#/fleet?${q({ ...filters, firing: filters.firing ? "true" : "" })}`);
      gen += 1;
      cursors = [""];
      pages = new Map();
      matched = null;
      scroll.scrollTop = 0;
      render();
      poll.now();
    }, 250);
  });
  render();
  return { stop: () => { poll.stop(); clearTimeout(scrollTimer); clearTimeout(inputTimer); } };
}

// --- one domain -----------------------------------------------------------------------

const ALERT_LIMIT = 1000;

function mountDomain(root, node, device) {
  root.replaceChildren(document.getElementById("tpl-domain").content.cloneNode(true));
  const title = root.querySelector("#domain-title");
  const facts = root.querySelector("#domain-facts");
  const causeBox = root.querySelector("#domain-cause");
  const procsBox = root.querySelector("#domain-procs");
  const memSvg = root.querySelector("#memory-chart");
  const riskSvg = root.querySelector("#risk-chart");
  const memLegend = root.querySelector("#memory-legend");
  const riskLegend = root.querySelector("#risk-legend");
  const alertsBox = root.querySelector("#domain-alerts");
  title.textContent = `${node}/${device}`;
  let alerts = [];
  let alloc = { points: [], has_allocator: false };
  let ticks = 0;

  async function refresh() {
    const d = await api(`v1/devices/${domainPath(node, device)}?history=600`).catch((e) => {
      if (e.status === 404) {
        put(facts, h("p", { class: "empty" }, `${node}/${device} is not a live domain (no sample in the last OOMCAST_LIVE_AFTER_S seconds, or never seen).`));
        return null;
      }
      throw e;
    });
    if (d === null) return;
    const span = d.history.length ? d.observed_at - d.history[0].ts + 5 : 600;
    if (ticks % 3 === 0) {
      const [all, mem] = await Promise.all([
        api(`v1/alerts?limit=${ALERT_LIMIT}`),
        api(`v1/dashboard/memory/${domainPath(node, device)}?${q({ seconds: Math.min(86400, Math.max(60, Math.ceil(span))) })}`),
      ]);
      alerts = all.alerts.filter((a) => a.node === node && a.device === device);
      alloc = mem;
    }
    ticks += 1;
    draw(d);
  }

  function draw(d) {
    const firing = d.alert.firing;
    title.className = firing ? "firing" : "";
    put(facts, 
      fact("Used", `${gib(d.used_bytes)} of ${gib(d.total_bytes)} GiB (${pct(d.used_frac)})`),
      fact("Risk at the alert horizon", pct(d.alert_risk), d.alert_risk >= 0.5 ? "hot" : ""),
      fact("Time to OOM", duration(d.time_to_oom_s), d.time_to_oom_s !== null ? "hot" : ""),
      fact("Alert", firing ? `FIRING since ${clock(d.alert.fired_at)}` : "not firing", firing ? "hot" : ""),
      fact("Job", d.job || "—"),
      fact("Kind", d.kind),
      fact("Model", d.model_version),
      fact("Samples seen", String(d.samples_seen)),
      fact("OOMs seen", d.ooms_seen ? `${d.ooms_seen}, last ${stamp(d.last_oom_ts)}` : "0"),
      d.phase ? fact("Next phase that will not fit", `${d.phase.phase} in ${duration(d.phase.in_s)} (${d.phase.steps_away} steps), needs ${gib(d.phase.extra_bytes)} GiB over ${gib(d.phase.headroom_bytes)} GiB of headroom`, "hot") : null,
    );
    const latestAlert = alerts.find((a) => a.status === "firing");
    causeBox.replaceChildren(h("h2", {}, "Why, and what to do"), causeBlock(latestAlert && latestAlert.cause !== undefined ? { ...d, ...latestAlert } : d));
    procsBox.replaceChildren(...processBlock(d));

    const hist = d.history;
    const t0 = hist.length ? hist[0].ts : d.observed_at - 60;
    const now = d.observed_at;
    const horizons = Object.keys(d.risk).map(Number).sort((a, b) => a - b);
    const ahead = Math.max(d.time_to_oom_s ?? 0, horizons.length ? horizons[horizons.length - 1] : 0);
    const t1 = now + Math.min(Math.max(ahead, 10), Math.max(60, (now - t0) * 0.6));
    const markers = alerts.map((a) => ({
      ts: a.observed_at,
      cls: a.status,
      label: a.status === "firing" ? `▲ ${a.rule_name || "alert"}` : `▼ ${a.status}`,
      title: `${a.status} ${a.rule_name || ""} at ${stamp(a.observed_at)}; risk ${pct(riskAt(a) ?? 0)}; actions: ${dispatchedText(a)}`,
    }));
    if (d.last_oom_ts) markers.push({ ts: d.last_oom_ts, cls: "oom", label: "OOM", title: `OOM at ${stamp(d.last_oom_ts)}` });
    const last = hist[hist.length - 1];
    const segments = last && d.time_to_oom_s !== null ? [{
      cls: "projection",
      from: [last.ts, last.used_bytes / GIB],
      to: [last.ts + d.time_to_oom_s, last.total_bytes / GIB],
      label: `OOM in ${duration(d.time_to_oom_s)} (projected)`,
    }] : [];
    const allocPts = alloc.points || [];
    const lines = [
      { cls: "capacity", step: true, points: hist.map((p) => [p.ts, p.total_bytes / GIB]) },
      { cls: "used", area: true, points: hist.map((p) => [p.ts, p.used_bytes / GIB]) },
    ];
    if (alloc.has_allocator) {
      lines.push({ cls: "reserved", points: allocPts.filter((p) => p.reserved_bytes !== null).map((p) => [p.ts, p.reserved_bytes / GIB]) });
      lines.push({ cls: "allocated", points: allocPts.filter((p) => p.allocated_bytes !== null).map((p) => [p.ts, p.allocated_bytes / GIB]) });
    }
    const yMax = Math.max(...hist.map((p) => p.total_bytes), d.total_bytes) / GIB * 1.05;
    timeChart(memSvg, { x: [t0, t1], yMax, yFormat: (v) => `${v.toFixed(v < 10 ? 1 : 0)} GiB`, lines, markers, segments });
    put(memLegend, 
      legend("used", "used"), legend("capacity", "capacity"),
      alloc.has_allocator ? [legend("allocated", "allocated (PyTorch)"), legend("reserved", "reserved (PyTorch caching allocator)")] : h("span", { class: "note" }, "allocated / reserved: not reported (no in-job hook on this domain)"),
      segments.length ? legend("projection", "projection to OOM") : null,
      legend("firing", "alert fired"), legend("resolved", "alert ended"),
    );

    // Past: the risk at the alert horizon as it was; future: the chance of an OOM by then.
    const band = [[now, 0], ...horizons.map((hz) => [now + hz, d.risk[String(hz)]])];
    timeChart(riskSvg, {
      x: [t0, t1], yMax: 1, yFormat: (v) => pct(v),
      lines: [{ cls: "risk", area: true, points: hist.map((p) => [p.ts, p.alert_risk]) }],
      bands: [{ cls: "forecast", points: band }],
      markers,
    });
    put(riskLegend, 
      legend("risk", "risk of OOM within the alert horizon, as forecast at each sample"),
      legend("forecast", `now: ${horizons.map((hz) => `${pct(d.risk[String(hz)])} within ${hz} s`).join(", ")}`),
    );
    alertsBox.replaceChildren(alerts.length ? alertTable(alerts, false) : h("p", { class: "empty" }, "No alert on this domain in the last alerts."));
  }

  const poll = poller(refresh, DOMAIN_POLL_MS);
  const onResize = () => poll.now();
  window.addEventListener("resize", onResize);
  return { stop: () => { poll.stop(); window.removeEventListener("resize", onResize); } };
}

// Who uses a shared GPU: the processes of the newest sample (NVML's per-process figures),
// largest first, each as a share of the GPU, with what the processes do not account for
// (the driver's context, other containers NVML cannot see into).
function processBlock(d) {
  if (!d.processes || !d.processes.length) return [];
  const known = d.processes.reduce((s, p) => s + (p.used_bytes ?? 0), 0);
  const rest = Math.max(0, d.used_bytes - known);
  const head = h("tr", {}, ["PID", "Job", "Used", "Share of the GPU", ""].map((t) => h("th", {}, t)));
  const row = (pid, job, bytes, cls) => h("tr", { class: cls },
    h("td", {}, pid), h("td", {}, job), h("td", {}, bytes === null ? "not reported" : `${gib(bytes)} GiB`),
    h("td", {}, bytes === null ? "—" : pct(bytes / d.total_bytes)),
    h("td", { class: "bar-cell" }, shareBar(bytes === null ? 0 : bytes / d.total_bytes)));
  const rows = d.processes.map((p) => row(String(p.pid), p.job || "—", p.used_bytes, p.job && p.job === d.job ? "own" : ""));
  if (rest > 0) rows.push(row("—", "not in any process (driver context, others)", rest, "rest"));
  return [
    h("h2", {}, `Processes on this GPU (${d.processes.length})`),
    h("table", { class: "procs-table" }, h("thead", {}, head), h("tbody", {}, rows)),
  ];
}

// a bar as wide as a share (set through the CSSOM: the page's CSP refuses style attributes)
function shareBar(share) {
  const bar = h("span", { class: "bar" });
  bar.style.width = `${Math.min(100, 100 * share).toFixed(1)}%`;
  return bar;
}

function fact(label, value, cls = "") {
  return h("div", { class: `fact ${cls}` }, h("span", { class: "label" }, label), h("span", { class: "value" }, value));
}

function legend(cls, text) {
  return h("span", { class: `key ${cls}` }, h("i", {}), text);
}

// --- alerts ---------------------------------------------------------------------------

function dispatchedText(a) {
  const d = a.dispatched || {};
  const done = Object.entries(d).filter(([, v]) => v !== "not_configured").map(([k, v]) => `${k} ${v}`);
  return done.length ? done.join(", ") : "none configured";
}

function alertTable(alerts, withDomain) {
  const head = h("tr", {}, ["When", "Status", withDomain ? "Domain" : null, "Job", "Rule", "Risk", "Time to OOM", "Cause and remedy", "Actions", "Reason"].filter(Boolean).map((t) => h("th", {}, t)));
  const rows = alerts.map((a) => h("tr", { class: `alert-row ${a.status}`, "data-episode": a.episode || "" },
    h("td", {}, stamp(a.sent_at ?? a.observed_at)),
    h("td", { class: "status-cell" }, a.status, a.suppressed ? " (suppressed)" : "", a.repeat ? " (repeat)" : ""),
    withDomain ? h("td", {}, h("a", { href: domainHref(a.node, a.device) }, `${a.node}/${a.device}`)) : null,
    h("td", {}, a.job || "—"),
    h("td", {}, a.rule_name || "", a.severity ? h("small", {}, ` ${a.severity}`) : null),
    h("td", {}, riskAt(a) === undefined ? "—" : pct(riskAt(a))),
    h("td", {}, duration(a.time_to_oom_s)),
    h("td", { class: "cause" }, causeBlock(a)),
    h("td", {}, dispatchedText(a)),
    h("td", { class: "reason" }, a.reason || "")));
  return h("table", { class: "alert-table" }, h("thead", {}, head), h("tbody", {}, rows));
}

function mountAlerts(root) {
  root.replaceChildren(document.getElementById("tpl-alerts").content.cloneNode(true));
  const box = root.querySelector("#alert-log");
  const summary = root.querySelector("#alerts-summary");
  const form = root.querySelector("#alert-filter");
  let alerts = [];
  function draw() {
    const text = form.q.value.trim().toLowerCase();
    const only = form.firing.checked;
    const shown = alerts.filter((a) => (!only || a.status === "firing")
      && (!text || [a.node, a.device, a.job, a.rule_name].some((v) => (v || "").toLowerCase().includes(text))));
    summary.textContent = `${shown.length} of the newest ${alerts.length} alerts, newest first`;
    box.replaceChildren(shown.length ? alertTable(shown, true) : h("p", { class: "empty" }, "No alert yet."));
  }
  form.addEventListener("submit", (ev) => ev.preventDefault());
  form.addEventListener("input", draw);
  const poll = poller(async () => {
    alerts = (await api("v1/alerts?limit=500")).alerts;
    draw();
  }, ALERTS_POLL_MS);
  return { stop: () => poll.stop() };
}

// --- the scorecard ----------------------------------------------------------------------

const share = (r) => (r === null || r === undefined ? "—" : pct(r));

function oomBars(m) {
  const svg = svgEl("svg", { class: "bars", role: "img", "aria-label": `OOMs by class, ${m.role}` });
  const rows = ["long", "short", "sudden"].map((cls) => {
    const c = m.by_class[cls];
    return {
      label: `${cls} (${c.n})`,
      parts: [
        { cls: "w30", n: c.warned_30s, title: "warned at least 30 s ahead" },
        { cls: "w10", n: c.warned_10s - c.warned_30s, title: "warned 10-30 s ahead" },
        { cls: "missed", n: c.n - c.warned_10s, title: "warned under 10 s ahead, or not at all" },
      ],
    };
  });
  stackedBars(svg, rows);
  return svg;
}

function alertBars(m) {
  const svg = svgEl("svg", { class: "bars", role: "img", "aria-label": `alerts by outcome, ${m.role}` });
  const hits = m.alerts - m.false_alarms - m.near_misses_alerted - m.censored;
  stackedBars(svg, [{
    label: `alerts (${m.alerts})`,
    parts: [
      { cls: "hit", n: hits, title: "an OOM followed" },
      { cls: "false", n: m.false_alarms, title: "false alarm" },
      { cls: "near", n: m.near_misses_alerted, title: "near miss (came within 10%)" },
      { cls: "censored", n: m.censored, title: "censored (the job ended)" },
    ],
  }]);
  return svg;
}

function byTable(by, what) {
  const head = h("tr", {}, [what, "OOMs", "warned ≥30 s", "recall 30 s", "false alarms", "per 1,000 job-h", "median lead"].map((t) => h("th", {}, t)));
  const rows = Object.entries(by).map(([k, f]) => h("tr", { class: "by-row" },
    h("td", {}, k), h("td", {}, f.ooms), h("td", {}, f.warned_30s), h("td", {}, share(f.recall_30s)),
    h("td", {}, f.false_alarms), h("td", {}, f.false_alarms_per_1000_job_hours ?? "—"), h("td", {}, duration(f.median_lead_s))));
  return h("table", { class: "by-table" }, h("thead", {}, head), h("tbody", {}, rows));
}

function modelCard(m, by) {
  const facts = h("div", { class: "facts" },
    fact("OOMs", m.ooms),
    fact("recall at 30 s", share(m.recall_30s), m.ooms && m.recall_30s < 0.9 ? "hot" : ""),
    fact("recall at 10 s", share(m.recall_10s)),
    fact("precision", share(m.precision)),
    fact("false alarms per 1,000 job-hours", m.false_alarms_per_1000_job_hours ?? "—"),
    fact("median lead", duration(m.median_lead_s)),
    fact("time-to-OOM error", m.median_tto_error === null ? "—" : pct(m.median_tto_error)),
    fact("job-hours watched", m.job_hours));
  return h("div", { class: `model-card ${m.role}`, "data-role": m.role },
    h("h2", {}, m.role, " ", h("small", {}, m.model_version)),
    facts,
    h("h3", {}, "OOMs by class, and how early they were warned"),
    oomBars(m),
    h("p", { class: "legend" }, legend("w30", "≥ 30 s ahead"), legend("w10", "10–30 s"), legend("missed", "later or never")),
    h("h3", {}, "What each alert came to"),
    alertBars(m),
    h("p", { class: "legend" }, legend("hit", "OOM followed"), legend("false", "false alarm"), legend("near", "near miss"), legend("censored", "censored")),
    m.by ? [h("h3", {}, `Per ${by}`), byTable(m.by, by)] : null);
}

function mountScorecard(root) {
  root.replaceChildren(document.getElementById("tpl-scorecard").content.cloneNode(true));
  const form = root.querySelector("#score-filter");
  const summary = root.querySelector("#score-summary");
  const notes = root.querySelector("#score-notes");
  const box = root.querySelector("#score-models");
  async function load() {
    const by = form.by.value;
    const card = await api(`v1/scorecard?${q({ since: form.since.value, by })}`);
    const left = card.left_out || {};
    summary.textContent = `${card.outcomes} outcomes from ${stamp(card.since)} to now, per scored model (the champion acts; a shadow is only scored)`;
    put(notes,
      card.note ? h("p", { class: "score-note" }, card.note) : null,
      left.forged ? h("p", { class: "score-note" }, `${left.forged} entries left out: their seal did not verify`) : null,
      card.truncated ? h("p", { class: "score-note" }, "read cut short at 200,000 entries: narrow the window") : null,
      card.covers_from && card.covers_from > card.since ? h("p", { class: "note" }, `outcomes are kept from ${stamp(card.covers_from)} only`) : null);
    put(box, card.models.length ? card.models.map((m) => modelCard(m, by)) : h("p", { class: "empty" }, "No outcome in this window yet."));
  }
  form.addEventListener("submit", (ev) => ev.preventDefault());
  form.addEventListener("change", () => poll.now());
  const poll = poller(load, SCORE_POLL_MS);
  return { stop: () => poll.stop() };
}

// --- routing --------------------------------------------------------------------------

let current = null;

function route() {
  if (current) current.stop();
  document.getElementById("token-panel").hidden = true;
  const root = document.getElementById("view");
  const hash = location.hash.replace(/^#\/?/, "");
  const [path, query = ""] = hash.split("?");
  const parts = path.split("/");
  let view = "fleet";
  if (parts[0] === "domain" && parts.length >= 3) {
    view = "domain";
    current = mountDomain(root, decodeURIComponent(parts[1]), decodeURIComponent(parts.slice(2).join("/")));
  } else if (parts[0] === "alerts") {
    view = "alerts";
    current = mountAlerts(root);
  } else if (parts[0] === "scorecard") {
    view = "scorecard";
    current = mountScorecard(root);
  } else {
    current = mountFleet(root, new URLSearchParams(query));
  }
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.view === view);
  document.body.dataset.view = view;
}

setupToken();
window.addEventListener("hashchange", route);
route();
