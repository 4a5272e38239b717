// The playground: conversations kept in this browser, answers streamed over /ws/v1/generate
// (the session authenticates it) and shown as sanitized markdown (LFMarkdown). A conversation
// may compare two deployments: every question goes to both, each answering from its own side
// of the history.
(() => {
  const { el, api, say, socket } = LF;
  const $ = (id) => document.getElementById(id);
  const STORE = "llamafleet.playground.v1";
  const SETTINGS = ["model", "compare", "system", "temperature", "top_p", "max_tokens", "schema"];
  let state = { conversations: [], current: 0, settings: {} };
  const running = new Map(); // socket id -> {message, node}
  let ws = null;
  let seq = 0;

  const current = () => state.conversations[state.current];

  function save() {
    for (const id of SETTINGS) state.settings[id] = $(id).value;
    try { localStorage.setItem(STORE, JSON.stringify(state)); } catch (err) { say(`Not saved in this browser: ${err.message}`, false); }
  }

  function load() {
    try {
      const saved = JSON.parse(localStorage.getItem(STORE) || "null");
      if (saved && Array.isArray(saved.conversations) && saved.conversations.length) state = saved;
    } catch (err) { /* unreadable: start afresh */ }
    for (const c of state.conversations) for (const m of c.messages) {
      if (m.role === "assistant" && m.pending) { m.pending = false; m.stats = "interrupted (the page was closed)"; }
    }
    if (!state.conversations.length) state.conversations.push(fresh());
    state.current = Math.min(state.current || 0, state.conversations.length - 1);
    for (const id of SETTINGS) if (state.settings && state.settings[id] !== undefined && id !== "model" && id !== "compare") $(id).value = state.settings[id];
  }

  function fresh() { return { title: "", messages: [] }; }

  function connect() {
    ws = socket("/ws/v1/generate");
    ws.onmessage = (e) => handle(JSON.parse(e.data));
    ws.onclose = () => { for (const id of [...running.keys()]) finish(id, "the connection closed"); setTimeout(connect, 2000); };
  }

  // ---- drawing ----

  function show() {
    $("conversations").replaceChildren(...state.conversations.map((c, i) => el("li", {},
      el("a", { href: "#", "aria-current": i === state.current ? "page" : "false", onclick: (e) => { e.preventDefault(); if (!running.size) { state.current = i; save(); show(); } } },
        c.title || `Conversation ${i + 1}`),
      el("button", { type: "button", class: "small", "aria-label": `delete ${c.title || "conversation " + (i + 1)}`, title: "Delete", onclick: () => remove(i) }, "×"))));
    const out = [];
    const msgs = current().messages;
    for (let i = 0; i < msgs.length; i++) {
      const m = msgs[i];
      if (m.role === "assistant" && msgs[i + 1] && msgs[i + 1].role === "assistant") {
        out.push(el("div", { class: "compare" }, bubble(m, i), bubble(msgs[i + 1], i + 1)));
        i++;
      } else out.push(bubble(m, i));
    }
    $("messages").replaceChildren(...out);
  }

  function bubble(m, i) {
    const text = el("div", { class: "text" });
    if (m.role === "assistant") LFMarkdown.render(text, m.content);
    else text.textContent = m.content;
    const node = el("div", { class: `bubble ${m.role}`, "data-index": String(i) });
    if (m.role === "assistant" && m.model) node.append(el("div", { class: "model" }, m.model));
    node.append(text);
    if (m.stats) node.append(el("div", { class: "stats" }, m.stats));
    const last = i >= current().messages.length - 2;
    if (!current().messages.some((x) => x.pending)) { // no editing while an answer streams
      const tools = el("div", { class: "tools" });
      if (m.role === "user") tools.append(el("button", { type: "button", class: "edit", onclick: () => edit(i) }, "Edit"));
      if (m.role === "assistant" && last) tools.append(el("button", { type: "button", class: "regenerate", onclick: regenerate }, "Regenerate"));
      if (tools.childNodes.length) node.append(tools);
    }
    return node;
  }

  // ---- talking to the models ----

  // The history one side of the conversation sees: the questions, and its own answers.
  function history(side) {
    const out = [];
    for (const m of current().messages) {
      if (m.pending) continue;
      if (m.role === "user") out.push({ role: "user", content: m.content });
      else if (m.role === "assistant" && (m.side || 0) === side && m.content) out.push({ role: "assistant", content: m.content });
    }
    return out;
  }

  function ask() {
    if (running.size || !ws || ws.readyState !== WebSocket.OPEN) return;
    const models = [$("model").value, $("compare").value].filter(Boolean);
    if (!models[0]) { say("No model is deployed yet: deploy one from the Fleet page.", false); return; }
    let format;
    const schemaText = $("schema").value.trim();
    if (schemaText) {
      try { format = { type: "json_schema", json_schema: { name: "answer", schema: JSON.parse(schemaText) } }; }
      catch (err) { say(`The JSON schema is not JSON: ${err.message}`, false); return; }
    }
    const system = $("system").value.trim();
    const sends = models.map((model, side) => {
      const h = history(side);
      const message = { role: "assistant", content: "", model, side, pending: true };
      current().messages.push(message);
      return { model, message, messages: system ? [{ role: "system", content: system }, ...h] : h };
    });
    show();
    const bubbles = $("messages").querySelectorAll(".bubble.assistant");
    sends.forEach((s, k) => {
      const id = `p${++seq}`;
      running.set(id, { message: s.message, node: bubbles[bubbles.length - sends.length + k], started: performance.now() });
      ws.send(JSON.stringify({
        type: "generate", id, model: s.model, messages: s.messages,
        temperature: Number($("temperature").value), top_p: Number($("top_p").value),
        max_tokens: Number($("max_tokens").value), ...(format ? { response_format: format } : {}),
      }));
    });
    $("send").disabled = true;
    $("stop").disabled = false;
    save();
  }

  function handle(msg) {
    const run = running.get(msg.id);
    if (!run) return;
    const answer = run.message;
    if (msg.type === "start") {
      run.where = `${msg.node} · replica ${msg.replica.slice(0, 8)}`;
    } else if (msg.type === "token") {
      answer.content += msg.text;
      if (!run.drawing) { // at most one markdown pass per frame
        run.drawing = true;
        requestAnimationFrame(() => { run.drawing = false; LFMarkdown.render(run.node.querySelector(".text"), answer.content); });
      }
    } else if (msg.type === "done") {
      const t = msg.timings || {};
      const u = msg.usage || {};
      const n = u.completion_tokens || 0;
      const tps = t.decode_seconds > 0 && n > 1 ? ((n - 1) / t.decode_seconds).toFixed(1) : "–";
      const ttft = t.time_to_first_token !== undefined && t.time_to_first_token !== null ? Math.round(t.time_to_first_token * 1000) : "–";
      answer.stats = msg.finish_reason === "cancelled"
        ? `stopped · ${run.where || ""}`
        : `${n} tokens · first token ${ttft} ms · ${tps} tokens/s · ${u.cached_tokens || 0} of ${u.prompt_tokens || 0} prompt tokens cached · ${run.where || ""}${msg.migrations ? ` · moved ${msg.migrations}×` : ""}`;
      finish(msg.id);
    } else if (msg.type === "error") {
      answer.stats = `error: ${msg.error.message}`;
      finish(msg.id);
    }
  }

  function finish(id, reason) {
    const run = running.get(id);
    if (!run) return;
    if (reason) run.message.stats = reason;
    run.message.pending = false;
    running.delete(id);
    if (!running.size) {
      $("send").disabled = false;
      $("stop").disabled = true;
      show();
      save();
    }
  }

  // ---- editing ----

  function regenerate() {
    const msgs = current().messages;
    while (msgs.length && msgs[msgs.length - 1].role === "assistant") msgs.pop();
    ask();
  }

  function edit(i) {
    const msgs = current().messages;
    $("prompt").value = msgs[i].content;
    msgs.splice(i); // the question and everything after it: sent again once edited
    save();
    show();
    $("prompt").focus();
  }

  function remove(i) {
    if (running.size) return;
    state.conversations.splice(i, 1);
    if (!state.conversations.length) state.conversations.push(fresh());
    state.current = Math.min(state.current, state.conversations.length - 1);
    save();
    show();
  }

  function send() {
    const text = $("prompt").value.trim();
    if (!text || running.size || !ws || ws.readyState !== WebSocket.OPEN) return;
    if (!current().title) current().title = text.slice(0, 40);
    current().messages.push({ role: "user", content: text });
    $("prompt").value = "";
    ask();
  }

  $("ask").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  $("stop").addEventListener("click", () => { for (const id of running.keys()) ws.send(JSON.stringify({ type: "cancel", id })); });
  $("new-conversation").addEventListener("click", () => {
    if (running.size) return;
    state.conversations.push(fresh());
    state.current = state.conversations.length - 1;
    save();
    show();
  });
  for (const id of SETTINGS) $(id).addEventListener("change", save);

  load();
  show();
  api("GET", "/v1/models").then((data) => {
    const names = data.data.map((m) => m.id);
    $("model").replaceChildren(...names.map((n) => el("option", { value: n }, n)));
    $("compare").replaceChildren(el("option", { value: "" }, "nothing (one answer)"), ...names.map((n) => el("option", { value: n }, n)));
    for (const id of ["model", "compare"]) if (names.includes(state.settings[id])) $(id).value = state.settings[id];
    if (!names.length) say("No model is deployed yet: deploy one from the Fleet page.", false);
  }).catch((err) => say(err.message, false));
  connect();
})();
