"""The MiniMax-H3 examples are the official templates with the pack's nodes (tests/template_workflows.py):
the committed UI files are the generator's output, they keep every node, subgraph, note and download
hint of the template, and the API files the front end made of them run the pack's nodes where intended.
"""
import json
from pathlib import Path

import pytest

import template_workflows
from template_workflows import EXAMPLES, build, template

EXAMPLE_DIR = Path(__file__).resolve().parent.parent / "example_workflows"
REPLACED = {"UNETLoader": "LoadH3Quantized", "ModelAttentionBackend": "SetAttentionBackend",
            "CLIPLoader": "QuantizedCLIPLoader"}
NOT_QUEUED = {"MarkdownNote", "Note"}  # the front end sends no virtual node to the server


def load(path):
    return json.loads(Path(path).read_text())


def all_nodes(workflow):
    """{(subgraph id or None, node id): node} of the top level and every subgraph."""
    nodes = {(None, n["id"]): n for n in workflow["nodes"]}
    for subgraph in workflow.get("definitions", {}).get("subgraphs", []):
        nodes.update({(subgraph["id"], n["id"]): n for n in subgraph["nodes"]})
    return nodes


def hints(workflow):
    return sorted(json.dumps(m, sort_keys=True) for n in all_nodes(workflow).values()
                  for m in n.get("properties", {}).get("models", []))


@pytest.mark.parametrize("name", EXAMPLES)
def test_committed_example_is_the_generators_output(name):
    assert load(EXAMPLE_DIR / f"{name}.json") == build(name), \
        f"example_workflows/{name}.json is stale: run python tests/make_example_workflows.py {name}"


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_keeps_the_templates_nodes_subgraph_notes_and_hints(name):
    source, example = template(EXAMPLES[name][0]), build(name)
    ours, theirs = all_nodes(example), all_nodes(source)
    for key, node in theirs.items():
        assert ours[key]["type"] == REPLACED.get(node["type"], node["type"]), key
        assert ours[key].get("title") == node.get("title"), key
    added = [ours[key]["type"] for key in ours.keys() - theirs.keys()]
    assert sorted(added) == sorted(["MarkdownNote"] + (["SetAttentionBackend"] if "ModelAttentionBackend" not in
                                                       {n["type"] for n in theirs.values()} else [])
                                   + (["SetVAEKernels"] if EXAMPLES[name][3] is not None else []))
    assert [s["id"] for s in example.get("definitions", {}).get("subgraphs", [])] == \
        [s["id"] for s in source.get("definitions", {}).get("subgraphs", [])]
    assert hints(example) == hints(source)
    notes = [n["widgets_values"][0] for n in example["nodes"] if n["type"] == "MarkdownNote"]
    assert notes[:-1] == [n["widgets_values"][0] for n in source["nodes"] if n["type"] == "MarkdownNote"]
    assert notes[-1].startswith("## BigDiT in this workflow") and EXAMPLES[name][0] in notes[-1]


def links_from(graph, node_id):
    return {(k, name) for k, n in graph.items() for name, v in n["inputs"].items()
            if isinstance(v, list) and v[0] == node_id}


@pytest.mark.parametrize("name", EXAMPLES)
def test_api_file_runs_the_pack_nodes_where_the_example_puts_them(name):
    """example_workflows/api/<name>.json is what the front end queued for the UI file (checked against the
    front end by test_examples_and_ui.py); here, that it holds the pack's nodes as the generator meant."""
    api, workflow = load(EXAMPLE_DIR / "api" / f"{name}.json"), build(name)
    queued = [n for n in all_nodes(workflow).values()
              if n["type"] not in NOT_QUEUED and not n["type"].count("-") == 4]  # a subgraph's node is its nodes
    assert sorted(n["class_type"] for n in api.values()) == sorted(n["type"] for n in queued)
    by_type = {}
    for node_id, node in api.items():
        by_type.setdefault(node["class_type"], []).append(node_id)
    assert not {"UNETLoader", "ModelAttentionBackend", "CLIPLoader"} & set(by_type)
    (loader,) = by_type["LoadH3Quantized"]
    (unet,) = [n for n in all_nodes(template(EXAMPLES[name][0])).values() if n["type"] == "UNETLoader"]
    assert api[loader]["inputs"] == {"unet_name": unet["widgets_values"][0], **template_workflows.LOADER}
    (attention,) = by_type["SetAttentionBackend"]
    assert api[attention]["inputs"] == {"model": api[attention]["inputs"]["model"], "backend": EXAMPLES[name][1],
                                        **template_workflows.ATTENTION}
    switch = api[api[attention]["inputs"]["model"][0]]
    assert switch["class_type"] == "ComfySwitchNode"
    lora = api[switch["inputs"]["on_true"][0]]
    assert lora["class_type"] == "LoraLoaderModelOnly" and lora["inputs"]["model"] == [loader, 0]
    assert switch["inputs"]["on_false"] == [loader, 0]
    assert {api[k]["class_type"] for k, _ in links_from(api, attention)} >= {"BasicGuider"}
    (encoder,) = by_type["QuantizedCLIPLoader"]
    (clip,) = [n for n in all_nodes(template(EXAMPLES[name][0])).values() if n["type"] == "CLIPLoader"]
    clip_name, clip_type, _device = clip["widgets_values"]
    assert clip_name.endswith("_nvfp4_awq.safetensors") and clip_type == "minimax"
    assert api[encoder]["inputs"] == {"clip_name": clip_name, "type": clip_type, **template_workflows.TEXT_ENCODER}
    # its CLIP output (slot 0, not the report) feeds the prompt's encoding, as the template's CLIPLoader did
    consumers = [api[k]["inputs"][input_name] for k, input_name in links_from(api, encoder)]
    assert consumers and all(link == [encoder, 0] for link in consumers), consumers
    # the video VAE reaches VAE Decode through SetVAEKernels; its loader's other links (the conditioning) stay
    (decode,) = by_type["VAEDecode"]
    kernels = by_type.get("SetVAEKernels", [])
    if EXAMPLES[name][3] is None:
        assert not kernels and api[api[decode]["inputs"]["vae"][0]]["class_type"] == "VAELoader"
        return
    (kernels,) = kernels
    assert api[decode]["inputs"]["vae"] == [kernels, 0]
    assert api[kernels]["inputs"] == {"vae": api[kernels]["inputs"]["vae"], **template_workflows.VAE_KERNELS}
    loader = api[kernels]["inputs"]["vae"][0]
    assert api[loader]["inputs"]["vae_name"] == "minimax_h3_video_vae_int8_convrot.safetensors"
    consumers = sorted(api[k]["class_type"] for k, _ in links_from(api, loader))
    assert len(consumers) == 2 and "SetVAEKernels" in consumers and consumers[0].startswith("MiniMaxH3"), consumers
