// The log panel (console/templates/console/logs_panel.html, docs/decisions.md D62).
// One websocket per followed log, /ws/nodes/<node>/logs/<name>/ (console/log_consumer.py):
// log.list fills the <select>, log.lines appends (at most 2,000 lines stay), log.error
// is shown in the indicator. The search box filters the shown lines (plain substring,
// case-insensitive). Its own reconnect (1 s doubling to 30 s): MirbadSocket drives the
// page's #live badge, which is about the page's events, not this log.
(function () {
  "use strict";
  const MAX_LINES = 2000;
  const panel = document.getElementById("logs-panel");
  if (!panel) return;
  const select = document.getElementById("log-select");
  const search = document.getElementById("log-search");
  const pre = document.getElementById("log-lines");
  const badge = document.getElementById("log-following");
  const node = panel.dataset.node;
  let lines = [];
  let socket = null;
  let delay = 1000;
  let retry = null;

  function say(text, cls) {
    badge.textContent = text;
    badge.className = "badge " + (cls || "");
  }

  function render() {
    const needle = search.value.toLowerCase();
    const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    const shown = needle
      ? lines.filter(function (l) { return l.text.toLowerCase().indexOf(needle) !== -1; })
      : lines;
    pre.textContent = shown.map(function (l) { return l.text; }).join("\n");
    if (atEnd) pre.scrollTop = pre.scrollHeight;
  }

  function fillList(logs) {
    const current = select.value;
    select.textContent = "";
    logs.forEach(function (entry) {
      const option = document.createElement("option");
      option.value = entry.name;
      option.textContent = entry.kind === "engine"
        ? entry.name + " (" + (entry.state || "engine") + ")"
        : entry.name;
      option.selected = entry.name === current;
      select.appendChild(option);
    });
    if (select.value !== current) {
      // The followed log is not (or no longer) listed: keep it selectable.
      const option = document.createElement("option");
      option.value = current;
      option.textContent = current + " (not on this node)";
      option.selected = true;
      select.appendChild(option);
    }
  }

  function onEvent(event) {
    if (event.type === "log.list") {
      fillList(event.logs || []);
    } else if (event.type === "log.lines") {
      if (event.name !== select.value) return;
      lines = lines.concat(event.lines || []);
      if (lines.length > MAX_LINES) lines = lines.slice(lines.length - MAX_LINES);
      say("following", "s-live");
      render();
    } else if (event.type === "log.error") {
      say(event.message, "s-lost");
    }
  }

  function open(name) {
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    const path = "/ws/nodes/" + encodeURIComponent(node) + "/logs/" + encodeURIComponent(name) + "/";
    const ws = new WebSocket(scheme + location.host + path);
    socket = ws;
    ws.onopen = function () { delay = 1000; say("connected", "s-live"); };
    ws.onmessage = function (msg) {
      let event;
      try { event = JSON.parse(msg.data); } catch (e) { return; }
      onEvent(event);
    };
    ws.onclose = function (closed) {
      if (socket !== ws) return;  // replaced by another log's socket
      if (closed.code === 4401) { say("not allowed: log in as an operator", "s-lost"); return; }
      if (closed.code === 4404) {
        if (badge.className.indexOf("s-lost") === -1) say("no such log on this node", "s-lost");
        return;
      }
      say("connection lost, reconnecting…", "s-lost");
      retry = setTimeout(function () { open(name); }, delay);
      delay = Math.min(delay * 2, 30000);
    };
  }

  function follow(name) {
    if (retry) { clearTimeout(retry); retry = null; }
    if (socket) { const old = socket; socket = null; old.close(); }
    lines = [];
    render();
    say("connecting…", "");
    open(name);
  }

  select.addEventListener("change", function () { follow(select.value); });
  search.addEventListener("input", render);
  follow(panel.dataset.log || "agent");
})();
