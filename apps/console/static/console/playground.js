// The playground: conversations kept in this page, answers streamed over /ws/v1/generate
// (the session authenticates it). Model output is text, never HTML.
(() => {
  const { el, api, say, socket } = LF;
  const $ = (id) => document.getElementById(id);
  const conversations = [];
  let current = null;
  let running = null; // {id, bubble, started, first, tokens}
  let ws = null;
  let seq = 0;

  function connect() {
    ws = socket("/ws/v1/generate");
    ws.onmessage = (e) => handle(JSON.parse(e.data));
    ws.onclose = () => { if (running) finish("the connection closed"); setTimeout(connect, 2000); };
  }

  function show() {
    $("conversations").replaceChildren(...conversations.map((c, i) => el("li", {},
      el("a", { href: "#", "aria-current": c === current ? "page" : "false", onclick: (e) => { e.preventDefault(); current = c; show(); } },
        c.title || `Conversation ${i + 1}`))));
    $("messages").replaceChildren(...current.messages.map((m) => bubble(m)));
  }

  function bubble(m) {
    const node = el("div", { class: `bubble ${m.role}` }, el("div", { class: "text" }, m.content));
    if (m.stats) node.append(el("div", { class: "stats" }, m.stats));
    return node;
  }

  function newConversation() {
    current = { messages: [], title: "" };
    conversations.push(current);
    show();
  }

  function handle(msg) {
    if (!running || msg.id !== running.id) return;
    const answer = running.message;
    if (msg.type === "start") {
      running.where = `${msg.node} · replica ${msg.replica.slice(0, 8)}`;
    } else if (msg.type === "token") {
      running.first = running.first || performance.now();
      answer.content += msg.text;
      running.node.querySelector(".text").textContent = answer.content;
    } else if (msg.type === "done") {
      const t = msg.timings || {};
      const n = (msg.usage || {}).completion_tokens || 0;
      const tps = t.decode_seconds > 0 && n > 1 ? ((n - 1) / t.decode_seconds).toFixed(1) : "–";
      const ttft = t.time_to_first_token !== undefined ? Math.round(t.time_to_first_token * 1000) : "–";
      answer.stats = msg.finish_reason === "cancelled"
        ? `stopped · ${running.where || ""}`
        : `${n} tokens · first token ${ttft} ms · ${tps} tokens/s · ${running.where || ""}${msg.migrations ? ` · moved ${msg.migrations}×` : ""}`;
      finish();
    } else if (msg.type === "error") {
      answer.stats = `error: ${msg.error.message}`;
      finish();
    }
  }

  function finish(reason) {
    if (reason) running.message.stats = reason;
    running.node.replaceWith(bubble(running.message));
    running = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }

  $("ask").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || running || !ws || ws.readyState !== WebSocket.OPEN) return;
    if (!current.title) current.title = text.slice(0, 40);
    current.messages.push({ role: "user", content: text });
    const system = $("system").value.trim();
    const history = current.messages.map(({ role, content }) => ({ role, content }));
    const message = { role: "assistant", content: "" };
    current.messages.push(message);
    show();
    const node = $("messages").lastChild;
    running = { id: `p${++seq}`, message, node };
    ws.send(JSON.stringify({
      type: "generate", id: running.id, model: $("model").value,
      messages: system ? [{ role: "system", content: system }, ...history] : history,
      temperature: Number($("temperature").value), top_p: Number($("top_p").value),
      max_tokens: Number($("max_tokens").value),
    }));
    $("prompt").value = "";
    $("send").disabled = true;
    $("stop").disabled = false;
  });
  $("stop").addEventListener("click", () => { if (running) ws.send(JSON.stringify({ type: "cancel", id: running.id })); });
  $("new-conversation").addEventListener("click", newConversation);

  api("GET", "/v1/models").then((data) => {
    $("model").replaceChildren(...data.data.map((m) => el("option", { value: m.id }, m.id)));
    if (!data.data.length) say("No model is deployed yet: deploy one from the Fleet page.", false);
  }).catch((err) => say(err.message, false));
  newConversation();
  connect();
})();
