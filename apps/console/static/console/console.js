// Small helpers shared by the console's pages. Text always goes in through textContent.
const LF = (() => {
  const cookie = (name) => (document.cookie.split("; ").find((c) => c.startsWith(name + "=")) || "").split("=")[1] || "";

  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k === "class") node.className = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v);
    }
    for (const c of children.flat()) node.append(c instanceof Node ? c : document.createTextNode(c ?? ""));
    return node;
  }

  // The REST API with the session and its CSRF token; rejects with the API's own message.
  async function api(method, path, body) {
    const resp = await fetch(path, {
      method,
      headers: { "Content-Type": "application/json", "X-CSRFToken": cookie("csrftoken") },
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    const text = await resp.text();
    const data = text ? JSON.parse(text) : null;
    if (!resp.ok) {
      const msg = data && (data.detail || (data.error && data.error.message) || JSON.stringify(data));
      throw new Error(`${resp.status}: ${msg}`);
    }
    return data;
  }

  function bytes(n) {
    if (!n) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
  }

  function bar(used, total, label) {
    const pct = total ? Math.min(100, Math.round((100 * used) / total)) : 0;
    return el("div", { class: "bar", title: label || `${pct} %` }, el("span", { style: `width:${pct}%` }), el("em", {}, label || `${pct} %`));
  }

  function say(text, ok = true) {
    const box = document.getElementById("result");
    if (!box) return;
    box.hidden = false;
    box.className = "message " + (ok ? "success" : "error");
    box.textContent = text;
  }

  function socket(path) {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    return new WebSocket(`${scheme}://${location.host}${path}`);
  }

  return { el, api, bytes, bar, say, socket };
})();
