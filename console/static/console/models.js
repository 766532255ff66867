// The Models list and a model's page, live over /ws/fleet/ (docs/decisions.md D65).
// A model.updated event carries the model's row over all its replicas
// (models_registry.services.model_summary, the function the pages render with): the
// cells it carries are set at once, then the row (list) or the live section (page) is
// fetched as the server renders it, so the cells it does not carry (restart pending,
// budget, flags, queue) are current too and a live page equals a reload.
(function () {
  "use strict";
  const table = document.getElementById("models");
  const page = document.getElementById("model-page");
  const pageModel = page ? page.getAttribute("data-model") : null;
  const pending = {};

  function gib(bytes) { return (bytes / 1073741824).toFixed(2) + " GiB"; }

  function badge(cell, state) {
    cell.innerHTML = "";
    const span = document.createElement("span");
    span.className = "badge s-" + state;
    span.textContent = state;
    cell.appendChild(span);
  }

  function fragment(url, selector, then) {
    fetch(url, { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (r) {
        if (r.status === 404) { then(null); return null; }
        return r.ok ? r.text() : null;
      })
      .then(function (html) {
        if (html === null || html === undefined) return;
        // A <tr> parses only inside a table.
        const doc = new DOMParser().parseFromString(
          selector === "tr" ? "<table><tbody>" + html + "</tbody></table>" : html, "text/html");
        const found = doc.querySelector(selector === "tr" ? "tr" : selector);
        if (found) then(found);
      })
      .catch(function () { /* the next event or a reload brings it */ });
  }

  // Several events in a burst fetch once.
  function later(key, fn) {
    clearTimeout(pending[key]);
    pending[key] = setTimeout(fn, 250);
  }

  function onListModel(m) {
    const body = table.querySelector("tbody");
    const id = String(m.modelId);
    let tr = body.querySelector('tr[data-model="' + CSS.escape(id) + '"]');
    if (tr) {
      tr.setAttribute("data-state", m.state);
      const link = tr.querySelector(".name a");
      if (link) link.textContent = m.servedName;
      const state = tr.querySelector(".state");
      badge(state, m.state);
      const error = document.createElement("div");
      error.className = "error";
      error.textContent = m.error || "";
      state.appendChild(error);
      tr.querySelector(".node").textContent = m.nodeId || "-";
      tr.querySelector(".measured").textContent =
        typeof m.measuredBytes === "number" ? gib(m.measuredBytes) : "–";
      tr.querySelector(".restarts").textContent = String(m.restartCount);
    }
    later("row" + id, function () {
      fragment("/models/" + encodeURIComponent(id) + "/row/", "tr", function (fresh) {
        const current = body.querySelector('tr[data-model="' + CSS.escape(id) + '"]');
        if (fresh === null) { if (current) current.remove(); return; }
        const empty = body.querySelector("tr.empty");
        if (empty) empty.remove();
        if (current) current.replaceWith(fresh); else body.appendChild(fresh);
      });
    });
  }

  function onPageModel(m) {
    if (String(m.modelId) !== pageModel) return;
    badge(document.getElementById("model-state"), m.state);
    document.getElementById("model-error").textContent = m.error || "–";
    document.getElementById("model-measured").textContent =
      typeof m.measuredBytes === "number" ? gib(m.measuredBytes) : "–";
    document.getElementById("model-restarts").textContent = String(m.restartCount);
    later("page", function () {
      fragment(location.pathname, "#model-live", function (fresh) {
        const current = document.getElementById("model-live");
        if (fresh && current) current.replaceWith(fresh);
      });
    });
  }

  if (!table && !page) return;
  // Only the models the page shows (console/consumers.py): the list's rows, or the one.
  let socket = null;
  function subscribe() {
    if (!socket) return;
    const models = [];
    if (table) {
      table.querySelectorAll("tbody tr[data-model]").forEach(function (tr) {
        models.push(Number(tr.getAttribute("data-model")));
      });
    } else {
      models.push(Number(pageModel));
    }
    socket.send({ type: "subscribe", models: models });
  }
  socket = MirbadSocket.connect("/ws/fleet/", function (event) {
    if (event.type !== "model.updated") return;
    if (table) onListModel(event.model);
    else onPageModel(event.model);
  }, function () {
    subscribe();
    MirbadSocket.resync(table ? ["#models tbody"] : ["#model-live"]).then(subscribe);
  });
})();
