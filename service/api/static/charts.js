// SVG charts drawn by hand: a sparkline for the fleet table and a time chart for a
// domain's page. No library; every element is created with the DOM API (the page's
// Content-Security-Policy allows no inline style or script).

const NS = "http://www.w3.org/2000/svg";

export function svgEl(name, attrs = {}, parent = null) {
  const el = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  if (parent) parent.appendChild(el);
  return el;
}

function linePath(points, x, y) {
  let d = "";
  for (const [px, py] of points) {
    if (py === null || py === undefined || Number.isNaN(py)) continue;
    d += `${d ? "L" : "M"}${x(px).toFixed(1)},${y(py).toFixed(1)}`;
  }
  return d;
}

// A small SVG line of values in [0, 1] (risk), newest on the right.
export function sparkline(values, { width = 110, height = 22 } = {}) {
  const svg = svgEl("svg", {
    class: "spark", width, height, viewBox: `0 0 ${width} ${height}`, "aria-hidden": "true",
  });
  svgEl("line", { class: "base", x1: 0, x2: width, y1: height - 1, y2: height - 1 }, svg);
  if (values.length === 0) return svg;
  const n = values.length;
  const x = (i) => (n === 1 ? width - 2 : (i / (n - 1)) * (width - 2) + 1);
  const y = (v) => height - 1 - Math.max(0, Math.min(1, v)) * (height - 2);
  const pts = values.map((v, i) => [i, v]);
  const d = linePath(pts, x, y);
  svgEl("path", { class: "area", d: `${d}L${x(n - 1)},${height - 1}L${x(0)},${height - 1}Z` }, svg);
  svgEl("path", { class: "line", d }, svg);
  svgEl("circle", { class: "dot", cx: x(n - 1), cy: y(values[n - 1]), r: 2 }, svg);
  return svg;
}

function niceStep(span, target) {
  const raw = span / Math.max(1, target);
  const mag = 10 ** Math.floor(Math.log10(raw));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * mag >= raw) return m * mag;
  return 10 * mag;
}

function clock(ts) {
  return new Date(ts * 1000).toLocaleTimeString([], { hour12: false });
}

