// Live updates of the console's pages: one websocket per page (the Overview's "fleet"
// group, a node page's "node.<id>"), typed events; every cell is rendered as the
// server renders it (console/templates/console/*.html), so a live page equals a reload.
(function () {
  "use strict";
  const live = document.getElementById("live");
  const nodePage = document.getElementById("node-page");
  const pageNode = nodePage ? nodePage.getAttribute("data-node") : null;

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

  // The node's own cells: an Overview row, or the node page.
  function nodeCells(nodeId) {
    if (pageNode !== null) return pageNode === nodeId ? nodePage : null;
    const table = document.getElementById("nodes");
    if (!table) return null;
    const tr = row("nodes", "data-node", nodeId, [
      "id", "state", "cpu", "ram", "reasons", "cert", "key", "actions",
    ]);
    if (!tr.children[0].firstChild) {
      const a = document.createElement("a");
      a.href = "/nodes/" + encodeURIComponent(nodeId) + "/";
      a.textContent = nodeId;
      tr.children[0].appendChild(a);
    }
    return tr;
  }

  function onNode(node) {
    const cells = nodeCells(node.nodeId);
    if (!cells) return;
    badge(cells.querySelector(".state"), node.state);
    cells.querySelector(".cpu").textContent = pct(node.cpuPercent);
    cells.querySelector(".ram").textContent = ram(node);
    cells.querySelector(".reasons").textContent = (node.reasons || []).join(", ");
  }

  // '2026-12-02 18:35 UTC' from an ISO time in UTC, as console/views.py _when prints it.
  function when(iso) { return iso ? iso.slice(0, 10) + " " + iso.slice(11, 16) + " UTC" : ""; }

  // console/templates/console/cert_cell.html, element for element.
  function certCell(cell, c) {
    cell.textContent = c.notAfter ? "until " + when(c.notAfter) : "–";
    if (c.rotation) {
      const span = document.createElement("span");
      span.className = "badge";
      span.setAttribute("data-rotation", c.rotation.stage);
      span.textContent = "Rotating: " + c.rotation.stage;
      cell.append(" ", span);
    }
    if (c.renewalError) {
      const span = document.createElement("span");
      span.className = "error";
      span.title = c.renewalError;
      span.textContent = "renewal failed";
      cell.append(" ", span);
    }
  }

  function setText(id, text) {
    const el = document.getElementById(id);
    if (el) el.textContent = text || "–";
  }

  function onCertificate(c) {
    if (pageNode === null) {
      const tr = document.querySelector('#nodes tr[data-node="' + CSS.escape(c.nodeId) + '"]');
      if (tr) certCell(tr.querySelector(".cert"), c);
      return;
    }
    if (pageNode !== c.nodeId) return;
    certCell(document.querySelector("#certificate .cert"), c);
    setText("cert-serial", c.serial);
    setText("cert-not-after", when(c.notAfter));
    setText("cert-renew-at", when(c.renewAt));
    setText("cert-renewal-error", c.renewalError);
    const r = c.rotation;
    setText("rotation-stage", r ? r.stage + " (" + r.rotationId + ", " + r.reason +
      (r.attempts ? ", " + r.attempts + " failed attempts: " + r.lastError : "") + ")" : "none");
  }

  function gib(bytes) { return (bytes / 1073741824).toFixed(2) + " GiB"; }

  // The event carries the whole row over all replicas (models_registry.services.model_summary,
  // the function the page is rendered with): every cell is replaced, none is merged.
  function onModel(model) {
    if (!document.getElementById("models")) return;
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
    if (!document.getElementById("downloads")) return;
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
    const ws = new WebSocket(scheme + location.host + (live.getAttribute("data-ws") || "/ws/fleet/"));
    ws.onopen = function () { live.textContent = "live"; delay = 1000; };
    ws.onmessage = function (msg) {
      const event = JSON.parse(msg.data);
      if (event.type === "node.updated") onNode(event.node);
      else if (event.type === "node.certificate") onCertificate(event.certificate);
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
