"""ARCHITECTURE.md's checkable claims, read from the source with `ast` (nothing is imported): nodes/ is the only
package that imports ComfyUI, the packages import each other in one direction (the core never imports nodes/),
no node module is over 200 lines, and the layout's tree names every top-level module and package."""
import ast
from pathlib import Path

PACK_ROOT = Path(__file__).resolve().parent.parent
NOT_PACK = {"tests", "web", "example_workflows", "shared"}
# ComfyUI's importable top-level names (comfy_kitchen is a package of its own, used by the core)
COMFYUI = {"comfy", "comfy_api", "comfy_extras", "comfy_execution", "folder_paths", "nodes", "server", "execution",
           "node_helpers", "latent_preview"}
# unit -> the pack's units it may import (ARCHITECTURE.md's layers)
BASE = {"dtypes", "hardware", "units", "pack_logging"}
ALLOWED = {
    **{base: set() for base in BASE},
    "quant": BASE,
    "attention": BASE,
    "offload": BASE | {"quant"},
    "loaders": BASE | {"quant"},
    "nodes": BASE | {"quant", "attention", "offload", "loaders"},
    "__init__": {"nodes"},
}
NODE_MODULE_LINES = 200


def pack_modules():
    for path in sorted(PACK_ROOT.rglob("*.py")):
        rel = path.relative_to(PACK_ROOT)
        if rel.parts[0] not in NOT_PACK and not rel.parts[0].startswith("."):
            yield rel, ast.parse(path.read_text(), str(rel))


def imports(rel: Path, tree: ast.Module):
    """(the pack's unit or None, external top-level name or None) of each import in the module `rel`."""
    package = list(rel.parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield None, alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield None, node.module.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1]
            target = base + (node.module.split(".") if node.module else [node.names[0].name])
            yield target[0], None


def unit_of(rel: Path) -> str:
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_every_module_is_in_a_known_layer():
    units = {unit_of(rel) for rel, _ in pack_modules()}
    assert units == set(ALLOWED), "a new package or top-level module: give it its layer here and in ARCHITECTURE.md"


def test_only_nodes_imports_comfyui():
    found = {(str(rel), name) for rel, tree in pack_modules() if unit_of(rel) != "nodes"
             for _, name in imports(rel, tree) if name in COMFYUI}
    assert not found


def test_nodes_imports_comfyui():
    """The check above can fail: nodes/ does import ComfyUI under these names."""
    names = {name for rel, tree in pack_modules() if unit_of(rel) == "nodes" for _, name in imports(rel, tree)}
    assert {"comfy", "comfy_api", "folder_paths"} <= names


def test_packages_import_in_one_direction():
    wrong = {(str(rel), target) for rel, tree in pack_modules() for target, _ in imports(rel, tree)
             if target is not None and target != unit_of(rel) and target not in ALLOWED[unit_of(rel)]}
    assert not wrong


def test_no_node_module_over_200_lines():
    long = {str(p.relative_to(PACK_ROOT)): n for p in (PACK_ROOT / "nodes").glob("*.py")
            if (n := len(p.read_text().splitlines())) > NODE_MODULE_LINES}
    assert not long


def test_the_layout_names_every_top_level_module_and_package():
    text = (PACK_ROOT / "ARCHITECTURE.md").read_text()
    tree = text[text.index("```") + 3:text.index("```", text.index("```") + 3)]
    listed = {line.split()[0] for line in tree.splitlines() if line.strip()}
    units = {f"{rel.parts[0]}/" if len(rel.parts) > 1 else rel.name for rel, _ in pack_modules()}
    assert units <= listed


def test_the_loader_nodes_call_the_core_load_pipeline_once():
    """nodes/loading.py takes from the core only the load pipeline: the rest of a load (inspect, decide, build,
    release) runs in loaders/load.py, which calls back only through its Host (tests/test_load_pipeline.py)."""
    tree = ast.parse((PACK_ROOT / "nodes" / "loading.py").read_text())
    core = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 2
            for alias in node.names}
    assert core == {"LoadOptions", "load"}
