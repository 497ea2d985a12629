"""The pack's MiniMax-H3 examples: Comfy-Org's official MiniMax-H3 templates with the pack's nodes
where they add something.

The templates are those of comfyui-workflow-templates-json 0.1.123 (MIT), unchanged in
tests/fixtures/comfy_templates/. `build(name)` returns the example as a UI workflow: the template's
nodes, subgraph, notes and `properties.models` download hints as they are, and
- the Load Diffusion Model node replaced by LoadH3Quantized (same file, same links): it loads the
  official INT8 ConvRot file as stored, and a bf16 fine-tune quantized while loading;
- SetAttentionBackend on the model after the turbo-LoRA switch (in the text-to-image template it
  replaces upstream's ModelAttentionBackend there, whose subgraph input `attention_backend` it takes
  over; in the video templates its `backend` becomes a subgraph input of that name);
- the Load CLIP node replaced by QuantizedCLIPLoader (same file and `type`, same links): it loads the
  official NVFP4-AWQ encoder (a `pre_quant_scale` per layer), and on GPUs without an NVFP4 GEMM its
  `nvfp4` input can re-quantize it to the GPU's fastest native format;
- in the video templates, SetVAEKernels on the link from the video VAE's loader to VAE Decode (the
  loader's other links, to the conditioning, stay): the INT8 ConvRot decoder's linears and attention on the
  pack's kernels, its weights on the card for the whole decode;
- a note saying what changed.

The pack's nodes are written from their /object_info definitions on upstream 0.33.0
(tests/fixtures/object_info_0.33.0.json), as the front end serializes a node: every input in
definition order, widget inputs with their values in `widgets_values`.
tests/make_example_workflows.py writes the result, and the API file the front end makes of it.
"""
import copy
import json
import uuid
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TEMPLATES = FIXTURES / "comfy_templates"
TEMPLATES_PACKAGE = "comfyui-workflow-templates-json 0.1.123"
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
SUBGRAPH_INPUT = -10  # the id links from a subgraph's inputs originate at

LOADER = {"quantization": "int8_convrot", "offload": "auto", "group_size": "256", "ignored_layers": "", "fit_gib": 0.0,
          "int8": "auto"}
ATTENTION = {"dense_backend": "auto", "sol_tau": 1.0, "dense_steps": 0, "dense_layers": ""}
TEXT_ENCODER = {"rename_prefixes": "", "nvfp4": "auto", "int8": "auto"}
VAE_KERNELS = {"attention": "auto", "linears": "pack", "weights": "resident", "tiles": "batched"}
VAE_KERNELS_SIZE = [300, 130]


def node_specs() -> dict:
    return json.loads((FIXTURES / "object_info_0.33.0.json").read_text())


def input_type(declaration) -> str:
    return "COMBO" if isinstance(declaration[0], list) else declaration[0]


class Graph:
    """The nodes and links of a workflow's top level or of one subgraph definition (links are lists at
    the top level, objects in a subgraph), with ids drawn from the workflow's shared counters."""

    def __init__(self, workflow, subgraph=None):
        self.workflow, self.subgraph = workflow, subgraph
        self.body = subgraph if subgraph is not None else workflow
        self.nodes = {node["id"]: node for node in self.body["nodes"]}

    def link(self, link_id) -> dict:
        for link in self.body["links"]:
            fields = link if isinstance(link, dict) else dict(zip(
                ("id", "origin_id", "origin_slot", "target_id", "target_slot", "type"), link))
            if fields["id"] == link_id:
                return fields
        raise KeyError(link_id)

    def set_origin(self, link_id, origin_id, origin_slot):
        for index, link in enumerate(self.body["links"]):
            if isinstance(link, dict) and link["id"] == link_id:
                link.update(origin_id=origin_id, origin_slot=origin_slot)
            elif isinstance(link, list) and link[0] == link_id:
                link[1:3] = [origin_id, origin_slot]

    def add_link(self, origin_id, origin_slot, target_id, target_slot, link_type) -> int:
        link_id = next_id(self.workflow, "link")
        if self.subgraph is not None:
            self.body["links"].append({"id": link_id, "origin_id": origin_id, "origin_slot": origin_slot,
                                       "target_id": target_id, "target_slot": target_slot, "type": link_type})
        else:
            self.body["links"].append([link_id, origin_id, origin_slot, target_id, target_slot, link_type])
        return link_id

    def of_type(self, class_type) -> list:
        return [node for node in self.body["nodes"] if node["type"] == class_type]


