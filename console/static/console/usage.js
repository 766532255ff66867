// The Usage page's chart: a bar per hour (or day) of tokens, drawn as SVG from the data
// the page embeds with json_script (#usage-data, console/usage_views._series). No
// inline script and no library from a CDN: the page's CSP allows this origin only.
(function () {
  "use strict";
  const holder = document.getElementById("usage-chart");
  const source = document.getElementById("usage-data");
  if (!holder || !source) return;
  const data = JSON.parse(source.textContent);
  const buckets = data.buckets || [];
  const NS = "http://www.w3.org/2000/svg";
  const width = 720, height = 180, left = 56, bottom = 22, top = 8;
  const plotHeight = height - bottom - top;
  const max = Math.max(1, ...buckets.map(function (b) { return b.tokens; }));

  function el(name, attrs, text) {
    const node = document.createElementNS(NS, name);
    for (const key in attrs) node.setAttribute(key, String(attrs[key]));
    if (text !== undefined) node.textContent = text;
    return node;
  }

  const svg = el("svg", {
    viewBox: "0 0 " + width + " " + height, width: "100%", role: "img",
    "aria-label": "Tokens per " + data.unit,
  });
  svg.appendChild(el("line", {
    x1: left, y1: top + plotHeight, x2: width, y2: top + plotHeight, stroke: "#8a93a3",
  }));
  svg.appendChild(el("text", { x: left - 6, y: top + 10, "text-anchor": "end",
    "font-size": 11, fill: "#1d2330" }, String(max)));
  svg.appendChild(el("text", { x: left - 6, y: top + plotHeight, "text-anchor": "end",
    "font-size": 11, fill: "#1d2330" }, "0"));
  const slot = buckets.length ? (width - left) / buckets.length : 0;
  buckets.forEach(function (b, i) {
    const h = Math.round(plotHeight * b.tokens / max);
    const bar = el("rect", {
      x: (left + i * slot + slot * 0.1).toFixed(1), y: top + plotHeight - h,
      width: Math.max(1, slot * 0.8).toFixed(1), height: h, fill: "#4a7bd0",
      "data-label": b.label,
    });
    bar.appendChild(el("title", {}, b.label + ": " + b.tokens + " tokens, " +
      b.requests + " requests"));
    svg.appendChild(bar);
  });
  // The first and last bucket's labels under the axis; every bar has its own tooltip.
  if (buckets.length) {
    svg.appendChild(el("text", { x: left, y: height - 6, "font-size": 11, fill: "#1d2330" },
      buckets[0].label));
    svg.appendChild(el("text", { x: width, y: height - 6, "text-anchor": "end",
      "font-size": 11, fill: "#1d2330" }, buckets[buckets.length - 1].label));
  }
  holder.appendChild(svg);
})();
