"""The registry is the only place that knows formats: a format's name is written only in its own module.

A format's name here: its registered name and its aliases (`QuantFormat.name`, `.aliases`), found as a word in
a string literal of the pack's code (not a docstring). Everyone else reads the name from the registry. Adding a
format is thus its module plus its name in the import line of quant/registry.py."""
import ast
import re
from pathlib import Path

from bigdit.quant.registry import formats

PACK_ROOT = Path(__file__).resolve().parent.parent
NOT_PACK = {"tests", "web", "example_workflows", "shared"}
# The same spelling for another thing: torch's dtype name. (The loaders' input `nvfp4` is named by its format.)
SAME_SPELLING = {("dtypes.py", "float8_e4m3fn")}


def docstrings(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                yield first.value


def literals(path: Path):
    tree = ast.parse(path.read_text())
    skip = {id(node) for node in docstrings(tree)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            yield node.value


def test_each_format_name_is_written_only_in_its_own_module():
    homes = {}
    for name, spec in formats().items():
        home = str(Path(type(spec).__module__.replace("bigdit.", "").replace(".", "/") + ".py"))
        for spelling in (name, *spec.aliases):
            homes[spelling] = home
    assert len(homes) >= 9
    found = set()
    for path in sorted(PACK_ROOT.rglob("*.py")):
        rel = path.relative_to(PACK_ROOT)
        if rel.parts[0] in NOT_PACK or rel.parts[0].startswith("."):
            continue
        for text in literals(path):
            for spelling, home in homes.items():
                if str(rel) != home and (str(rel), spelling) not in SAME_SPELLING and \
                        re.search(rf"(?<![\w.]){re.escape(spelling)}(?!\w)", text):
                    found.add((str(rel), spelling))
    assert not found