def next_id(workflow, kind) -> int:
    """A new node or link id, above every one the workflow and its subgraphs use."""
    top, state = {"node": "last_node_id", "link": "last_link_id"}[kind], {"node": "lastNodeId", "link": "lastLinkId"}[kind]
    subgraphs = workflow.get("definitions", {}).get("subgraphs", [])
    new = max([workflow[top]] + [s["state"][state] for s in subgraphs]) + 1
    workflow[top] = new
    for subgraph in subgraphs:
        subgraph["state"][state] = new
    return new


def pack_node(specs, class_type, node_id, widgets, links=None, outputs=None, **fields) -> dict:
    """A node of the pack as the front end serializes it. links: {input name: link id};
    outputs: [link ids] per output slot."""
    spec = specs[class_type]
    declared = {**spec["input"].get("required", {}), **spec["input"].get("optional", {})}
    order = spec["input_order"]
    inputs, values = [], {}
    for name in order["required"] + order.get("optional", []):
        kind = input_type(declared[name])
        entry = {"localized_name": name, "name": name}
        if name in order.get("optional", []):
            entry["shape"] = 7
        entry["type"] = kind
        if kind in WIDGET_TYPES:
            entry["widget"] = {"name": name}
            values[name] = widgets[name]
        entry["link"] = (links or {}).get(name)
        inputs.append(entry)
    unknown = set(widgets) - set(values)
    assert not unknown, f"{class_type} has no widgets {unknown}"
    node = {"id": node_id, "type": class_type, **fields, "mode": 0, "inputs": inputs,
            "outputs": [{"localized_name": name, "name": name, "type": kind,
                         "links": (outputs or [None] * len(spec["output"]))[slot]}
                        for slot, (name, kind) in enumerate(zip(spec["output_name"], spec["output"]))],
            "properties": {"Node name for S&R": class_type},
            "widgets_values": list(values.values()), "widgets_values_named": values}
    return node


def replace_node(specs, graph, node, class_type, widgets, renamed=None, size=None) -> dict:
    """`node` replaced, in place and with its id, by a node of `class_type`: inputs keep their links by name
    (`renamed`: old name -> new), outputs by slot, properties.models stays."""
    renamed = renamed or {}
    links = {renamed.get(i["name"], i["name"]): i["link"] for i in node["inputs"] if i.get("link") is not None}
    outputs = [o.get("links") for o in node["outputs"]]
    outputs += [None] * (len(specs[class_type]["output"]) - len(outputs))
    new = pack_node(specs, class_type, node["id"], widgets, links, outputs, pos=node["pos"],
                    size=size or node["size"], flags=node["flags"], order=node["order"])
    if "models" in node.get("properties", {}):
        new["properties"]["models"] = node["properties"]["models"]
    for slot, entry in enumerate(new["inputs"]):
        if entry["link"] is not None:
            assert graph.link(entry["link"])["target_slot"] == slot, (class_type, entry["name"])
    graph.body["nodes"][graph.body["nodes"].index(node)] = new
    graph.nodes[new["id"]] = new
    return new


def insert_after(specs, graph, source, slot, class_type, widgets, pos, size, **fields) -> dict:
    """A node of `class_type` taking output `slot` of `source` (its input `model`) and feeding, from its
    output 0, everything that output fed."""
    node_id = next_id(graph.workflow, "node")
    fed = source["outputs"][slot]["links"] or []
    for link_id in fed:
        graph.set_origin(link_id, node_id, 0)
    link_id = graph.add_link(source["id"], slot, node_id, 0, source["outputs"][slot]["type"])
    source["outputs"][slot]["links"] = [link_id]
    node = pack_node(specs, class_type, node_id, widgets, {"model": link_id}, [list(fed)], pos=pos, size=size,
                     flags={}, order=source["order"], **fields)
    graph.body["nodes"].append(node)
    graph.nodes[node_id] = node
    return node


