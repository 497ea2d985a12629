"""ARCHITECTURE.md's checkable claims, read from the source with `ast` (nothing is imported): only host/ and nodes/
import ComfyUI, the packages import each other in one direction (the core never imports host/ or nodes/), the core
holds no key of ComfyUI's transformer_options, nodes/ holds only node classes, one per-layer record crosses from the
decision to the built layer, one routine dequantizes and quantizes again, no node module is over 200 lines, and the
layout's tree names every top-level module and package."""
import ast
from pathlib import Path

PACK_ROOT = Path(__file__).resolve().parent.parent
NOT_PACK = {"tests", "web", "example_workflows", "shared"}
# ComfyUI's importable top-level names (comfy_kitchen is a package of its own, used by the core)
COMFYUI = {"comfy", "comfy_api", "comfy_extras", "comfy_execution", "folder_paths", "nodes", "server", "execution",
           "node_helpers", "latent_preview"}
# unit -> the pack's units it may import (ARCHITECTURE.md's layers)
BASE = {"dtypes", "hardware", "units", "pack_logging", "threads"}
CORE = {"quant", "attention", "offload", "loaders"}
ALLOWED = {
    **{base: set() for base in BASE},
    "quant": BASE,
    "attention": BASE,
    "offload": BASE | {"quant"},
    "loaders": BASE | {"quant"},
    "host": BASE | CORE,
    "nodes": BASE | CORE | {"host"},
    "__init__": {"nodes"},
}
COMFY_UNITS = {"host", "nodes"}
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


def test_only_host_and_nodes_import_comfyui():
    found = {(str(rel), name) for rel, tree in pack_modules() if unit_of(rel) not in COMFY_UNITS
             for _, name in imports(rel, tree) if name in COMFYUI}
    assert not found


def test_host_and_nodes_import_comfyui():
    """The check above can fail: host/ and nodes/ do import ComfyUI under these names."""
    for unit in COMFY_UNITS:
        names = {name for rel, tree in pack_modules() if unit_of(rel) == unit for _, name in imports(rel, tree)}
        assert {"comfy", "comfy_api"} & names, unit


def test_nodes_holds_only_node_classes():
    """Each module of nodes/ defines node classes (io.ComfyNode subclasses) and its NODES tuple, and nothing
    else: no function, no other class; its __init__ builds the node tables from those tuples."""
    for path in sorted((PACK_ROOT / "nodes").glob("*.py")):
        tree = ast.parse(path.read_text())
        functions = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
        others = [n.name for n in classes if not any(ast.unparse(base) == "io.ComfyNode" for base in n.bases)]
        assert not functions and not others, (path.name, functions, others)
        if path.name != "__init__.py":
            names = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
            assert classes and "NODES" in names, path.name


def test_one_record_crosses_from_decision_to_build():
    """The one-pipeline rule: `decide` is defined once (quant/decision.py) and returns the one per-layer record,
    `Layer` (quant/layer.py); the builders that carry decisions out (the quantization pass, the loaders' builder)
    call it, a format's `stored_decision` returns that record, and no other class of the pack holds a method
    (a field typed LinearMethod, whatever its name) beside a reason."""
    decides = [(str(rel), n) for rel, tree in pack_modules() for n in ast.walk(tree)
               if isinstance(n, ast.FunctionDef) and n.name == "decide"]
    assert [rel for rel, _ in decides] == ["quant/decision.py"]
    assert ast.unparse(decides[0][1].returns) == "Layer"
    callers = {str(rel) for rel, tree in pack_modules() for n in ast.walk(tree)
               if isinstance(n, ast.Call) and ast.unparse(n.func) in ("decide", "decide_all")}
    assert callers == {"quant/decision.py", "quant/quantize_pass.py", "loaders/build.py"}
    records = set()
    for rel, tree in pack_modules():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            fields = {t.target.id: ast.unparse(t.annotation) for t in cls.body
                      if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name)}
            if "reason" in fields and any("LinearMethod" in annotation for annotation in fields.values()):
                records.add(f"{rel}:{cls.name}")
    assert records == {"quant/layer.py:Layer"}
    stored_decisions = {str(rel): ast.unparse(n.returns).strip("'\"") for rel, tree in pack_modules()
                        for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "stored_decision"}
    assert len(stored_decisions) >= 4 and set(stored_decisions.values()) == {"Layer"}, stored_decisions


