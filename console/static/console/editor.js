// The model editor: which source fields show, and the memory estimate as you type
// (docs/decisions.md D66). The unsaved form goes as JSON to POST /models/estimate/
// 300 ms after the last change; the answer is the breakdown and one admission line per
// GPU ("GPU 1: needs 8.9 GiB, 10.9 GiB free after the 2.5 GiB reserve - fits"), the
// text the master's admission writes, shown as it comes.
(function () {
  "use strict";
  const form = document.getElementById("model-form");
  if (!form) return;
  const out = document.getElementById("estimate");
  const hf = document.getElementById("source-hf");
  let timer = null;
  let sequence = 0;

  function value(name) {
    const el = form.elements.namedItem(name);
    return el ? el.value.trim() : "";
  }
  function checked(name) {
    const el = form.elements.namedItem(name);
    return !!(el && el.checked);
  }
  // A number when the text is one; the text otherwise, so the master names the field.
  function number(name, optional) {
    const text = value(name);
    if (text === "") return optional ? null : text;
    return /^-?\d+$/.test(text) ? parseInt(text, 10) : text;
  }
  function bytes(gibText) {
    if (gibText === "") return null;
    const n = Number(gibText);
    return isFinite(n) ? Math.round(n * 1073741824) : gibText;
  }

  function body() {
    const placements = [];
    form.querySelectorAll('input[name="place"]:checked').forEach(function (box) {
      const node = box.value;
      const item = { node: node, gpuUuids: [] };
      const budgets = [];
      form.querySelectorAll('input[name="gpus-' + CSS.escape(node) + '"]:checked')
        .forEach(function (gpu) {
          item.gpuUuids.push(gpu.value);
          const b = form.elements.namedItem("budget-" + node + "-" + gpu.value);
          const v = b ? bytes(b.value.trim()) : null;
          if (v !== null) budgets.push(v);
        });
      if (budgets.length) item.gpuBudgets = budgets;
      placements.push(item);
    });
    const modelId = form.getAttribute("data-model");
    return {
      modelId: modelId ? parseInt(modelId, 10) : null,
      sourceNode: value("source_node") || null,
      sourceFolder: value("source_folder"),
      sourceFile: value("source_file"),
      settings: {
        context_size: number("context_size"),
        parallel: number("parallel"),
        gpu_layers: number("gpu_layers"),
        flash_attention: value("flash_attention"),
        cache_type_k: value("cache_type_k"),
        cache_type_v: value("cache_type_v"),
        batch_size: number("batch_size", true),
        ubatch_size: number("ubatch_size", true),
        threads: number("threads", true),
        reasoning: value("reasoning"),
        embedding: checked("embedding"),
        pooling: value("pooling") || null,
        causal_attention: checked("causal_attention"),
        emulate_dimensions: checked("emulate_dimensions"),
        chat_template: value("chat_template") || null,
        extra_args: value("extra_args").split("\n").map(function (a) { return a.trim(); })
          .filter(function (a) { return a; }),
      },
      memoryBudgetBytes: bytes(value("memory_budget_gib")),
      placements: placements,
    };
  }

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }
  // Under a GiB in MiB: a small model's KV cache still visibly follows the context size.
  function gib(b) {
    if (typeof b !== "number") return "–";
    return b >= 1073741824 ? (b / 1073741824).toFixed(2) + " GiB" : (b / 1048576).toFixed(1) + " MiB";
  }

  const PARTS = [
    ["weights", "Weights"], ["kv", "KV cache"], ["ssm_state", "SSM state"],
    ["compute", "Compute buffer"], ["cuda_context", "CUDA context"],
    ["budget", "Budget (x 1.10, with the CUDA context)"],
  ];

  function render(answer) {
    out.innerHTML = "";
    if (!answer.targets.length) {
      out.appendChild(el("p", "muted", "Choose a node (Source or Placement) to estimate on."));
    }
    answer.targets.forEach(function (t) {
      const box = el("div", "target");
      box.setAttribute("data-node", t.node);
      box.appendChild(el("h3", "", t.node + (t.gpus ? " · " + t.gpus + " GPU(s)" : " · host memory")));
      if (t.error) {
        box.appendChild(el("p", "error estimate-error", t.error));
        out.appendChild(box);
        return;
      }
      const table = el("table", "facts breakdown");
      PARTS.forEach(function (p) {
        const tr = el("tr");
        tr.appendChild(el("th", "", p[1]));
        tr.appendChild(el("td", p[0], gib(t.breakdown[p[0]])));
        table.appendChild(tr);
      });
      box.appendChild(table);
      if (t.budgetSource === "manual") {
        box.appendChild(el("p", "", "Admission uses the budget set by hand: " + gib(t.budgetBytes) + "."));
      }
      const lines = el("ul", "lines");
      t.lines.forEach(function (line) {
        const li = el("li", "line " + (line.fits ? "fits" : "does-not-fit"), line.text);
        li.setAttribute("data-fits", line.fits ? "1" : "0");
        lines.appendChild(li);
      });
      box.appendChild(lines);
      if (t.running) {
        box.appendChild(el("p", "muted", "Its running instance's memory is counted as used here."));
      }
      out.appendChild(box);
    });
  }

  // The ranked suggestions for the form as it stands, as model_edit.html renders a
  // saved model's: the same list, now also before the first save.
  function suggestions(list) {
    const old = document.getElementById("suggestions");
    if (!old || !list) return;
    const ol = el("ol");
    ol.id = "suggestions";
    list.forEach(function (s) {
      const li = el("li");
      li.setAttribute("data-node", s.node);
      li.setAttribute("data-suitable", s.suitable ? "1" : "0");
      li.appendChild(el("strong", "", s.node));
      let text = s.suitable
        ? " · suitable" + (s.gpuUuids && s.gpuUuids.length ? " on " + s.gpuUuids.join(", ") : "")
        : " · not suitable";
      if (s.holdsWeights) text += " · holds the weights";
      li.appendChild(document.createTextNode(text + " · " + s.instances + " instance(s)"));
      li.appendChild(el("br"));
      li.appendChild(el("small", "", s.reasons.join("; ")));
      ol.appendChild(li);
    });
    old.replaceWith(ol);
  }

  function problem(text) {
    out.innerHTML = "";
    const p = el("p", "error", text);
    p.id = "estimate-error";
    out.appendChild(p);
  }

  function estimate() {
    const data = body();
    if (!data.sourceFolder || !data.sourceFile) {
      out.innerHTML = "";
      out.appendChild(el("p", "muted", "Name a folder, a file and a node to see the estimate."));
      return;
    }
    const mine = ++sequence;
    const token = form.elements.namedItem("csrfmiddlewaretoken").value;
    fetch(form.getAttribute("data-estimate-url"), {
      method: "POST",
      credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRFToken": token },
      body: JSON.stringify(data),
    }).then(function (r) {
      return r.json().then(function (answer) { return { ok: r.ok, answer: answer }; });
    }).then(function (result) {
      if (mine !== sequence) return; // a later keystroke's answer is coming
      if (result.ok) { render(result.answer); suggestions(result.answer.suggestions); }
      else problem((result.answer.error || {}).message || "The estimate failed.");
    }).catch(function () {
      if (mine === sequence) problem("The estimate could not be fetched; is the master up?");
    });
  }

  function sourceKind() {
    const picked = form.querySelector('input[name="source_kind"]:checked');
    if (hf) hf.hidden = !picked || picked.value !== "huggingface";
  }

  function changed(event) {
    if (event.target && event.target.name === "source_kind") sourceKind();
    clearTimeout(timer);
    timer = setTimeout(estimate, 300);
  }
  form.addEventListener("input", changed);
  form.addEventListener("change", changed);
  sourceKind();
  estimate();
})();
