// The fleet dashboard: tables drawn from /ws/v1/console's snapshot, redrawn as the sections
// that changed arrive ({delta: {...}}); traffic figures come with the charts' points. Actions
// call the REST API, and their progress shows in the next changes.
(() => {
  const { el, api, bytes, bar, say, socket } = LF;
  const live = document.getElementById("live");

  function action(label, fn, cls = "") {
    return el("button", { class: "small " + cls, type: "button", onclick: async (e) => {
      e.target.disabled = true;
      try { say(await fn()); } catch (err) { say(err.message, false); } finally { e.target.disabled = false; }
    } }, label);
  }

  function fill(id, rows) {
    const body = document.querySelector(`#${id} tbody`);
    body.replaceChildren(...rows);
  }

  // The fleet as last sent, when its nodes arrived (their heartbeat ages count on from
  // there, without a message), and the deployments' latest traffic figures.
  let state = null, nodesAt = 0, traffic = {};

  function ageText(seconds) {
    if (seconds === null || seconds === undefined) return "never";
    return seconds < 60 ? `${Math.round(seconds)} s ago` : `${Math.round(seconds / 60)} min ago`;
  }

  function age(seconds) {
    const cell = el("span", { class: "age" }, ageText(seconds));
    if (seconds !== null && seconds !== undefined) cell.dataset.seconds = String(seconds);
    return cell;
  }

  setInterval(() => {
    const elapsed = (Date.now() - nodesAt) / 1000;
    for (const c of document.querySelectorAll("#nodes .age[data-seconds]")) c.textContent = ageText(Number(c.dataset.seconds) + elapsed);
  }, 1000);

  // A plan drawn (LFPlans), with the planner's words under it: its warnings, and on request
  // its reasons. A split with several copies draws each copy.
  function planView(plan, { nodes = [], links = [], placed = false, height = 190, withReasons = false } = {}) {
    if (!plan) return "";
    const box = el("div", { class: "plan", "data-plan-kind": plan.kind });
    if (plan.kind === "refused") box.append(el("div", { class: "hint error" }, `refused: ${plan.error}`));
    else box.append(el("div", { class: "hint" }, plan.kind === "split"
      ? `${plan.split_mode} split over ${plan.stages.length} nodes, ${bytes(plan.needed_bytes)} in all`
      : `replicas on ${plan.stages.map((s) => s.node).join(", ")}, ${bytes(plan.needed_bytes)} each`));
    for (const [i, p] of [plan, ...(plan.copies || [])].entries()) {
      if (plan.copies && plan.copies.length) box.append(el("div", { class: "hint" }, `copy ${i + 1}`));
      box.append(LFPlans.picture(p, nodes, links, { placed, height }));
    }
    for (const w of plan.warnings || []) box.append(el("div", { class: "hint warning" }, w));
    if (withReasons) box.append(el("ul", { class: "reasons" }, (plan.reasons || []).map((r) => el("li", {}, r))));
    return box;
  }

  // A node's memory, stacked: what each deployment's engines hold (their colours on the
  // charts), what else is in use, and what is free.
  function memoryBar(n, deploymentOf) {
    const total = n.memory_total_bytes || 0;
    const held = {};
    for (const r of n.reported_replicas || []) {
      const name = deploymentOf[r.replica_id] || r.model_name;
      held[name] = (held[name] || 0) + (r.memory_bytes || 0);
    }
    const used = total - n.memory_available_bytes;
    const others = Math.max(used - Object.values(held).reduce((a, b) => a + b, 0), 0);
    const pct = (b) => (total ? (100 * b) / total : 0);
    const parts = Object.entries(held).map(([name, b]) => el("span", {
      class: "part", style: `width:${pct(b)}%;background:${LFCharts.colour(name)}`, "data-deployment": name,
      title: `${name}: ${bytes(b)}` }));
    parts.push(el("span", { class: "part others", style: `width:${pct(others)}%`, title: `other processes: ${bytes(others)}` }));
    return el("div", { class: "memory" },
      el("div", { class: "stacked", role: "img", "aria-label": `${n.name}: ${bytes(used)} of ${bytes(total)} in use` }, parts),
      el("div", { class: "hint" }, [...Object.entries(held).map(([name, b]) => `${name} ${bytes(b)}`), `other ${bytes(others)}`, `free ${bytes(n.memory_available_bytes)}`].join(" · ")));
  }

  // Each model, then the variants made from it (indented), so a family reads together.
  function familyOrder(models) {
    const byName = Object.fromEntries(models.map((m) => [m.name, m]));
    const out = [];
    const visit = (m, depth) => {
      out.push([m, depth]);
      for (const v of m.variants || []) if (byName[v]) visit(byName[v], depth + 1);
    };
    models.filter((m) => !m.parent || !byName[m.parent]).forEach((m) => visit(m, 0));
    return out;
  }

  const QUANTIZABLE = ["ALL_F32", "F16", "BF16", "Q8_0"];
  const signed = (x, digits) => (x > 0 ? "+" : "") + x.toFixed(digits);

  function modelRow(m, depth, snap) {
    const pull = m.latest_pull;
    const job = (snap.quantizations || []).find((q) => q.source === m.name && q.state !== "done");
    let progress = pull && pull.state === "running"
      ? bar(pull.bytes_done, pull.bytes_total, `${pull.phase} ${Math.round(100 * (pull.progress || 0))} %`)
      : pull ? `${pull.state}${pull.error ? ": " + pull.error : ""}` : "";
    if (job) {
      progress = job.state === "failed"
        ? el("div", { class: "hint error" }, `quantizing to ${job.target} failed: ${job.error}`)
        : bar(job.done, job.total, `${job.phase || "waiting for a node"} ${job.total ? Math.round(100 * (job.progress || 0)) + " %" : ""}`);
    }
    const e = m.evaluation || {};
    const quality = e.nll_change !== undefined
      ? el("span", { class: "quality", title: `mean NLL ${e.mean_nll} (source ${e.parent_mean_nll}) over ${e.tokens} tokens of ${e.text}; perplexity ${e.perplexity} (source ${e.parent_perplexity})` },
        `NLL ${signed(e.nll_change, 3)}`, el("div", { class: "hint" }, `ppl ${e.perplexity} vs ${e.parent_perplexity}`))
      : depth ? "–" : "source";
    const speed = e.decode_tokens_per_second
      ? el("span", {}, `${e.decode_tokens_per_second} tok/s`, el("div", { class: "hint" }, `source ${e.parent_decode_tokens_per_second} on ${e.node}`))
      : "–";
    const files = m.files || [];
    const target = el("select", { class: "target", "aria-label": `quantize ${m.name} to` },
      ["Q4_K_M", "Q5_K_M", "Q8_0", "Q4_0"].map((t) => el("option", { value: t }, t)));
    const quantize = m.state === "ready" && QUANTIZABLE.includes(m.quantization)
      ? el("span", { class: "quantize" }, target, action("Quantize", () => api("POST", `/api/v1/models/${encodeURIComponent(m.name)}/quantize/`, { target: target.value })
        .then((j) => `Making ${j.name} from ${m.name} (job ${j.id}); progress shows in the table`)))
      : "";
    return el("tr", { "data-model": m.name, "data-depth": String(depth), class: depth ? "variant" : "" },
      el("td", { style: `padding-left:${0.5 + 1.5 * depth}em` }, depth ? "↳ " : "", m.name,
        el("div", { class: "hint" }, [m.display_name || "", m.parent ? `made from ${m.parent}` : "", files.length > 1 ? `${files.length} files (split GGUF)` : "", m.revision ? `@${m.revision.slice(0, 12)}` : ""].filter(Boolean).join(" · "))),
      el("td", { class: "state " + m.state }, m.state),
      el("td", {}, m.architecture || "–"),
      el("td", {}, m.parameters ? `${(m.parameters / 1e6).toFixed(0)} M` : "–"),
      el("td", { class: "quant" }, m.quantization || "–"),
      el("td", {}, bytes(m.size_bytes)),
      el("td", {}, quality),
      el("td", {}, speed),
      el("td", { class: "used-by" }, (m.deployments || []).join(", ") || "–"),
      el("td", {}, String(m.n_layers || "–")),
      el("td", {}, String(m.context_length || "–")),
      el("td", {}, progress),
      el("td", {}, quantize, action("Delete", () => api("DELETE", `/api/v1/models/${encodeURIComponent(m.name)}/`).then(() => `${m.name} deleted`), "danger")),
    );
  }

  function render(snap) {
    const deploymentOf = {};
    for (const d of snap.deployments) for (const r of d.replica_set) deploymentOf[r.id] = d.name;
    fill("nodes", snap.nodes.map((n) => el("tr", { "data-node": n.name },
      el("td", {}, n.name, el("div", { class: "hint" }, n.address)),
      el("td", { class: "state " + n.state }, n.draining ? `${n.state}, draining` : n.state),
      el("td", {}, age(n.heartbeat_age_seconds)),
      el("td", {}, memoryBar(n, deploymentOf)),
      el("td", {}, bar(n.load_average, n.cpu_cores, `load ${n.load_average.toFixed(2)} of ${n.cpu_cores} cores`),
        n.accelerators.length ? el("div", { class: "hint" }, n.accelerators.join(", ")) : ""),
      el("td", {}, String(n.in_flight)),
      el("td", {}, n.reported_replicas.map((r) => el("div", {}, `${r.model_name}: ${r.state}, ${bytes(r.memory_bytes)}, ${r.in_flight} in flight`)),
        (n.rpc_servers || []).map((r) => el("div", { class: r.running ? "hint" : "hint error" }, `rpc server ${r.endpoint}: ${r.running ? "running" : r.error || "stopped"}`))),
      el("td", {}, n.draining
        ? action("Undrain", () => api("POST", `/api/v1/nodes/${encodeURIComponent(n.name)}/undrain/`).then(() => `${n.name} takes work again`))
        : action("Drain", () => api("POST", `/api/v1/nodes/${encodeURIComponent(n.name)}/drain/`).then(() => `${n.name} is draining: no new work, running requests finish`)),
        action("Remove", () => api("DELETE", `/api/v1/nodes/${encodeURIComponent(n.name)}/`).then(() => `${n.name} removed`), "danger")),
    )));

    const select = document.getElementById("deploy-model");
    const chosen = select.value;
    select.replaceChildren(...snap.models.filter((m) => m.state === "ready").map((m) => el("option", { value: m.name }, m.name)));
    if (chosen) select.value = chosen;
    fill("models", familyOrder(snap.models).map(([m, depth]) => modelRow(m, depth, snap)));

    fill("deployments", snap.deployments.map((d) => {
      const f = traffic[d.name];
      const figures = f ? `${f.requests} req, ${f.tokens_per_s ? f.tokens_per_s.toFixed(1) : "–"} tok/s, first token ${f.ttft_ms ? Math.round(f.ttft_ms) : "–"} ms` : "no traffic";
      const scale = el("input", { type: "number", min: "1", max: "64", value: String(d.replicas), class: "tiny", "aria-label": `replicas of ${d.name}` });
      return el("tr", { "data-deployment": d.name },
        el("td", {}, d.name, d.error ? el("div", { class: "hint error" }, d.error) : "", planView(d.plan, { nodes: snap.nodes, links: snap.links || [], placed: true, height: 110 })),
        el("td", {}, d.model, d.quantization ? el("div", { class: "hint" }, d.plan && d.plan.kind === "split" ? `${d.quantization} on every stage` : d.quantization) : ""),
        el("td", { class: "state " + d.state }, d.state.replace("_", " "),
          d.restarts ? el("div", { class: "hint" }, `${d.restarts} restart(s)${d.next_restart_at ? ", next " + new Date(d.next_restart_at).toLocaleTimeString() : ""}`) : ""),
        el("td", {}, d.replica_set.map((r) => el("div", {}, `${r.node || "?"}: ${r.state}`)), scale,
          action("Scale", () => api("POST", `/api/v1/deployments/${encodeURIComponent(d.name)}/scale/`, { replicas: Number(scale.value) }).then(() => `${d.name}: scaling to ${scale.value}`))),
        el("td", {}, `${d.parallel} × ${d.context_length}`),
        el("td", {}, `${d.routing_policy}, ${d.batching}`),
        el("td", {}, figures),
        el("td", {}, action("Undeploy", () => api("POST", `/api/v1/deployments/${encodeURIComponent(d.name)}/undeploy/`).then(() => `${d.name}: undeploying`), "danger")),
      );
    }));
  }

  function connect() {
    const ws = socket("/ws/v1/console");
    ws.onopen = () => { live.textContent = "Live"; live.dataset.state = "live"; };
    ws.onmessage = (e) => {
      const data = JSON.parse(e.data);
      if (data.series) {
        LFCharts.receive(data);
        const last = data.series[data.series.length - 1];
        if (last && last.figures) { traffic = last.figures; if (state) render(state); }
        return;
      }
      state = data.delta ? { ...state, ...data.delta } : data;
      if (!data.delta || data.delta.nodes) nodesAt = Date.now();
      render(state); live.textContent = `Live · updated ${new Date().toLocaleTimeString()}`; document.body.dataset.snapshots = String(Number(document.body.dataset.snapshots || 0) + 1); };
    ws.onclose = () => { live.textContent = "Disconnected; reconnecting…"; live.dataset.state = "down"; setTimeout(connect, 2000); };
  }

  // A day's hourly tokens as a small line (an SVG polyline: no chart per row).
  function sparkline(values, label) {
    const NS = "http://www.w3.org/2000/svg";
    const w = 120, h = 24, top = Math.max(1, ...values);
    const pts = values.map((v, i) => `${((i * w) / Math.max(values.length - 1, 1)).toFixed(1)},${(h - 2 - ((h - 4) * v) / top).toFixed(1)}`).join(" ");
    const svg = document.createElementNS(NS, "svg");
    for (const [k, v] of Object.entries({ viewBox: `0 0 ${w} ${h}`, width: w, height: h, class: "sparkline", role: "img", "aria-label": label })) svg.setAttribute(k, v);
    const line = document.createElementNS(NS, "polyline");
    line.setAttribute("points", pts);
    svg.append(line);
    return svg;
  }

  const number = (n) => (n >= 1e6 ? `${(n / 1e6).toFixed(1)} M` : n >= 1e3 ? `${(n / 1e3).toFixed(1)} k` : String(n));
  const limits = (k) => [k.requests_per_minute && `${k.requests_per_minute} req/min`, k.tokens_per_day && `${number(k.tokens_per_day)} tok/day`,
    k.tokens_per_month && `${number(k.tokens_per_month)} tok/month`].filter(Boolean).join(", ") || "none";

  // Every application's keys, grouped by application, with limits and a day of usage.
  async function keys() {
    const [data, usage] = await Promise.all([api("GET", "/api/v1/api-keys/?limit=1000"), api("GET", "/api/v1/usage/by-key/?hours=24")]);
    const used = Object.fromEntries(usage.keys.map((u) => [u.api_key, u]));
    const live = data.results.filter((k) => !k.revoked_at);
    live.sort((a, b) => a.owner.localeCompare(b.owner) || a.name.localeCompare(b.name));
    fill("keys", live.map((k, i) => {
      const u = used[k.id] || { tokens: usage.hours.map(() => 0), total_tokens: 0, total_requests: 0 };
      const first = i === 0 || live[i - 1].owner !== k.owner;
      return el("tr", { "data-key": k.name, "data-owner": k.owner, class: first ? "group-start" : "" },
        el("th", { scope: "row" }, first ? k.owner : ""), el("td", {}, k.name), el("td", {}, k.app || ""), el("td", {}, k.prefix + "…"),
        el("td", { class: "limits" }, limits(k)),
        el("td", { class: "usage" }, sparkline(u.tokens, `${k.name}: tokens per hour over the last day`),
          el("div", { class: "hint" }, `${number(u.total_tokens)} tokens, ${u.total_requests} requests`)),
        el("td", {}, k.last_used_at ? k.last_used_at.slice(0, 16).replace("T", " ") : "never"),
        el("td", {}, action("Revoke", () => api("DELETE", `/api/v1/api-keys/${k.id}/`).then(() => { keys(); return `${k.name} revoked`; }), "danger")),
      );
    }).concat(usage.keys.filter((u) => u.api_key === null).map((u) => el("tr", { "data-key": "", class: "group-start" },
      el("th", { scope: "row" }, u.owner || "–"), el("td", { class: "hint" }, "console, no key"), el("td", {}, ""), el("td", {}, ""), el("td", {}, "–"),
      el("td", { class: "usage" }, sparkline(u.tokens, `${u.owner}: console tokens per hour over the last day`),
        el("div", { class: "hint" }, `${number(u.total_tokens)} tokens, ${u.total_requests} requests`)),
      el("td", {}, ""), el("td", {}, ""),
    ))));
  }

  function form(id, submit) {
    document.getElementById(id).addEventListener("submit", async (e) => {
      e.preventDefault();
      const values = Object.fromEntries([...new FormData(e.target).entries()].filter(([, v]) => v !== ""));
      try { say(await submit(values)); e.target.reset(); } catch (err) { say(err.message, false); }
    });
  }

  form("pull-form", (v) => api("POST", "/api/v1/models/pull/", v).then((job) => `Pulling ${job.model} (job ${job.id}); progress shows in the table`));
  document.getElementById("pull-form").addEventListener("input", (e) => {
    // A known name, a Hugging Face name or a file: the name is needed unless the source gives one.
    const f = e.currentTarget;
    f.elements.name.required = !f.elements.source.value;
  });
  function deployValues(v) {
    for (const k of ["replicas", "context_length", "parallel"]) if (v[k]) v[k] = Number(v[k]);
    if (v.pin_nodes) v.pin_nodes = v.pin_nodes.split(",").map((x) => x.trim()).filter(Boolean);
    return v;
  }
  form("deploy-form", (v) => api("POST", "/api/v1/deployments/", deployValues(v)).then((d) => `Deploying ${d.name}; its replicas show in the table`));
  document.getElementById("preview-plan").addEventListener("click", async () => {
    const f = document.getElementById("deploy-form");
    const v = deployValues(Object.fromEntries([...new FormData(f).entries()].filter(([, x]) => x !== "")));
    const out = document.getElementById("plan-preview");
    try {
      const plan = await api("POST", "/api/v1/deployments/plan/", v);
      out.replaceChildren(el("h3", {}, "Plan preview (nothing deployed)"),
        planView(plan, { nodes: plan.nodes, links: plan.links, withReasons: true }));
      out.hidden = false;
    } catch (err) { say(err.message, false); }
  });
  form("key-form", (v) => api("POST", "/api/v1/api-keys/", v).then((k) => {
    const box = document.getElementById("new-key");
    box.hidden = false;
    box.textContent = `Key "${k.name}": ${k.key} (shown once; copy it now)`;
    keys();
    return `Key ${k.name} created`;
  }));
  connect();
  keys();
})();