def insert_on_link(specs, graph, link_id, class_type, widgets, pos, size) -> dict:
    """A node of `class_type` on link `link_id`: its first input takes what the link carried, its output 0 feeds
    the link's target; the origin's other links stay."""
    link = graph.link(link_id)
    source = graph.nodes[link["origin_id"]]
    node_id = next_id(graph.workflow, "node")
    graph.set_origin(link_id, node_id, 0)
    fed = graph.add_link(source["id"], link["origin_slot"], node_id, 0, link["type"])
    output = source["outputs"][link["origin_slot"]]
    output["links"] = [fed if other == link_id else other for other in output["links"]]
    first_input = specs[class_type]["input_order"]["required"][0]
    node = pack_node(specs, class_type, node_id, widgets, {first_input: fed}, [[link_id]], pos=pos, size=size,
                     flags={}, order=graph.nodes[link["target_id"]]["order"])
    graph.body["nodes"].append(node)
    graph.nodes[node_id] = node
    return node


def video_decode_vae_link(graph) -> int:
    """The link that brings the video VAE to VAE Decode."""
    (decode,) = graph.of_type("VAEDecode")
    return next(entry["link"] for entry in decode["inputs"] if entry["name"] == "vae")


def promoted_inputs(subgraph) -> list:
    """The subgraph's inputs that show as widgets on its node, in the order of the node's widgets_values."""
    return [i for i in subgraph["inputs"] if i["type"] in WIDGET_TYPES]


def instance_of(workflow, subgraph) -> dict:
    (node,) = [n for n in workflow["nodes"] if n["type"] == subgraph["id"]]
    return node


def promote(workflow, graph, node, name, label, value):
    """Show widget `name` of `node` (in subgraph `graph`) on the subgraph's node as input `label`."""
    subgraph, instance = graph.subgraph, instance_of(workflow, graph.subgraph)
    slot = next(index for index, entry in enumerate(node["inputs"]) if entry["name"] == name)
    link_id = graph.add_link(SUBGRAPH_INPUT, len(subgraph["inputs"]), node["id"], slot, node["inputs"][slot]["type"])
    node["inputs"][slot]["link"] = link_id
    last = subgraph["inputs"][-1]["pos"]
    subgraph["inputs"].append({"id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"bigdit/{subgraph['id']}/{name}")),
                               "name": name, "type": node["inputs"][slot]["type"], "linkIds": [link_id],
                               "label": label, "pos": [last[0], last[1] + 20]})
    instance["inputs"].append({"label": label, "name": name, "type": node["inputs"][slot]["type"],
                               "widget": {"name": name}, "link": None})
    instance["widgets_values"].append(value)
    instance["widgets_values_named"][name] = value


def rename_promoted(workflow, graph, old, new, value):
    """The subgraph input `old` renamed `new` (its widget's new name inside) with the value `value`."""
    subgraph, instance = graph.subgraph, instance_of(workflow, graph.subgraph)
    index = [i["name"] for i in promoted_inputs(subgraph)].index(old)
    (entry,) = [i for i in subgraph["inputs"] if i["name"] == old]
    entry["name"] = new
    for item in instance["inputs"]:
        if item["name"] == old:
            item.update(name=new, widget={"name": new})
    instance["widgets_values"][index] = value
    instance["widgets_values_named"] = {(new if key == old else key): (value if key == old else v)
                                        for key, v in instance["widgets_values_named"].items()}


def model_switch(graph) -> dict:
    """The turbo switch: the If/Else Switch choosing between the model with and without the turbo LoRA."""
    (switch,) = [n for n in graph.of_type("ComfySwitchNode") if n["outputs"][0]["type"] == "MODEL"]
    return switch


