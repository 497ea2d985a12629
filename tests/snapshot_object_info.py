"""Write the /object_info entries of the pack's nodes, as each host serves them, to
tests/fixtures/object_info_<version>.json.

The snapshot is what a user's saved workflows were made against: the node
definitions test_object_info_snapshot compares the running server with. Each
server starts on an empty models folder, so the file lists (unet_name,
clip_name) are empty in it. It is written in V1's spelling (`as_v1_node`: what
the V3 schema adds without changing meaning taken out, the node fields V1 served
kept where the snapshot has them). Run it again only for a deliberate change of a
node's inputs or outputs:

    python tests/snapshot_object_info.py [--host VERSION ...]
"""
import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from comfy_harness import HOSTS, ComfyServer  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PACK_MODULE = "custom_nodes.bigdit"  # the harness links the pack as custom_nodes/bigdit


# node field -> the value the V3 schema gives it where V1 had no such field
V3_NODE_FIELDS = {"deprecated": False, "experimental": False, "api_node": False, "dev_only": False,
                  "output_tooltips": [], "output_matchtypes": None, "price_badge": None,
                  "search_aliases": None, "essentials_category": None, "has_intermediate_output": False}
# node field -> (V1's value, the V3 schema's) where both mean none
SAME_EMPTY = {"search_aliases": ([], None)}
OUTPUT_NODE_HIDDEN = {"prompt": "PROMPT", "extra_pnginfo": "EXTRA_PNGINFO"}


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
    """A served node in V1's spelling; `v1_fields`: the node as the snapshot holds it (its fields are kept)."""
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


def snapshot_path(version: str) -> Path:
    return FIXTURES / f"object_info_{version}.json"


def pack_nodes(object_info: dict) -> dict:
    return {name: info for name, info in sorted(object_info.items()) if info.get("python_module") == PACK_MODULE}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", action="append", choices=[h.version for h in HOSTS])
    chosen = parser.parse_args().host or [h.version for h in HOSTS]
    for host in (h for h in HOSTS if h.version in chosen):
        with tempfile.TemporaryDirectory() as base, ComfyServer(base, host) as server:
            served = pack_nodes(server.object_info())
        if not served:
            raise SystemExit(f"ComfyUI {host.version} lists none of the pack's nodes")
        path = snapshot_path(host.version)
        before = json.loads(path.read_text()) if path.exists() else {}
        nodes = {name: as_v1_node(node, before.get(name, {})) for name, node in served.items()}
        snapshot_path(host.version).write_text(json.dumps(nodes, indent=1, sort_keys=True) + "\n")
        print(f"{snapshot_path(host.version).name}: {', '.join(nodes)}")


if __name__ == "__main__":
    main()
