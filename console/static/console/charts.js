// Line charts of a node's or a model's telemetry history, drawn as inline SVG (no library,
// no CDN). #charts[data-src] is the JSON history URL (?window=1h|24h); a value the runtime
// did not report is null and the line breaks there, as it does across a gap in time, so
// an absent KPI is never drawn as zero. New points arrive from node.telemetry events via
// MirbadCharts.push (live.js); the model page refetches instead (its points are sums).
(function () {
  "use strict";
  const root = document.getElementById("charts");
  if (!root) return;
  const kind = root.getAttribute("data-kind");
  const src = root.getAttribute("data-src");
  const W = 320, H = 90, PAD = 4;
  let windowName = "1h";
  let points = [];

  function sum(values) {
    const known = values.filter(function (v) { return typeof v === "number"; });
    return known.length ? known.reduce(function (a, b) { return a + b; }, 0) : null;
  }
  function engines(p) { return Object.values(p.engines || {}); }
  function gibOf(v) { return typeof v === "number" ? v / 1073741824 : null; }

  // Each chart: a title, a unit and one or more series (label, value of a point).
  function specs() {
    if (kind === "model") {
      return [
        { title: "Memory", unit: "GiB", series: [["memory", function (p) { return gibOf(p.memory); }]] },
        { title: "Tokens per second", unit: "tok/s", series: [
          ["generated", function (p) { return p.genTps; }],
          ["prompt", function (p) { return p.promptTps; }]] },
        { title: "Requests", unit: "", series: [
          ["running", function (p) { return p.running; }],
          ["waiting", function (p) { return p.waiting; }]] },
        { title: "KV cache", unit: "%", series: [
          ["used", function (p) { return typeof p.kv === "number" ? 100 * p.kv : null; }]] },
      ];
    }
    const gpuIndexes = [];
    for (const p of points) {
      for (const g of p.gpus || []) if (gpuIndexes.indexOf(g.index) < 0) gpuIndexes.push(g.index);
    }
    const instances = [];
    for (const p of points) {
      for (const id of Object.keys(p.engines || {})) if (instances.indexOf(id) < 0) instances.push(id);
    }
    function gpu(index, key) {
      return function (p) {
        const g = (p.gpus || []).find(function (x) { return x.index === index; });
        return g ? (key === "memUsed" ? gibOf(g.memUsed) : g[key]) : null;
      };
    }
    return [
      { title: "CPU", unit: "%", max: 100, series: [["cpu", function (p) { return p.cpu; }]] },
      { title: "RAM", unit: "GiB", series: [["used", function (p) { return gibOf(p.memUsed); }]] },
      { title: "GPU memory", unit: "GiB", series: gpuIndexes.map(function (i) { return ["GPU " + i, gpu(i, "memUsed")]; }) },
      { title: "GPU utilisation", unit: "%", max: 100, series: gpuIndexes.map(function (i) { return ["GPU " + i, gpu(i, "util")]; }) },
      { title: "Memory per model", unit: "GiB", series: instances.map(function (id) {
        return [id, function (p) { const e = (p.engines || {})[id]; return e ? gibOf(e.rss) : null; }];
      }) },
      { title: "Tokens per second", unit: "tok/s", series: [["generated", function (p) {
        return sum(engines(p).map(function (e) { return e.genTps; }));
      }]] },
      { title: "Queue depth", unit: "", series: [["waiting", function (p) {
        return sum(engines(p).map(function (e) { return e.waiting; }));
      }]] },
    ];
  }

  const SVGNS = "http://www.w3.org/2000/svg";
  const COLOURS = ["#2f6fdf", "#d9822b", "#2a9d55", "#a13ad9", "#c23b3b"];

  function chart(spec) {
    const box = document.createElement("figure");
    box.className = "chart";
    box.setAttribute("data-chart", spec.title);
    const caption = document.createElement("figcaption");
    box.appendChild(caption);
    const svg = document.createElementNS(SVGNS, "svg");
    svg.setAttribute("viewBox", "0 0 " + W + " " + H);
    svg.setAttribute("width", W);
    svg.setAttribute("height", H);
    box.appendChild(svg);
    if (!points.length || !spec.series.length) {
      caption.textContent = spec.title + ": no data yet";
      return box;
    }
    const t0 = points[0].t, t1 = points[points.length - 1].t;
    const step = windowName === "1h" ? 5 : 60;
    let top = spec.max || 0;
    for (const [, get] of spec.series) {
      for (const p of points) { const v = get(p); if (typeof v === "number" && v > top) top = v; }
    }
    top = top || 1;
    const x = function (t) { return PAD + (W - 2 * PAD) * (t1 > t0 ? (t - t0) / (t1 - t0) : 1); };
    const y = function (v) { return H - PAD - (H - 2 * PAD) * (v / top); };
    const last = [];
    spec.series.forEach(function ([label, get], i) {
      let d = "", prevT = null, latest = null;
      for (const p of points) {
        const v = get(p);
        if (typeof v !== "number") { prevT = null; continue; }
        // A gap of more than three steps breaks the line: no sample, no line.
        const move = prevT === null || p.t - prevT > 3 * step;
        d += (move ? "M" : "L") + x(p.t).toFixed(1) + "," + y(v).toFixed(1) + " ";
        prevT = p.t;
        latest = v;
      }
      const path = document.createElementNS(SVGNS, "path");
      path.setAttribute("d", d.trim());
      path.setAttribute("fill", "none");
      path.setAttribute("stroke", COLOURS[i % COLOURS.length]);
      path.setAttribute("stroke-width", "1.5");
      path.setAttribute("data-series", label);
      svg.appendChild(path);
      last.push(label + " " + (latest === null ? "–" : latest.toFixed(latest < 10 ? 2 : 0)) +
        (spec.unit ? " " + spec.unit : ""));
    });
    caption.textContent = spec.title + " (max " + top.toFixed(top < 10 ? 2 : 0) + " " + spec.unit +
      "): " + last.join(", ");
    return box;
  }

  function draw() {
    root.innerHTML = "";
    for (const spec of specs()) root.appendChild(chart(spec));
  }

  function load() {
    fetch(src + "?window=" + windowName, { credentials: "same-origin" })
      .then(function (r) { return r.ok ? r.json() : { points: [] }; })
      .then(function (body) { points = body.points || []; draw(); })
      .catch(function () { points = []; draw(); });
  }

  for (const button of document.querySelectorAll("[data-window]")) {
    button.addEventListener("click", function () {
      windowName = button.getAttribute("data-window");
      for (const b of document.querySelectorAll("[data-window]")) b.classList.toggle("on", b === button);
      load();
    });
  }

  window.MirbadCharts = {
    push: function (nodeId, point) {
      if (kind !== "node" || root.getAttribute("data-node") !== nodeId || windowName !== "1h") return;
      points.push(point);
      while (points.length && point.t - points[0].t > 3600) points.shift();
      draw();
    },
    reload: load,
  };
  load();
  if (kind === "model") setInterval(load, 15000);
})();
