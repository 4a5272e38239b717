// A plan drawn: nodes as columns of memory (what the plan puts there, stacked, against what
// the node has), the head marked, the links between head and stages labelled with their
// measured round trip and throughput, slow ones marked. The same picture serves a preview,
// a deployment's current plan and a refusal (each node's room against what one copy needs).
const LFPlans = (() => {
  const { bytes } = LF;
  const NS = "http://www.w3.org/2000/svg";
  const PARTS = [
    ["weights_bytes", "weights", "#5b7fdb"],
    ["kv_bytes", "KV cache", "#3fa37a"],
    ["compute_bytes", "compute", "#e0a13a"],
    ["overhead_bytes", "process", "#9a7bd1"],
  ];
  const FREE = "#ffffff", OTHERS = "#c9ced8", SHORT = "#b3261e";
  const COL = 100, GAP = 80, LEFT = 36; // LEFT: room for labels wider than a column

  function svg(tag, attrs = {}, ...children) {
    const node = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    for (const c of children.flat()) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return node;
  }
  const titled = (node, text) => { node.append(svg("title", {}, text)); return node; };

  function what(s, plan) {
    if (plan.kind === "replicas") return "whole model";
    if (plan.split_mode === "tensor") return s.role === "head" ? "embeddings" : "slice of every layer";
    const n = s.layer_end - s.layer_start;
    return n ? `layers ${s.layer_start}–${s.layer_end - 1}` : "embeddings";
  }

  // nodes: [{name, memory_total_bytes, free_bytes | memory_available_bytes}]; `placed` says
  // whether the plan's memory is already in use (a current plan) or still to be taken.
  function picture(plan, nodes = [], links = [], { placed = false, height = 190 } = {}) {
    const H = height;
    const box = document.createElement("div");
    box.className = "plan-picture";
    const byName = Object.fromEntries(nodes.map((n) => [n.name, n]));
    const free = (n) => (n ? (n.free_bytes ?? n.memory_available_bytes ?? 0) : 0);
    const columns = plan.kind === "refused"
      ? nodes.map((n) => ({ node: n.name, role: "candidate", total_bytes: 0 }))
      : plan.stages;
    if (!columns.length) return box;
    const perNode = plan.kind === "refused" && plan.needed_bytes
      ? (plan.split_mode === "none" || !plan.split_mode ? plan.needed_bytes : plan.needed_bytes / Math.max(columns.length, 1))
      : 0;
    const scale = Math.max(1, ...columns.map((s) => {
      const n = byName[s.node];
      return Math.max(n ? n.memory_total_bytes : 0, free(n) + (placed ? s.total_bytes : 0), s.total_bytes, perNode);
    }));
    const px = (b) => (H * b) / scale;
    const TOP = plan.kind === "split" ? 34 + 24 * (columns.length - 1) : 24;
    const width = LEFT * 2 + columns.length * COL + (columns.length - 1) * GAP;
    const bottom = TOP + H;
    const label = plan.kind === "refused"
      ? `Refused plan: ${plan.error}`
      : `${plan.kind === "split" ? plan.split_mode + " split" : "replicas"} on ${columns.map((s) => s.node).join(", ")}`;
    const root = svg("svg", { viewBox: `0 0 ${width} ${bottom + 58}`, width, height: bottom + 58, role: "img", "aria-label": label, class: "plan-svg" });
    const x = (i) => LEFT + i * (COL + GAP);
    const head = columns.findIndex((s) => s.role === "head");

    // Links first (under the columns): from the head to each stage, over the columns.
    if (plan.kind === "split" && head >= 0) {
      columns.forEach((s, i) => {
        if (i === head) return;
        const lk = links.find((l) => (l.source === columns[head].node && l.target === s.node) || (l.source === s.node && l.target === columns[head].node));
        const x1 = x(head) + COL / 2, x2 = x(i) + COL / 2, lift = 10 + 24 * Math.abs(i - head);
        const y = TOP - lift;
        const cls = lk ? (lk.slow ? "link slow" : "link") : "link unmeasured";
        const text = lk ? `${lk.rtt_ms.toFixed(2)} ms · ${Math.round(lk.mbit_s)} Mbit/s${lk.slow ? " · slow" : ""}` : "not measured";
        root.append(titled(svg("path", { d: `M${x1},${TOP} C${x1},${y} ${x2},${y} ${x2},${TOP}`, class: cls, "data-link": `${columns[head].node}-${s.node}` }),
          `link ${columns[head].node} ↔ ${s.node}: ${text}`));
        // The curve's apex is 3/4 of the way up to its control points: the label sits above it.
        root.append(svg("text", { x: (x1 + x2) / 2, y: TOP - 0.75 * lift - 4, "text-anchor": "middle", class: `link-label${lk && lk.slow ? " slow" : ""}` }, text));
      });
    }

    columns.forEach((s, i) => {
      const n = byName[s.node];
      const g = svg("g", { class: "column", "data-node": s.node, "data-role": s.role });
      const left = x(i);
      let y = bottom;
      const part = (bytesOf, name, fill, cls = "") => {
        const h = px(bytesOf);
        if (h <= 0) return;
        y -= h;
        g.append(titled(svg("rect", { x: left, y, width: COL, height: h, fill, class: `part ${cls}`.trim(), stroke: "#7d8594", "stroke-width": 0.5 }),
          `${s.node}: ${name} ${bytes(bytesOf)}`));
      };
      if (plan.kind !== "refused") for (const [k, name, fill] of PARTS) part(s[k] || 0, name, fill, k.replace("_bytes", ""));
      const room = free(n);
      const freeLeft = plan.kind === "refused" || placed ? room : room - s.total_bytes;
      part(Math.max(freeLeft, 0), "free", FREE, "free");
      if (n && n.memory_total_bytes) {
        const others = n.memory_total_bytes - room - (placed ? s.total_bytes : 0);
        part(Math.max(others, 0), "in use by others", OTHERS, "others");
      }
      if (plan.kind !== "refused" && freeLeft < 0) {
        g.append(svg("rect", { x: left, y: bottom - px(s.total_bytes), width: COL, height: px(-freeLeft), fill: SHORT, opacity: 0.35, class: "short" }));
      }
      g.append(svg("rect", { x: left, y: bottom - px(Math.max(n ? n.memory_total_bytes : 0, s.total_bytes)), width: COL, height: px(Math.max(n ? n.memory_total_bytes : 0, s.total_bytes)), fill: "none", stroke: "#49505e" }));
      if (perNode) {
        const ly = bottom - px(perNode);
        g.append(svg("line", { x1: left - 6, x2: left + COL + 6, y1: ly, y2: ly, class: "needed" }));
        const short = perNode - room;
        g.append(svg("text", { x: left + COL / 2, y: ly - 4, "text-anchor": "middle", class: short > 0 ? "short-label" : "fits-label" },
          short > 0 ? `short ${bytes(short)}` : "fits"));
      }
      const role = s.role === "head" ? "★ head" : s.role === "candidate" ? `${bytes(room)} free` : s.role;
      g.append(svg("text", { x: left + COL / 2, y: bottom + 16, "text-anchor": "middle", class: "node-name" }, s.node));
      g.append(svg("text", { x: left + COL / 2, y: bottom + 31, "text-anchor": "middle", class: s.role === "head" ? "role head" : "role" }, role));
      if (plan.kind !== "refused") {
        g.append(svg("text", { x: left + COL / 2, y: bottom + 46, "text-anchor": "middle", class: "what" }, `${what(s, plan)} · ${bytes(s.total_bytes)}`));
      }
      root.append(g);
    });
    box.append(root);
    const legend = document.createElement("div");
    legend.className = "legend";
    const keys = plan.kind === "refused"
      ? [["free", FREE], ["in use by others", OTHERS], [perNode ? `needed (${bytes(perNode)} per node)` : "", SHORT]]
      : [...PARTS.map(([, name, fill]) => [name, fill]), ["free", FREE], ["in use by others", OTHERS]];
    for (const [name, fill] of keys) {
      if (!name) continue;
      const item = document.createElement("span");
      const swatch = document.createElement("i");
      swatch.style.background = fill;
      item.append(swatch, name);
      legend.append(item);
    }
    if (plan.kind === "split") {
      const item = document.createElement("span");
      item.className = "slow-key";
      item.textContent = "red dashed link: slow";
      legend.append(item);
    }
    box.append(legend);
    return box;
  }

  return { picture };
})();
