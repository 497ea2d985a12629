"""ComfyUI's own front end, in headless Chromium, turning API-format graphs into UI workflows.

`open_comfy(browser, url)` opens the graph editor of a running ComfyUI with the
first-run dialogs off and waits until the node definitions are registered.
`build_ui_workflow(browser, graph, note)` creates the graph's nodes through the
front end (LiteGraph.createNode, widget values by name, links by input name, a
node's `models` as its download hints, properties.models), lays them out in
columns by depth, each node wide enough for its whole title, clear of the
sidebar and the top bar when the workflow opens at 100 %, and returns what the
front end saves and queues for it: {"workflow": UI format (drag-and-drop JSON),
"prompt": API format (graphToPrompt)}. Because the front end writes both, they
always agree with each other and with the front end's widget order.
"""
import json
import urllib.request

# Node definitions and the pack's extension registered, and the first visit's default workflow
# loaded (newer front ends load it after registering the nodes; loaded later, it would replace ours).
READY = ("window.comfyAPI?.app?.app?.graph && window.LiteGraph?.registered_node_types?.KSampler"
         " && window.comfyAPI.app.app.extensions.some(e => e.name === 'bigdit.report')"
         " && window.comfyAPI.app.app.graph.nodes.length > 0")

# Where the first column's first node goes, at 100 % from the page's top left: right of the front end's
# sidebar and below its tabs and menu bar (newer front ends draw the canvas under both).
ORIGIN = (100, 150)

# Arguments: graph {key: {class_type, inputs, title?, models?}} with links as [key, output index], note
# text and the origin. Node ids follow the graph's order (the Note first).
BUILD_JS = r"""
async ({graph, note, origin}) => {
  const app = window.comfyAPI.app.app;
  await app.loadGraphData({last_node_id: 0, last_link_id: 0, nodes: [], links: [], groups: [],
                           config: {}, extra: {}, version: 0.4}, true, false, null,
                          {showMissingNodesDialog: false, showMissingModelsDialog: false});
  // the view at 100 % and the origin, where the nodes go: a workflow loaded before may have left it far away
  app.canvas.ds.scale = 1;
  app.canvas.ds.offset[0] = app.canvas.ds.offset[1] = 0;
  const graphRef = app.graph;
  const nodes = {};
  const add = (type) => {
    const node = LiteGraph.createNode(type);
    if (!node) throw new Error(`ComfyUI has no node type ${type}`);
    graphRef.add(node);
    return node;
  };
  let noteNode = null;
  if (note) {
    noteNode = add("Note");
    noteNode.widgets[0].value = note;
    noteNode.title = "Read me";
    noteNode.setSize([560, Math.max(160, 16 * note.split("\n").length + 70)]);
  }
  for (const [key, spec] of Object.entries(graph)) {
    nodes[key] = add(spec.class_type);
    if (spec.title) nodes[key].title = spec.title;
    if (spec.models) nodes[key].properties.models = spec.models;
  }
  // newer front ends cut a title longer than the node's width less a title bar's height on each side;
  // 40 px more for a front end whose title font is wider than this one's
  const ctx = document.createElement("canvas").getContext("2d");
  ctx.font = app.canvas.title_text_font;
  const titleWidth = (node) => Math.ceil(ctx.measureText(node.title).width) + 2 * LiteGraph.NODE_TITLE_HEIGHT + 40;
  for (const [key, spec] of Object.entries(graph)) {
    const node = nodes[key];
    for (const [name, value] of Object.entries(spec.inputs)) {
      if (Array.isArray(value)) {
        const slot = node.findInputSlot(name);
        if (slot < 0) throw new Error(`${spec.class_type} has no input ${name}`);
        if (!nodes[value[0]]) throw new Error(`${key}.${name} links to unknown node ${value[0]}`);
        if (!nodes[value[0]].connect(value[1], node, slot)) throw new Error(`cannot link ${value[0]} to ${key}.${name}`);
      } else {
        const widget = node.widgets?.find((w) => w.name === name);
        if (!widget) throw new Error(`${spec.class_type} has no widget ${name}`);
        widget.value = value;
      }
    }
    // seeds stay as written instead of changing after every run
    for (const w of node.widgets ?? []) if (w.name === "control_after_generate") w.value = "fixed";
    const [w, h] = node.computeSize();
    node.setSize([Math.max(w, 300, titleWidth(node)), h]);
  }
  // columns by depth: a node sits right of every node it takes an input from, and a node
  // without inputs (a loader) sits just left of its first consumer
  const depth = {};
  const depthOf = (key) => {
    if (depth[key] !== undefined) return depth[key];
    const sources = Object.values(graph[key].inputs).filter(Array.isArray).map((v) => depthOf(v[0]) + 1);
    return (depth[key] = Math.max(0, ...sources));
  };
  Object.keys(graph).forEach(depthOf);
  for (const [key, spec] of Object.entries(graph)) {
    if (Object.values(spec.inputs).some(Array.isArray)) continue;
    const consumers = Object.entries(graph).filter(([, other]) =>
      Object.values(other.inputs).some((v) => Array.isArray(v) && v[0] === key)).map(([k]) => depth[k]);
    if (consumers.length) depth[key] = Math.max(0, Math.min(...consumers) - 1);
  }
  const columns = [];
  for (const key of Object.keys(graph)) (columns[depth[key]] ??= []).push(nodes[key]);
  if (noteNode) (columns[0] ??= []).unshift(noteNode);
  let x = origin[0];
  for (const column of columns.filter(Boolean)) {
    let y = origin[1];
    for (const node of column) {
      node.pos = [x, y];
      y += node.size[1] + 70;
    }
    x += Math.max(...column.map((n) => n.size[0])) + 140;  // room for a report widening a node
  }
  graphRef.setDirtyCanvas(true, true);
  const workflow = graphRef.serialize();
  workflow.extra.ds = {scale: 1, offset: [0, 0]};  // the view it opens at, whatever the canvas showed last
  const {output} = await app.graphToPrompt();
  return {workflow, prompt: output};
}
"""

