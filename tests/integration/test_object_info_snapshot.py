"""The server's /object_info for the pack's nodes equals the committed snapshot of each host
(tests/fixtures/object_info_<version>.json, written by tests/snapshot_object_info.py), field by
field: the node definitions saved workflows were made against.

Compared: inputs (names, required / optional / hidden, types, defaults, options, ranges,
tooltips, every other option), input order, outputs, output names, tooltips and list flags,
category, display name, description, output node, python module.

Allowed, as what the V3 schema adds without changing meaning:
- a combo is served as ("COMBO", {"options": [...], "multiselect": false}) where V1 served
  ([...], {}): compared as the same options;
- "multiline": false on a one-line STRING input (V1 left it out; the front end's default);
- a hidden input is ["UNIQUE_ID"] where V1 wrote "UNIQUE_ID";
- an output node gets the hidden inputs prompt and extra_pnginfo (V3 adds them to every
  output node);
- node fields this host's V1 left out, each only with its neutral value: V3_NODE_FIELDS;
- search_aliases null where V1 served [] (SAME_EMPTY).
File lists (unet_name, clip_name) are compared as what they are at run time: the snapshot's
are empty, the server's hold the files in its models folders, and a file written there
appears in them.
"""
import copy
import json
import uuid

import pytest

from snapshot_object_info import pack_nodes, snapshot_path

pytestmark = pytest.mark.integration

# node field -> the value the V3 schema gives it where V1 had no such field
V3_NODE_FIELDS = {"deprecated": False, "experimental": False, "api_node": False, "dev_only": False,
                  "output_tooltips": [], "output_matchtypes": None, "price_badge": None,
                  "search_aliases": None, "essentials_category": None, "has_intermediate_output": False}
# node field -> (V1's value, the V3 schema's) where both mean none
SAME_EMPTY = {"search_aliases": ([], None)}
OUTPUT_NODE_HIDDEN = {"prompt": "PROMPT", "extra_pnginfo": "EXTRA_PNGINFO"}
# input -> the models folder its options list
FILE_INPUTS = {"unet_name": "diffusion_models", "clip_name": "text_encoders"}


def as_v1_input(spec):
    """An input's (type, options) with the V3 additions above taken back to V1's spelling."""
    kind, options = spec[0], copy.deepcopy(spec[1]) if len(spec) > 1 else {}
    if kind == "COMBO":
        kind = options.pop("options")
        if options.get("multiselect") is False:
            del options["multiselect"]
    if kind == "STRING" and options.get("multiline") is False:
        del options["multiline"]
    return [kind, options]


def as_v1_node(node, v1_fields):
    node = copy.deepcopy(node)
    for field, neutral in V3_NODE_FIELDS.items():
        if field not in v1_fields and field in node and node[field] == neutral:
            del node[field]
    for field, (v1, v3) in SAME_EMPTY.items():
        if v1_fields.get(field) == v1 and node.get(field, v1) == v3:
            node[field] = v1
    inputs = node["input"]
    for section in ("required", "optional"):
        for name, spec in inputs.get(section, {}).items():
            inputs[section][name] = as_v1_input(spec)
    hidden = {name: value[0] if isinstance(value, list) else value for name, value in inputs.get("hidden", {}).items()}
    if node.get("output_node"):
        for name, value in OUTPUT_NODE_HIDDEN.items():
            if hidden.get(name) == value:
                del hidden[name]
        node["input_order"]["hidden"] = [n for n in node["input_order"].get("hidden", []) if n in hidden]
    if hidden:
        inputs["hidden"] = hidden
    else:
        inputs.pop("hidden", None)
        node["input_order"].pop("hidden", None)
    return node


def without_file_lists(node):
    node = copy.deepcopy(node)
    for section in ("required", "optional"):
        for name in FILE_INPUTS:
            if name in node["input"].get(section, {}):
                node["input"][section][name][0] = []
    return node


def file_options(node):
    return {name: spec[0] for section in ("required", "optional")
            for name, spec in node["input"].get(section, {}).items() if name in FILE_INPUTS}


def test_object_info_equals_the_snapshot(comfy):
    snapshot = json.loads(snapshot_path(comfy.host.version).read_text())
    written = []
    try:
        for folder in set(FILE_INPUTS.values()):
            path = comfy.models_dir / folder / f"object-info-{uuid.uuid4().hex[:8]}.safetensors"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"")
            written.append(path)
        served = {name: as_v1_node(node, snapshot.get(name, {}))
                  for name, node in pack_nodes(comfy.object_info()).items()}
    finally:
        for path in written:
            path.unlink()
    assert sorted(served) == sorted(snapshot)
    for name, node in served.items():
        for input_name, options in file_options(node).items():
            new_file = next(p.name for p in written if p.parent.name == FILE_INPUTS[input_name])
            assert new_file in options, (name, input_name, options)  # listed at request time, not at import
        expected, got = snapshot[name], without_file_lists(node)
        assert sorted(got) == sorted(expected), name
        for field in expected:
            if field == "input":
                for section in expected["input"]:
                    assert sorted(got["input"].get(section, {})) == sorted(expected["input"][section]), (name, section)
                    for input_name, spec in expected["input"][section].items():
                        assert got["input"][section][input_name] == spec, (name, section, input_name)
            else:
                assert got[field] == expected[field], (name, field)
