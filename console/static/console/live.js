// Live updates of the Overview, the Nodes list and a node's page over one websocket
// (socket.js): the Overview and the Nodes list follow the "fleet" group, a node page its
// "node.<id>" group (nodes/events.py names the typed events).
//
// A row is never assembled here from pieces: when a node appears or changes state,
// reasons, approval or draining, its <tr> is fetched as the server renders it
// (/nodes/<id>/row/, console/node_views.py row_html), so a live row equals a
// reloaded one, Approve button included. Only the numbers that change every 5 s (CPU,
// RAM, last seen) are written in place, in the markup bar.html prints.
(function () {
  "use strict";
  const live = document.getElementById("live");
  if (!live) return;
  const nodePage = document.getElementById("node-page");
  const pageNode = nodePage ? nodePage.getAttribute("data-node") : null;
  const table = document.getElementById("nodes");
  const filtered = table ? table.getAttribute("data-filtered") === "1" : false;
  const signatures = {};

  function fetchHtml(url) {
    return fetch(url, { credentials: "same-origin", headers: { "X-Requested-With": "fetch" } })
      .then(function (r) { return r.ok ? r.text() : null; })
      .catch(function () { return null; });
  }

  // console/templates/console/bar.html, element for element.
  function bar(used, total) {
    if (typeof used !== "number" || typeof total !== "number" || total <= 0) return "–";
    const u = (used / 1073741824).toFixed(1), t = (total / 1073741824).toFixed(1);
    const pct = Math.max(0, Math.min(100, Math.round(100 * used / total)));
    return '<meter min="0" max="100" value="' + pct + '" title="' + u + " / " + t + ' GiB"></meter> ' +
      u + " / " + t + " GiB";
  }

  function cpuCell(value) {
    if (typeof value !== "number") return "–";
    const p = Math.round(value);
    return '<meter min="0" max="100" value="' + p + '"></meter> ' + p + " %";
  }

  // console/formats.py age_text.
  function age(seconds) {
    seconds = Math.max(0, seconds);
    if (seconds < 90) return Math.round(seconds) + " s ago";
    if (seconds < 5400) return Math.round(seconds / 60) + " min ago";
    if (seconds < 129600) return Math.round(seconds / 3600) + " h ago";
    return Math.round(seconds / 86400) + " d ago";
  }

  function signature(node) {
    return [node.state, (node.reasons || []).join(","), node.approved, node.draining,
      node.maintenance, node.lastError].join("|");
  }

  // Pending swaps, one per node: events that arrive while a row is fetched are not lost.
  const swapping = {};
  function swapRow(nodeId) {
    if (swapping[nodeId]) { swapping[nodeId] = "again"; return; }
    swapping[nodeId] = "busy";
    fetchHtml("/nodes/" + encodeURIComponent(nodeId) + "/row/").then(function (html) {
      const again = swapping[nodeId] === "again";
      delete swapping[nodeId];
      if (html !== null) {
        const body = table.querySelector("tbody");
        const holder = document.createElement("tbody");
        holder.innerHTML = html.trim();
        const fresh = holder.querySelector("tr");
        const old = body.querySelector('tr[data-node="' + CSS.escape(nodeId) + '"]');
        if (fresh && old) old.replaceWith(fresh);
        else if (fresh && !filtered) {
          const empty = body.querySelector("tr.empty");
          if (empty) empty.remove();
          body.appendChild(fresh);
          subscribe();  // its next events too
        }
      }
      if (again) swapRow(nodeId);
    });
  }

  function onNodeRow(node) {
    if (!table) return;
    const tr = table.querySelector('tr[data-node="' + CSS.escape(node.nodeId) + '"]');
    const sig = signature(node);
    if (!tr || signatures[node.nodeId] !== undefined && signatures[node.nodeId] !== sig ||
        tr.getAttribute("data-state") !== node.state) {
      signatures[node.nodeId] = sig;
      swapRow(node.nodeId);
      return;
    }
    signatures[node.nodeId] = sig;
    tr.classList.toggle("stale", node.state === "Offline");
    tr.querySelector(".cpu").innerHTML = cpuCell(node.cpuPercent);
    tr.querySelector(".ram").innerHTML = bar(node.memoryUsedBytes, node.memoryTotalBytes);
    if (typeof node.lastSeen === "number") {
      tr.querySelector(".seen").textContent = age(Date.now() / 1000 - node.lastSeen);
    }
  }

  // The node page: its "current" block is re-rendered by the server (throttled), the
  // charts take the new point from node.telemetry (charts.js).
  let currentTimer = null;
  function refreshCurrent() {
    if (currentTimer) return;
    currentTimer = setTimeout(function () {
      currentTimer = null;
      fetchHtml("/nodes/" + encodeURIComponent(pageNode) + "/current/").then(function (html) {
        if (html === null) return;
        const holder = document.createElement("div");
        holder.innerHTML = html.trim();
        const fresh = holder.firstElementChild;
        const old = document.getElementById("node-current");
        if (fresh && old) old.replaceWith(fresh);
      });
    }, 500);
  }

  function onNode(node) {
    if (pageNode !== null) {
      if (pageNode === node.nodeId) refreshCurrent();
      return;
    }
    onNodeRow(node);
    refreshSummary();
  }

  // The Overview's tiles and Needs attention, rendered by the server (at most every 2 s).
  let summaryTimer = null;
  function refreshSummary() {
    if (!document.getElementById("tiles") || summaryTimer) return;
    summaryTimer = setTimeout(function () {
      summaryTimer = null;
      fetchHtml("/overview/summary/").then(function (html) {
        if (html === null) return;
        const holder = document.createElement("div");
        holder.innerHTML = html.trim();
        for (const id of ["tiles", "attention"]) {
          const fresh = holder.querySelector("#" + id);
          const old = document.getElementById(id);
          if (fresh && old) old.replaceWith(fresh);
        }
      });
    }, 2000);
  }

  // '2026-12-02 18:35 UTC' from an ISO time in UTC, as console/formats.py when() prints it.
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
      const tr = table && table.querySelector('tr[data-node="' + CSS.escape(c.nodeId) + '"]');
      if (tr) certCell(tr.querySelector(".cert"), c);
      refreshSummary();
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

  // The Overview and the Nodes list show some nodes: they subscribe to those (their rows'
  // ids), to nodes that enroll (pending) and, on the Overview, to a summary of the rest for
  // the tiles (console/consumers.py). A node page's socket carries its node only.
  let socket = null;
  function subscribe() {
    if (pageNode !== null || !socket || !table) return;
    const nodes = [];
    table.querySelectorAll("tbody tr[data-node]").forEach(function (tr) {
      nodes.push(tr.getAttribute("data-node"));
    });
    socket.send({ type: "subscribe", nodes: nodes, pending: !filtered,
      summary: !!document.getElementById("tiles") });
  }

  socket = window.MirbadSocket.connect(live.getAttribute("data-ws") || "/ws/fleet/", function (event) {
    if (event.type === "node.updated") onNode(event.node);
    else if (event.type === "node.certificate") onCertificate(event.certificate);
    // Models and downloads have their own pages; here they only change the tiles and
    // Needs attention, as does anything of the nodes this page does not show.
    else if (event.type === "model.updated" || event.type === "download.updated" ||
             event.type === "fleet.changed") refreshSummary();
    else if (event.type === "node.telemetry" && window.MirbadCharts) {
      window.MirbadCharts.push(event.nodeId, event.point);
    }
  }, function () {
    subscribe();
    // After every (re)connect: what changed while the socket was away is rendered again,
    // and the page subscribes again to the rows it now shows.
    window.MirbadSocket.resync(pageNode !== null
      ? ["#node-current", "#certificate", "#actions"]
      : ["#nodes tbody", "#tiles", "#attention"]).then(subscribe);
  });
})();