# Argument: a UI workflow. Loads it as a user's drag-and-drop would and returns graphToPrompt's API graph.
LOAD_JS = r"""
async (workflow) => {
  const app = window.comfyAPI.app.app;
  await app.loadGraphData(workflow, true, true, null, {showMissingNodesDialog: false, showMissingModelsDialog: false});
  return (await app.graphToPrompt()).output;
}
"""

# Argument: the target rectangle {x, y, width, height} in page pixels. Zooms and pans the canvas so
# every node (title bar included) fits inside it, centred, at most at 100 %.
FIT_VIEW_JS = r"""
async (target) => {
  const app = window.comfyAPI.app.app;
  const title = LiteGraph.NODE_TITLE_HEIGHT;
  const nodes = app.graph.nodes;
  const pad = 20;
  const left = Math.min(...nodes.map((n) => n.pos[0])) - pad;
  const top = Math.min(...nodes.map((n) => n.pos[1] - title)) - pad;
  const right = Math.max(...nodes.map((n) => n.pos[0] + n.size[0])) + pad;
  const bottom = Math.max(...nodes.map((n) => n.pos[1] + n.size[1])) + pad;
  const ds = app.canvas.ds;
  const scale = Math.min(target.width / (right - left), target.height / (bottom - top), 1);
  ds.scale = scale;
  ds.offset[0] = target.x / scale - left + (target.width / scale - (right - left)) / 2;
  ds.offset[1] = target.y / scale - top + (target.height / scale - (bottom - top)) / 2;
  app.canvas.setDirty(true, true);
  await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
  return scale;
}
"""

def call(browser, function_js: str, argument, timeout=30.0):
    return browser.evaluate(f"({function_js})({json.dumps(argument)})", timeout=timeout)


# Settings of a fresh user: no templates dialog at the first visit, no minimap over the graph,
# and node text drawn at any zoom (pictures of a whole graph are zoomed out).
FIRST_RUN_SETTINGS = {"Comfy.TutorialCompleted": True, "Comfy.Minimap.Visible": False,
                      "LiteGraph.Canvas.MinFontSizeForLOD": 0}


def open_comfy(browser, url: str, timeout=60.0):
    """Open ComfyUI's graph editor with no first-run dialog or banner, ready to build graphs."""
    for key, value in FIRST_RUN_SETTINGS.items():
        request = urllib.request.Request(f"{url}/settings/{key}", data=json.dumps(value).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=10).read()
    browser.send("Page.addScriptToEvaluateOnNewDocument",
                 {"source": "localStorage.setItem('vueNodesBannerDismissed', 'true')"})
    browser.goto(url)
    browser.wait_for(READY, timeout=timeout)


def build_ui_workflow(browser, graph: dict, note: str = "") -> dict:
    return call(browser, BUILD_JS, {"graph": graph, "note": note, "origin": ORIGIN})


def load_ui_workflow(browser, workflow: dict) -> dict:
    """The API graph ComfyUI's front end queues for a UI workflow."""
    return call(browser, LOAD_JS, workflow)


# Argument: a node type. Shows the first node of that type at 100 % in the page's centre and returns
# its rectangle on the page (title bar included).
SHOW_NODE_JS = r"""
async (type) => {
  const app = window.comfyAPI.app.app;
  const node = app.graph.nodes.find((n) => n.type === type);
  if (!node) throw new Error(`no ${type} node in the graph`);
  const title = LiteGraph.NODE_TITLE_HEIGHT;
  const ds = app.canvas.ds;
  ds.scale = 1;
  ds.offset[0] = innerWidth / 2 - node.pos[0] - node.size[0] / 2;
  ds.offset[1] = innerHeight / 2 - node.pos[1] - node.size[1] / 2;
  app.canvas.setDirty(true, true);
  await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
  return {x: node.pos[0] + ds.offset[0], y: node.pos[1] - title + ds.offset[1],
          width: node.size[0], height: node.size[1] + title};
}
"""


def screenshot_node(browser, node_type: str, path, margin=24):
    """A picture of the first node of `node_type`, at 100 % zoom, with `margin` pixels around it."""
    rect = call(browser, SHOW_NODE_JS, node_type)
    clip = {"x": rect["x"] - margin, "y": rect["y"] - margin,
            "width": rect["width"] + 2 * margin, "height": rect["height"] + 2 * margin}
    return browser.screenshot(path, clip=clip)


def screenshot_graph(browser, path, margins=(80, 110, 40, 60), fmt="png", quality=80):
    """A picture of the whole graph, zoomed to fit the page less `margins` (left, top, right,
    bottom: ComfyUI's side bar, tabs and menus)."""
    width, height = browser.evaluate("[innerWidth, innerHeight]")
    left, top, right, bottom = margins
    target = {"x": left, "y": top, "width": width - left - right, "height": height - top - bottom}
    call(browser, FIT_VIEW_JS, target)
    return browser.screenshot(path, clip=target, fmt=fmt, quality=quality)