def add_note(workflow, text, width=460):
    notes = [n for n in workflow["nodes"] if n["type"] == "MarkdownNote"]
    left = min(n["pos"][0] for n in notes)
    top = min(n["pos"][1] for n in notes)
    workflow["nodes"].append({
        "id": next_id(workflow, "node"), "type": "MarkdownNote", "pos": [left - width - 40, top],
        "size": [width, 16 * text.count("\n") + 200], "flags": {}, "order": len(workflow["nodes"]), "mode": 0,
        "inputs": [], "outputs": [], "title": "Note: BigDiT", "properties": {}, "widgets_values": [text],
        "color": "#232", "bgcolor": "#353"})


def the_graph(workflow) -> Graph:
    """The graph holding the template's model loader: its one subgraph, or the top level."""
    subgraphs = workflow.get("definitions", {}).get("subgraphs", [])
    assert len(subgraphs) <= 1
    return Graph(workflow, subgraphs[0] if subgraphs else None)


def with_pack_nodes(template, attention_backend, attention_pos, vae_kernels_pos, note):
    specs = node_specs()
    workflow = copy.deepcopy(template)
    graph = the_graph(workflow)
    (loader,) = graph.of_type("UNETLoader")
    replace_node(specs, graph, loader, "LoadH3Quantized", {"unet_name": loader["widgets_values"][0], **LOADER},
                 size=[loader["size"][0], 180])
    (clip,) = graph.of_type("CLIPLoader")
    clip_name, clip_type, _device = clip["widgets_values"]
    replace_node(specs, graph, clip, "QuantizedCLIPLoader", {"clip_name": clip_name, "type": clip_type, **TEXT_ENCODER},
                 size=[clip["size"][0], 220])
    widgets = {"backend": attention_backend, **ATTENTION}
    upstream_attention = graph.of_type("ModelAttentionBackend")
    if upstream_attention:
        (node,) = upstream_attention
        node = replace_node(specs, graph, node, "SetAttentionBackend", widgets, renamed={"attention": "backend"},
                            size=[node["size"][0], 180])
        rename_promoted(workflow, graph, "attention", "backend", attention_backend)
    else:
        node = insert_after(specs, graph, model_switch(graph), 0, "SetAttentionBackend", widgets,
                            pos=attention_pos, size=[300, 180])
        if graph.subgraph is not None:
            promote(workflow, graph, node, "backend", "attention_backend", attention_backend)
    if vae_kernels_pos is not None:
        insert_on_link(specs, graph, video_decode_vae_link(graph), "SetVAEKernels", VAE_KERNELS, vae_kernels_pos,
                       VAE_KERNELS_SIZE)
    add_note(workflow, note)
    return workflow


def template(name) -> dict:
    return json.loads((TEMPLATES / f"{name}.json").read_text())


def template_nodes(name) -> list:
    """Every node of the template, its subgraphs' included."""
    workflow = template(name)
    return workflow["nodes"] + [n for s in workflow.get("definitions", {}).get("subgraphs", []) for n in s["nodes"]]


NOTE = """\
## BigDiT in this workflow

Comfy-Org's template `{template}` ({package}) with BigDiT's nodes{where}:

- **Load Diffusion Model (quantize while loading)** in place of Load Diffusion Model. It loads the official \
INT8 ConvRot file as stored, and a bf16 fine-tune (as `{bf16}`) quantized to INT8 ConvRot layer by layer, \
so RAM never holds the bf16 model beside the INT8 one. `offload` auto streams the transformer blocks that \
do not fit in VRAM (24 GB GPUs); its report shows the memory plan.
- **Set Attention Backend** on the model after the turbo LoRA switch{attention}. `auto` runs the fastest \
exact kernel measured on this GPU; `sage`, `flash`, `kitchen_int8` or `sol` (sparse, faster above about \
12k tokens) pick one. A kernel that cannot take a call falls back, and the node says so.
- **Load Quantized Text Encoder** in place of Load CLIP: it loads the official NVFP4-AWQ encoder (AWQ's \
per-channel input scales included). `nvfp4` requantize re-quantizes it at load to this GPU's fastest native \
format where the GPU has no NVFP4 GEMM (before sm100); auto keeps NVFP4 and dequantizes each layer before \
its matmul there.
{vae}
{turbo}{inputs}"""

