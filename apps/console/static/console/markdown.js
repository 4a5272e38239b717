// Model output as markdown, safely: marked renders it with raw HTML shown as text (a model's
// "<script>" is words on the screen), DOMPurify then removes anything active that is left,
// and images are never loaded (a model could name a URL that leaks the conversation).
const LFMarkdown = (() => {
  const escape = (s) => s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  const md = new marked.Marked({ gfm: true, breaks: true });
  md.use({ renderer: { html: (token) => escape(token.text), image: (token) => escape(token.text || token.href || "") } });
  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A") { node.setAttribute("target", "_blank"); node.setAttribute("rel", "noopener noreferrer nofollow"); }
  });
  const POLICY = { FORBID_TAGS: ["img", "style", "form", "input", "button", "iframe", "svg", "math", "video", "audio"], FORBID_ATTR: ["style"] };

  function copyButton(pre) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "copy";
    button.textContent = "Copy";
    button.addEventListener("click", async () => {
      const text = pre.querySelector("code") ? pre.querySelector("code").textContent : pre.textContent;
      try { await navigator.clipboard.writeText(text); } catch (err) {
        const range = document.createRange(); // without a secure context: select and copy
        range.selectNodeContents(pre.querySelector("code") || pre);
        getSelection().removeAllRanges(); getSelection().addRange(range);
        document.execCommand("copy");
      }
      button.textContent = "Copied";
      setTimeout(() => { button.textContent = "Copy"; }, 1500);
    });
    pre.prepend(button);
  }

  // Render `text` into `node` (its children are replaced).
  function render(node, text) {
    node.innerHTML = DOMPurify.sanitize(md.parse(text || ""), POLICY);
    node.querySelectorAll("pre").forEach(copyButton);
  }

  return { render };
})();
