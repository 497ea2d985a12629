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

from snapshot_object_info import as_v1_node, pack_nodes, snapshot_path

pytestmark = pytest.mark.integration

# input -> the models folder its options list
FILE_INPUTS = {"unet_name": "diffusion_models", "clip_name": "text_encoders"}


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