IN_SUBGRAPH = " inside its subgraph (open it with the icon at the top right of the node)"
PROMOTED = " (shown on the subgraph's node as `attention_backend`)"
VAE_NOTE = ("- **Set VAE Kernels** between the video VAE's loader and VAE Decode: the decoder's INT8 ConvRot "
            "linears run on BigDiT's INT8 kernels (on the file's own tensors), its attention on `auto`, and its "
            "weights stay on the card for the whole decode (ComfyUI frees room for them first: the diffusion model's "
            "pages go). The VAE's own tiling runs as in the template.\n")


INPUTS = ("\n\nThe input {pictures} {names} {ship} with BigDiT as placeholder drawings in its "
          "`example_workflows/input/` folder: copy {them} into ComfyUI's `input` folder to run this workflow as it "
          "is, or pick your own picture in Load Image.")


def note(template, where, attention, turbo, vae=VAE_NOTE):
    nodes = template_nodes(template)
    bf16 = next(n for n in nodes if n["type"] == "UNETLoader")["widgets_values"][0]
    images = [f"`{n['widgets_values'][0]}`" for n in nodes if n["type"] == "LoadImage"]
    inputs = INPUTS.format(pictures="pictures" if len(images) > 1 else "picture", names=" and ".join(images),
                           ship="ship" if len(images) > 1 else "ships",
                           them="them" if len(images) > 1 else "it") if images else ""
    return NOTE.format(template=template, package=TEMPLATES_PACKAGE, where=where,
                       bf16=bf16.replace("_int8_convrot", "_bf16"), attention=attention, vae=vae, turbo=turbo,
                       inputs=inputs)


# name -> (template, SetAttentionBackend's backend, its position where it is added, SetVAEKernels' position (None: not
# added), note)
EXAMPLES = {
    "bigdit-minimax-h3-t2v": ("video_minimax_h3_t2v", "auto", [-400, 5130], [760, 4660], note(
        "video_minimax_h3_t2v", IN_SUBGRAPH, PROMOTED,
        "The turbo LoRA is off, as in the template: `turbo_mode` on samples `turbo_steps` (8) steps with it.")),
    "bigdit-minimax-h3-i2v": ("video_minimax_h3_i2v", "auto", [-400, 5130], [760, 4660], note(
        "video_minimax_h3_i2v", IN_SUBGRAPH, PROMOTED,
        "The turbo LoRA is off, as in the template: `turbo_mode` on samples `turbo_steps` (8) steps with it.")),
    "bigdit-minimax-h3-r2v": ("video_minimax_h3_r2v", "auto", [-390, 4880], [-1490, 5710], note(
        "video_minimax_h3_r2v", "", "",
        "The turbo LoRA is off, as in the template: Boolean (Enable Lightning LoRA) on samples 4 steps with it.")),
    "bigdit-minimax-h3-t2i": ("image_minimax_h3_t2i", "kitchen_int8", None, None, note(
        "image_minimax_h3_t2i", IN_SUBGRAPH,
        " (in place of the template's Model Attention Backend: `kitchen_int8` is its `comfy kitchen attention`, "
        "and the subgraph's node still shows it as `attention_backend`)",
        "The turbo LoRA is off, as in the template: with `enable_turbo_lora` on, set `steps` to 8.", vae="")),
}


def build(name) -> dict:
    """The example `name` of EXAMPLES as a UI workflow."""
    source, backend, pos, vae_pos, text = EXAMPLES[name]
    workflow = with_pack_nodes(template(source), backend, pos, vae_pos, text)
    workflow["id"] = str(uuid.uuid5(uuid.NAMESPACE_URL, f"bigdit/{name}"))
    return workflow
