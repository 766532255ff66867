// Overview live updates: one websocket, typed events from the "fleet" group.
(function () {
  "use strict";
  const live = document.getElementById("live");

  function badge(cell, state) {
    cell.innerHTML = "";
    const span = document.createElement("span");
    span.className = "badge s-" + state;
    span.textContent = state;
    cell.appendChild(span);
  }

  function row(table, attr, id, cells) {
    const body = document.querySelector("#" + table + " tbody");
    let tr = body.querySelector("tr[" + attr + '="' + CSS.escape(String(id)) + '"]');
    if (!tr) {
      const empty = body.querySelector("tr.empty");
      if (empty) empty.remove();
      tr = document.createElement("tr");
      tr.setAttribute(attr, id);
      for (const name of cells) {
        const td = document.createElement("td");
        td.className = name;
        tr.appendChild(td);
      }
      body.appendChild(tr);
    }
    return tr;
  }

  function pct(value) {
    return value === null || value === undefined ? "–" : Math.round(value) + " %";
  }

  function ram(node) {
    if (node.memoryPercent === null || node.memoryPercent === undefined) return "–";
    const gib = function (b) { return (b / 1073741824).toFixed(1); };
    if (node.memoryUsedBytes && node.memoryTotalBytes) {
      return gib(node.memoryUsedBytes) + " / " + gib(node.memoryTotalBytes) + " GiB (" +
        Math.round(node.memoryPercent) + " %)";
    }
    return pct(node.memoryPercent);
  }

  function onNode(node) {
    const tr = row("nodes", "data-node", node.nodeId, [
      "id", "state", "cpu", "ram", "reasons", "cert", "key", "actions",
    ]);
    tr.children[0].textContent = node.nodeId;
    badge(tr.querySelector(".state"), node.state);
    tr.querySelector(".cpu").textContent = pct(node.cpuPercent);
    tr.querySelector(".ram").textContent = ram(node);
    tr.querySelector(".reasons").textContent = (node.reasons || []).join(", ");
  }

  function gib(bytes) { return (bytes / 1073741824).toFixed(2) + " GiB"; }

  // The event carries the whole row over all replicas (models_registry.services.model_summary,
  // the function the page is rendered with): every cell is replaced, none is merged.
  function onModel(model) {
    const tr = row("models", "data-model", model.modelId, [
      "name", "state", "node", "budget", "measured", "restarts", "notes", "error",
    ]);
    tr.children[0].textContent = model.servedName;
    badge(tr.querySelector(".state"), model.state);
    tr.querySelector(".node").textContent = model.nodeId || "-";
    tr.querySelector(".error").textContent = model.error || "";
    tr.querySelector(".measured").textContent =
      typeof model.measuredBytes === "number" ? gib(model.measuredBytes) : "–";
    tr.querySelector(".restarts").textContent = String(model.restartCount);
  }

  // No percentage is shown when the total is unknown: a byte count that keeps rising
  // says more than a percentage that cannot be right.
  function onDownload(nodeId, d) {
    const tr = row("downloads", "data-download", nodeId + "/" + d.folder, [
      "node", "folder", "state", "progress", "rate", "error",
    ]);
    tr.querySelector(".node").textContent = nodeId;
    tr.querySelector(".folder").textContent = d.folder;
    badge(tr.querySelector(".state"), d.state);
    const done = d.bytesDone || 0;
    let text = (done / 1073741824).toFixed(2) + " GiB so far";
    if (typeof d.bytesTotal === "number" && d.bytesTotal > 0) {
      text = (done / 1073741824).toFixed(2) + " / " + (d.bytesTotal / 1073741824).toFixed(2) +
        " GiB (" + Math.round(100 * done / d.bytesTotal) + " %)";
    }
    tr.querySelector(".progress").textContent = text;
    tr.querySelector(".rate").textContent = typeof d.rateBytesPerSecond === "number"
      ? (d.rateBytesPerSecond / 1048576).toFixed(1) + " MiB/s" : "";
    tr.querySelector(".error").textContent = d.error || "";
  }

  let delay = 1000;
  function connect() {
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    const ws = new WebSocket(scheme + location.host + "/ws/fleet/");
    ws.onopen = function () { live.textContent = "live"; delay = 1000; };
    ws.onmessage = function (msg) {
      const event = JSON.parse(msg.data);
      if (event.type === "node.updated") onNode(event.node);
      else if (event.type === "model.updated") onModel(event.model);
      else if (event.type === "download.updated") onDownload(event.nodeId, event.download);
    };
    ws.onclose = function () {
      live.textContent = "reconnecting…";
      setTimeout(connect, delay);
      delay = Math.min(delay * 2, 30000);
    };
  }
  connect();
})();