// A time chart into `svg` (cleared first).
//   x: [t0, t1] unix seconds; y: [0, yMax]; yFormat: tick label for a y value
//   lines: [{cls, points: [[ts, v], ...], area: bool, step: bool}]
//   markers: [{ts, cls, label, title}] vertical lines on the time axis
//   segments: [{cls, from: [ts, v], to: [ts, v], label}] (the projection)
//   bands: [{cls, points: [[ts, v], ...]}] filled from 0 up to the points
// Returns the number of data elements drawn (the caller and the tests read the DOM).
export function timeChart(svg, spec) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const width = Math.max(320, svg.clientWidth || 900);
  const height = Math.max(120, svg.clientHeight || 260);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const m = { l: 58, r: 16, t: 18, b: 24 };
  const [t0, t1] = spec.x;
  const span = Math.max(1e-6, t1 - t0);
  const yMax = spec.yMax > 0 ? spec.yMax : 1;
  const x = (t) => m.l + ((t - t0) / span) * (width - m.l - m.r);
  const y = (v) => height - m.b - (v / yMax) * (height - m.t - m.b);
  const axes = svgEl("g", { class: "axes" }, svg);
  const yStep = niceStep(yMax, 4);
  for (let v = 0; v <= yMax + 1e-9; v += yStep) {
    svgEl("line", { class: "grid", x1: m.l, x2: width - m.r, y1: y(v), y2: y(v) }, axes);
    const label = svgEl("text", { class: "tick", x: m.l - 6, y: y(v) + 4, "text-anchor": "end" }, axes);
    label.textContent = spec.yFormat ? spec.yFormat(v) : String(v);
  }
  const tStep = niceStep(span, 6);
  for (let t = Math.ceil(t0 / tStep) * tStep; t <= t1; t += tStep) {
    svgEl("line", { class: "grid v", x1: x(t), x2: x(t), y1: m.t, y2: height - m.b }, axes);
    const label = svgEl("text", { class: "tick", x: x(t), y: height - 6, "text-anchor": "middle" }, axes);
    label.textContent = clock(t);
  }
  // Data is clipped to the plot area (a forecast may reach past the end of the axis).
  const clipId = `clip-${svg.id || "chart"}`;
  const clip = svgEl("clipPath", { id: clipId }, svgEl("defs", {}, svg));
  svgEl("rect", { x: m.l, y: 0, width: width - m.l - m.r, height: height - m.b }, clip);
  const plot = svgEl("g", { class: "plot", "clip-path": `url(#${clipId})` }, svg);
  let drawn = 0;
  for (const band of spec.bands || []) {
    if (band.points.length < 2) continue;
    const d = linePath(band.points, x, y);
    const last = band.points[band.points.length - 1][0];
    const first = band.points[0][0];
    svgEl("path", { class: `band ${band.cls}`, d: `${d}L${x(last)},${y(0)}L${x(first)},${y(0)}Z` }, plot);
    drawn += 1;
  }
  for (const line of spec.lines || []) {
    let pts = line.points;
    if (pts.length === 0) continue;
    if (line.step) {
      const stepped = [];
      pts.forEach((p, i) => {
        if (i > 0) stepped.push([p[0], pts[i - 1][1]]);
        stepped.push(p);
      });
      pts = stepped;
    }
    const d = linePath(pts, x, y);
    if (!d) continue;
    if (line.area) {
      const a = `${d}L${x(pts[pts.length - 1][0])},${y(0)}L${x(pts[0][0])},${y(0)}Z`;
      svgEl("path", { class: `area ${line.cls}`, d: a }, plot);
    }
    svgEl("path", { class: `line ${line.cls}`, d }, plot);
    drawn += 1;
  }
  for (const s of spec.segments || []) {
    svgEl("line", {
      class: `segment ${s.cls}`, x1: x(s.from[0]), y1: y(s.from[1]), x2: x(s.to[0]), y2: y(s.to[1]),
    }, plot);
    svgEl("circle", { class: `segment-end ${s.cls}`, cx: x(s.to[0]), cy: y(s.to[1]), r: 4 }, plot);
    if (s.label) {
      const anchor = x(s.to[0]) > width - 120 ? "end" : "start";
      const t = svgEl("text", { class: `label ${s.cls}`, x: x(s.to[0]), y: y(s.to[1]) - 8, "text-anchor": anchor }, plot);
      t.textContent = s.label;
    }
    drawn += 1;
  }
  for (const mk of spec.markers || []) {
    if (mk.ts < t0 || mk.ts > t1) continue;
    const g = svgEl("g", { class: `marker ${mk.cls}` }, plot);
    svgEl("line", { x1: x(mk.ts), x2: x(mk.ts), y1: m.t, y2: height - m.b }, g);
    if (mk.label) {
      const t = svgEl("text", { x: x(mk.ts) + 3, y: m.t - 5 }, g);
      t.textContent = mk.label;
    }
    if (mk.title) svgEl("title", {}, g).textContent = mk.title;
    drawn += 1;
  }
  return drawn;
}

// Horizontal stacked bars, one per row: rows = [{label, parts: [{cls, n, title}]}]; each
// bar's width is its parts' sum against the largest sum, each part labelled with its count.
// Returns the number of parts drawn.
export function stackedBars(svg, rows, { width = 560, rowH = 26, labelW = 120 } = {}) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const height = rows.length * rowH + 6;
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("height", String(height));
  const most = Math.max(1, ...rows.map((r) => r.parts.reduce((a, p) => a + p.n, 0)));
  const span = width - labelW - 40;
  let drawn = 0;
  rows.forEach((r, i) => {
    const y = i * rowH + 4;
    svgEl("text", { class: "tick", x: 0, y: y + rowH / 2 + 2 }, svg).textContent = r.label;
    let x = labelW;
    let total = 0;
    for (const p of r.parts) {
      total += p.n;
      if (p.n <= 0) continue;
      const w = (p.n / most) * span;
      const g = svgEl("g", { class: `part ${p.cls}` }, svg);
      svgEl("rect", { x: x.toFixed(1), y, width: Math.max(1, w).toFixed(1), height: rowH - 8 }, g);
      svgEl("title", {}, g).textContent = `${p.title}: ${p.n}`;
      if (w >= 18) {
        svgEl("text", { class: "count", x: (x + w / 2).toFixed(1), y: y + rowH / 2 + 1 }, g).textContent = String(p.n);
      }
      x += w;
      drawn += 1;
    }
    svgEl("text", { class: "tick", x: (x + 6).toFixed(1), y: y + rowH / 2 + 2 }, svg).textContent = total ? String(total) : "none";
  });
  return drawn;
}
