// The model editor: which source and runtime fields show, and the memory estimate as you
// type (docs/decisions.md D66). The unsaved form goes as JSON to POST /models/estimate/
// 300 ms after the last change; the answer is the breakdown and one admission line per
// GPU ("GPU 1: needs 8.9 GiB, 10.9 GiB free after the 2.5 GiB reserve - fits"), the
// text the master's admission writes, shown as it comes. A vLLM draft has no breakdown:
// its budget is its share of each placed GPU (docs/decisions.md D89). Only the chosen
// runtime's section is sent, as the form sends it on save; without this script both
// sections show and the server keeps the same rule.
(function () {
  "use strict";
  const form = document.getElementById("model-form");
  if (!form) return;
  const out = document.getElementById("estimate");
  const hf = document.getElementById("source-hf");
  const llamacpp = document.getElementById("section-llamacpp");
  const vllm = document.getElementById("section-vllm");
  const image = document.getElementById("runtime-image");
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

  function decimal(name) {
    const text = value(name);
    if (text === "") return text;
    const n = Number(text);
    return isFinite(n) ? n : text;
  }
  function lines(name) {
    return value(name).split("\n").map(function (a) { return a.trim(); })
      .filter(function (a) { return a; });
  }
  function isVllm() { return value("runtime") === "vllm"; }

  function llamacppSettings() {
    return {
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
      extra_args: lines("extra_args"),
    };
  }
  // As console/model_editor.py's vllm_settings: empty optional fields are vLLM's default.
  function vllmSettings() {
    const caching = value("vllm_enable_prefix_caching");
    return {
      max_model_len: number("vllm_max_model_len", true),
      max_num_seqs: number("vllm_max_num_seqs"),
      gpu_memory_utilization: decimal("vllm_gpu_memory_utilization"),
      tensor_parallel_size: number("vllm_tensor_parallel_size", true),
      dtype: value("vllm_dtype"),
      quantization: value("vllm_quantization") || null,
      kv_cache_dtype: value("vllm_kv_cache_dtype"),
      enable_prefix_caching: caching === "on" ? true : caching === "off" ? false : (caching || null),
      chat_template: value("vllm_chat_template") || null,
      tool_call_parser: value("vllm_tool_call_parser") || null,
      reasoning_parser: value("vllm_reasoning_parser") || null,
      extra_args: lines("vllm_extra_args"),
    };
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
    const delivery = value("delivery");
    return {
      modelId: modelId ? parseInt(modelId, 10) : null,
      runtime: value("runtime"),
      delivery: delivery,
      image: delivery === "process" ? "" : value("image"),
      sourceNode: value("source_node") || null,
      sourceFolder: value("source_folder"),
      sourceFile: value("source_file"),
      settings: isVllm() ? vllmSettings() : llamacppSettings(),
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

  // vLLM's budget: its share of each placed GPU's total, then the admission lines.
  function shares(t) {
    const table = el("table", "facts shares");
    t.gpuShares.forEach(function (s) {
      const tr = el("tr");
      tr.setAttribute("data-gpu", s.gpuUuid);
      tr.appendChild(el("th", "", s.label));
      tr.appendChild(el("td", "share",
        t.gpuMemoryUtilization + " x " + gib(s.totalBytes) + " = " + gib(s.budgetBytes)));
      table.appendChild(tr);
    });
    return table;
  }

  function render(answer) {
    out.innerHTML = "";
    if (!answer.targets.length) {
      out.appendChild(el("p", "muted", isVllm()
        ? "vLLM needs GPUs: tick a node's GPUs under Placement to estimate on."
        : "Choose a node (Source or Placement) to estimate on."));
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
      if (t.gpuShares) {
        box.appendChild(el("p", "", "vLLM takes " + t.gpuMemoryUtilization +
          " of each placed GPU's total memory at start:"));
        box.appendChild(shares(t));
      } else {
        const table = el("table", "facts breakdown");
        PARTS.forEach(function (p) {
          const tr = el("tr");
          tr.appendChild(el("th", "", p[1]));
          tr.appendChild(el("td", p[0], gib(t.breakdown[p[0]])));
          table.appendChild(tr);
        });
        box.appendChild(table);
      }
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
  function suggestions(list, note) {
    const old = document.getElementById("suggestions");
    if (!old || !list) return;
    if (!list.length && note) {
      const p = el("p", "", note);
      p.id = "suggestions";
      old.replaceWith(p);
      return;
    }
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
    // A vLLM model is the whole folder: no file to name.
    if (!data.sourceFolder || (!data.sourceFile && data.runtime !== "vllm")) {
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
      if (result.ok) {
        render(result.answer);
        suggestions(result.answer.suggestions, result.answer.suggestionsNote);
      }
      else problem((result.answer.error || {}).message || "The estimate failed.");
    }).catch(function () {
      if (mine === sequence) problem("The estimate could not be fetched; is the master up?");
    });
  }

  function sourceKind() {
    const picked = form.querySelector('input[name="source_kind"]:checked');
    if (hf) hf.hidden = !picked || picked.value !== "huggingface";
  }

  // The chosen runtime's section shows; vLLM runs only in a container, so "process" is
  // not offered for it (the master refuses it too: models_registry.services).
  function runtime() {
    const vllmChosen = isVllm();
    if (llamacpp) llamacpp.hidden = vllmChosen;
    if (vllm) vllm.hidden = !vllmChosen;
    const delivery = form.elements.namedItem("delivery");
    if (delivery && delivery.options) {
      Array.prototype.forEach.call(delivery.options, function (option) {
        if (option.value !== "process") return;
        option.hidden = vllmChosen;
        option.disabled = vllmChosen;
      });
      if (vllmChosen && delivery.value === "process") delivery.value = "container";
    }
    if (image) image.hidden = value("delivery") !== "container";
  }

  function changed(event) {
    if (event.target && event.target.name === "source_kind") sourceKind();
    if (event.target && (event.target.name === "runtime" || event.target.name === "delivery")) {
      runtime();
    }
    clearTimeout(timer);
    timer = setTimeout(estimate, 300);
  }
  form.addEventListener("input", changed);
  form.addEventListener("change", changed);
  sourceKind();
  runtime();
  estimate();
})();
