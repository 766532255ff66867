// The Downloads page, live: each download.updated event on /ws/fleet/ replaces its row
// of #downloads, rendered element for element as console/templates/console/downloads.html
// renders it (console.views.download_row for the cells, download_views.download_actions
// for the buttons), so a live page equals a reload. No inline script: the page's CSP.
(function () {
  "use strict";
  const table = document.getElementById("downloads");
  if (!table || !window.MirbadSocket) return;
  const CANCELLABLE = ["Queued", "Running"];
  const RETRYABLE = ["Failed", "Cancelled"];
  const CELLS = ["node", "folder", "state", "progress", "rate", "error", "actions"];
  const GIB = 1073741824;

  // Python's f"{value:.{digits}f}": a value exactly halfway rounds to the even digit,
  // where toFixed would round it up (0.125 GiB is "0.12" on the server).
  function fixed(value, digits) {
    const scale = Math.pow(10, digits);
    const scaled = value * scale;
    if (Number.isInteger(scaled * 2) && !Number.isInteger(scaled)) {
      const down = Math.floor(scaled);
      return ((down % 2 === 0 ? down : down + 1) / scale).toFixed(digits);
    }
    return value.toFixed(digits);
  }

  // console.views.download_row: no percentage without a known total.
  function progress(d) {
    const done = d.bytesDone || 0;
    const total = d.bytesTotal;
    if (typeof total === "number" && Number.isInteger(total) && total > 0) {
      return fixed(done / GIB, 2) + " / " + fixed(total / GIB, 2) + " GiB (" +
        fixed(100 * done / total, 0) + " %)";
    }
    return fixed(done / GIB, 2) + " GiB so far";
  }

  function csrfToken() {
    const input = document.querySelector("#download-start input[name=csrfmiddlewaretoken]");
    return input ? input.value : "";
  }

  function actionForm(nodeId, folder, action, label, question) {
    const form = document.createElement("form");
    form.setAttribute("method", "post");
    form.setAttribute("action", "/downloads/" + encodeURIComponent(nodeId) + "/" +
      encodeURIComponent(folder) + "/" + action + "/");
    form.className = "inline";
    const token = document.createElement("input");
    token.type = "hidden";
    token.name = "csrfmiddlewaretoken";
    token.value = csrfToken();
    const button = document.createElement("button");
    button.type = "submit";
    button.setAttribute("data-action", action);
    if (question) button.setAttribute("data-confirm", question);
    button.textContent = label;
    form.append(token, button);
    return form;
  }

  // Rows are sorted by node, then folder, as the server sorts them.
  function before(a, b) {
    return a[0] < b[0] || (a[0] === b[0] && a[1] < b[1]);
  }

  function rowFor(nodeId, folder) {
    const body = table.querySelector("tbody");
    const id = nodeId + "/" + folder;
    let tr = body.querySelector('tr[data-download="' + CSS.escape(id) + '"]');
    if (tr) return tr;
    const empty = body.querySelector("tr.empty");
    if (empty) empty.remove();
    tr = document.createElement("tr");
    tr.setAttribute("data-download", id);
    tr.setAttribute("data-node", nodeId);
    tr.setAttribute("data-folder", folder);
    for (const name of CELLS) {
      const td = document.createElement("td");
      td.className = name;
      tr.appendChild(td);
    }
    const next = Array.from(body.querySelectorAll("tr[data-download]")).find(function (other) {
      const key = [other.getAttribute("data-node"), other.getAttribute("data-folder")];
      return before([nodeId, folder], key);
    });
    body.insertBefore(tr, next || null);
    return tr;
  }

  function onDownload(nodeId, d) {
    const tr = rowFor(nodeId, d.folder);
    tr.querySelector(".node").textContent = nodeId;
    tr.querySelector(".folder").textContent = d.folder;
    const state = tr.querySelector(".state");
    state.textContent = "";
    const badge = document.createElement("span");
    badge.className = "badge s-" + d.state;
    badge.textContent = d.state;
    state.appendChild(badge);
    tr.querySelector(".progress").textContent = progress(d);
    tr.querySelector(".rate").textContent = typeof d.rateBytesPerSecond === "number"
      ? fixed(d.rateBytesPerSecond / 1048576, 1) + " MiB/s" : "";
    tr.querySelector(".error").textContent = d.error || "";
    const actions = tr.querySelector(".actions");
    actions.textContent = "";
    if (CANCELLABLE.includes(d.state)) {
      actions.appendChild(actionForm(nodeId, d.folder, "cancel", "Cancel",
        "Cancel the download into " + d.folder + " on " + nodeId + "?"));
    }
    if (RETRYABLE.includes(d.state)) {
      actions.appendChild(actionForm(nodeId, d.folder, "retry", "Retry", null));
    }
  }

  window.MirbadSocket.connect("/ws/fleet/", function (event) {
    if (event.type === "download.updated") onDownload(event.nodeId, event.download);
  }, function () { window.MirbadSocket.resync(["#downloads tbody", "#weights tbody"]); });
})();
