// Shows a node's report on the node itself after it runs.
//
// Applies to every node of this pack that returns {"ui": {"text": [short], "report": [full]}}
// (the loaders and quantizers' reports, Set Attention Backend's choice):
// ComfyUI calls onExecuted with that dict, and the short report (1-3 lines) is rendered read-only below the
// node's widgets: the first line as a headline, "key: value" lines with the key dimmed; the full report
// follows, collapsed, where a line ending in ":" followed by indented lines is a collapsible list.
// What is known only after a run (the attention kernels a sampling used) comes
// later as a "bigdit.report" server event {node, text} and replaces the short report.
import { app } from "../../../scripts/app.js"; // served as /extensions/<pack>/js/…
import { api } from "../../../scripts/api.js";

const WIDGET_NAME = "bigdit_report";
const OPEN_LIST_MAX_LINES = 12; // longer lists start collapsed
const MAX_HEIGHT_PX = 420; // taller reports scroll inside the node
const LINE_HEIGHT_PX = 17;
const MIN_WIDTH_PX = 420;

// ComfyUI serves this file from /extensions/<pack folder>/js/, and names the
// pack's nodes' module "custom_nodes.<pack folder>": the folder name differs
// between a git clone and a Manager install, so read it from our own URL.
const PACK_FOLDER = decodeURIComponent(new URL(import.meta.url).pathname.split("/")[2] ?? "");

const STYLE = `
.bigdit-report {
  box-sizing: border-box; width: 100%; height: 100%; overflow: auto; padding: 6px 8px;
  font: 12px/${LINE_HEIGHT_PX}px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace;
  color: var(--input-text, #ddd); background: var(--comfy-input-bg, #222);
  border: 1px solid var(--border-color, #444); border-radius: 6px; white-space: pre-wrap; user-select: text;
}
.bigdit-report .bigdit-headline { font-weight: bold; font-size: 13px; margin-bottom: 2px; }
.bigdit-report .bigdit-key { color: var(--descrip-text, #999); }
.bigdit-report .bigdit-saved { color: #7fd37f; font-weight: bold; }
.bigdit-report details > summary { cursor: pointer; }
.bigdit-report details > div { padding-left: 12px; color: var(--descrip-text, #aaa); }
.bigdit-report details.bigdit-full { margin-top: 4px; }
.bigdit-report details.bigdit-full > summary { color: var(--descrip-text, #999); }
`;

function installStyle() {
  if (document.getElementById("bigdit-report-style")) return;
  const style = document.createElement("style");
  style.id = "bigdit-report-style";
  style.textContent = STYLE;
  document.head.appendChild(style);
}

function isPackNode(nodeData) {
  // Only nodes that return {"ui": {"text": [...]}} ever get a report to show.
  const [root, folder] = (nodeData.python_module ?? "").split(".");
  return root === "custom_nodes" && folder === PACK_FOLDER;
}

function keyValueLine(line) {
  const row = document.createElement("div");
  const colon = line.indexOf(": ");
  if (colon <= 0) {
    row.textContent = line;
    return row;
  }
  const key = document.createElement("span");
  key.className = "bigdit-key";
  key.textContent = line.slice(0, colon + 1);
  row.append(key, " ");
  // "weights: 40 GiB -> 21 GiB (saved 19 GiB)": make the saving stand out
  const value = line.slice(colon + 2);
  const saved = value.match(/^(.*)(saved [^)]*)(.*)$/);
  if (saved) {
    const strong = document.createElement("span");
    strong.className = "bigdit-saved";
    strong.textContent = saved[2];
    row.append(saved[1], strong, saved[3]);
  } else {
    row.append(value);
  }
  return row;
}

function renderReport(container, text) {
  container.replaceChildren();
  const lines = text.replace(/\s+$/, "").split("\n");
  const headline = document.createElement("div");
  headline.className = "bigdit-headline";
  headline.textContent = lines[0] ?? "";
  container.append(headline);
  for (let i = 1; i < lines.length; i++) {
    const line = lines[i];
    const children = [];
    while (line.endsWith(":") && i + 1 < lines.length && /^\s/.test(lines[i + 1])) {
      children.push(lines[++i].trim());
    }
    if (!children.length) {
      container.append(keyValueLine(line));
      continue;
    }
    const list = document.createElement("details");
    list.open = children.length <= OPEN_LIST_MAX_LINES;
    const summary = document.createElement("summary");
    summary.textContent = line;
    const body = document.createElement("div");
    body.textContent = children.join("\n");
    list.append(summary, body);
    container.append(list);
  }
  return lines.length;
}

function fitNode(node) {
  const [minWidth, minHeight] = node.computeSize();
  node.setSize([Math.max(node.size[0], minWidth, MIN_WIDTH_PX), Math.max(node.size[1], minHeight)]);
  node.setDirtyCanvas?.(true, true);
}

// The full report, collapsed below the short one; opening it grows the node.
function appendFull(container, full, widget) {
  if (!full) return;
  const details = document.createElement("details");
  details.className = "bigdit-full";
  const summary = document.createElement("summary");
  summary.textContent = "full report";
  const body = document.createElement("div");
  renderReport(body, full);
  details.append(summary, body);
  details.addEventListener("toggle", () => widget.measure?.());
  container.append(details);
}

function showReport(node, text, full) {
  let widget = node.widgets?.find((w) => w.name === WIDGET_NAME);
  if (!widget) {
    installStyle();
    const container = document.createElement("div");
    container.className = "bigdit-report";
    let current = "";
    let currentFull = "";
    let height = 60;
    widget = node.addDOMWidget(WIDGET_NAME, "bigdit_report", container, {
      serialize: false, // a run's output, not a setting: never saved into the workflow or the prompt
      getValue: () => current,
      setValue: (value) => {
        current = String(value ?? "");
        const lines = renderReport(container, current) + (currentFull ? 1 : 0);
        appendFull(container, currentFull, widget);
        height = Math.min(MAX_HEIGHT_PX, lines * LINE_HEIGHT_PX + 36); // + padding, border, widget margins
      },
      getMinHeight: () => height,
      getMaxHeight: () => MAX_HEIGHT_PX,
    });
    widget.serialize = false;
    widget.setFull = (value) => { currentFull = value; };
    // Long lines wrap: once the browser has laid the text out, grow to what it really needs.
    widget.measure = () => {
      // the widget's slot is its height less a margin above and below the element
      const needed = Math.min(MAX_HEIGHT_PX, container.scrollHeight + 2 * (widget.margin ?? 10) + 2);
      if (container.scrollHeight > container.clientHeight + 1 && needed > height) {
        height = needed;
        fitNode(node);
      }
    };
  }
  if (full !== undefined) widget.setFull(full); // a later event keeps the full report of the run
  widget.value = text;
  fitNode(node);
  requestAnimationFrame(() => requestAnimationFrame(widget.measure));
}

app.registerExtension({
  name: "bigdit.report",
  setup() {
    api.addEventListener("bigdit.report", ({ detail }) => {
      const node = app.graph?.getNodeById(detail?.node) ?? app.graph?.getNodeById(Number(detail?.node));
      if (node && typeof detail.text === "string" && detail.text) showReport(node, detail.text);
    });
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!isPackNode(nodeData)) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      const text = message?.text?.[0];
      const full = message?.report?.[0];
      if (typeof text === "string" && text) showReport(this, text, typeof full === "string" ? full : "");
    };
  },
});
