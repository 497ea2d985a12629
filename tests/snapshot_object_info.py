"""Write the /object_info entries of the pack's nodes, as each host serves them, to
tests/fixtures/object_info_<version>.json.

The snapshot is what a user's saved workflows were made against: the node
definitions test_object_info_snapshot compares the running server with. Each
server starts on an empty models folder, so the file lists (unet_name,
clip_name) are empty in it. Run it again only for a deliberate change of a
node's inputs or outputs:

    python tests/snapshot_object_info.py [--host VERSION ...]
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from comfy_harness import HOSTS, ComfyServer  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PACK_MODULE = "custom_nodes.bigdit"  # the harness links the pack as custom_nodes/bigdit


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
            nodes = pack_nodes(server.object_info())
        if not nodes:
            raise SystemExit(f"ComfyUI {host.version} lists none of the pack's nodes")
        snapshot_path(host.version).write_text(json.dumps(nodes, indent=1, sort_keys=True) + "\n")
        print(f"{snapshot_path(host.version).name}: {', '.join(nodes)}")


if __name__ == "__main__":
    main()
