// Markdown to safe HTML: marked parses, DOMPurify removes anything active (scripts, event
// handlers, javascript: links, style attributes the CSP would refuse), highlight.js colours
// code blocks. Only the message being streamed is rendered again as tokens arrive.
import { marked } from "./vendor/marked.esm.js";
import DOMPurify from "./vendor/purify.es.mjs";
import hljs from "./vendor/highlight.min.js";

const options = { gfm: true, breaks: true, async: false };

export function renderMarkdown(element, text) {
  element.innerHTML = DOMPurify.sanitize(marked.parse(text, options), { FORBID_ATTR: ["style"] });
  for (const link of element.querySelectorAll("a[href]")) {
    link.target = "_blank";
    link.rel = "noopener noreferrer";
  }
  for (const block of element.querySelectorAll("pre code")) hljs.highlightElement(block);
}