# what turns a stored weight into full precision (a method's `dequantize`, QuantLinear's `dequantized`, stored
# tensors' `dequantized_weight`), and what quantizes one
DEQUANTIZERS = {"dequantize", "dequantized", "dequantized_weight"}
QUANTIZERS = {"quantized_layer", "quantize_weight"}
ROUTINE = "requantized_layer"


def _calls(node):
    """(position, name) of the calls below `node` in source order, leaving out what it hands the routine."""
    found, handed = [], set()
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        func = call.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name == ROUTINE:
            handed |= {id(n) for arg in (*call.args, *(k.value for k in call.keywords)) for n in ast.walk(arg)}
        found.append(((call.lineno, call.col_offset), name, id(call)))
    return sorted(((position, name) for position, name, key in found if key not in handed), key=lambda c: c[0])


def test_one_dequantize_then_quantize_routine():
    """quant/linear.py's requantized_layer is the one dequantize-then-quantize routine (AWQ's pre_quant_scale
    folded in; QuantLinear's patch routines beside it requantize a patch in the layer's own format): outside
    quant/linear.py no function dequantizes a weight and then quantizes, itself or through a module-level helper
    of the pack that dequantizes; what a function hands the routine (a host's own dequantization) is the
    routine's. The loaders' builder and the quantization pass convert through it."""
    modules = {str(rel): tree for rel, tree in pack_modules()}
    defined = [rel for rel, tree in modules.items() for n in ast.walk(tree)
               if isinstance(n, ast.FunctionDef) and n.name == ROUTINE]
    assert defined == ["quant/linear.py"]
    dequantizers, grew = set(DEQUANTIZERS), True
    helpers = [n for rel, tree in modules.items() if rel != "quant/linear.py" for n in tree.body
               if isinstance(n, ast.FunctionDef)]
    while grew:
        more = {n.name for n in helpers if {name for _, name in _calls(n)} & dequantizers} - dequantizers
        dequantizers |= more
        grew = bool(more)
    assert "host_stored_weight" in dequantizers  # the closure finds the pass's helper for a host's layers
    both = set()
    for rel, tree in modules.items():
        for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and rel != "quant/linear.py"):
            calls = _calls(function)
            first = min((position for position, name in calls if name in dequantizers), default=None)
            if first is not None and any(position > first and name in QUANTIZERS for position, name in calls):
                both.add(f"{rel}:{function.name}")
    assert not both
    callers = {rel for rel, tree in modules.items() if any(name == ROUTINE for _, name in _calls(tree))}
    assert {"loaders/build.py", "quant/quantize_pass.py"} <= callers


def test_the_core_reads_no_host_options():
    """ComfyUI's per-call options reach the core as a view the host fills: host/attention.py's call_options
    reads transformer_options' keys into attention.options.CallOptions. No module of the core (attention/ and
    offload/ included) names transformer_options or holds one of those keys as a string."""
    host = ast.parse((PACK_ROOT / "host" / "attention.py").read_text())
    reader = next(n for n in ast.walk(host) if isinstance(n, ast.FunctionDef) and n.name == "call_options")
    keys = {call.args[0].value for call in ast.walk(reader) if isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute) and call.func.attr == "get"
            and call.args and isinstance(call.args[0], ast.Constant)}
    assert {"sigmas", "sample_sigmas", "block_index", "minimax_h3_layout"} <= keys
    found = set()
    for rel, tree in pack_modules():
        if unit_of(rel) not in CORE:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in keys | {"transformer_options"}:
                found.add((str(rel), node.value))
            name = (node.id if isinstance(node, ast.Name) else node.arg if isinstance(node, (ast.arg, ast.keyword))
                    else node.attr if isinstance(node, ast.Attribute) else None)
            if name == "transformer_options":
                found.add((str(rel), name))
    assert not found


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


def test_the_host_calls_the_core_pipelines_through_their_entry_points():
    """host/loading.py takes from the core only the two pipelines' entry points (and `emulated_alike`, whether a
    text encoder's load would run as the host's own loader runs it): the rest of a load (inspect, decide, build,
    release) runs in loaders/load.py, which calls back only through its Host (tests/test_load_pipeline.py), and
    QuantizeModelINT8's pass in quant/quantize_pass.py (host/model.py)."""
    def core_names(path):
        tree = ast.parse((PACK_ROOT / "host" / path).read_text())
        return {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 2
                and node.module.split(".")[0] in CORE for alias in node.names}
    assert core_names("loading.py") == {"LoadOptions", "load", "emulated_alike", "QuantizeOptions"}
    assert {"QuantizeOptions", "quantize_model"} <= core_names("model.py")
