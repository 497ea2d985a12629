"""The nodes' help pages (web/docs) name exactly the registry's formats where they list formats, in its order
(SaveQuantizedModel's layout table: every format a saved file can hold)."""
import re
from pathlib import Path

from bigdit.host.options import QUANTIZATIONS
from bigdit.quant.registry import format_aliases, formats, marker_formats, rotation_formats

DOCS = Path(__file__).resolve().parent.parent / "web" / "docs"
NAMES = set(formats()) | set(format_aliases())


def input_row(page: str, name: str) -> str:
    """The description cell of input `name` in the page's inputs table."""
    for line in (DOCS / page).read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0] == f"`{name}`":
            return cells[1]
    raise AssertionError(f"{page} has no row for input {name}")


def described(text: str) -> list[str]:
    """The values a cell describes, each written "`value`:" or "`value` (default):"."""
    return re.findall(r"`([\w.-]+)`(?: \(default\))?:", text)


def named_formats(text: str) -> list[str]:
    return [word for word in re.findall(r"`([\w.-]+)`", text) if word in NAMES]


def marker_passage(page: str) -> str:
    """What follows "per-layer markers**", to the end of its paragraph or the next bold text."""
    text = (DOCS / page).read_text()
    after = re.split(r"per-layer\s+markers\*\*", text, maxsplit=1)
    assert len(after) == 2, f"{page} no longer lists the marker formats after 'per-layer markers**'"
    return after[1].split("\n\n")[0].split("**")[0]


def test_loader_quantization_lists_the_node_options():
    cell = input_row("LoadH3Quantized.md", "quantization")
    assert described(cell) == list(QUANTIZATIONS.values)
    assert set(named_formats(cell)) <= set(QUANTIZATIONS.values) | set(QUANTIZATIONS.old)


def test_group_size_names_the_rotation_formats():
    assert named_formats(input_row("LoadH3Quantized.md", "group_size")) == list(rotation_formats())


def test_quantize_node_lists_the_rotation_formats():
    cell = input_row("QuantizeModelINT8.md", "quantization")
    assert described(cell) == list(rotation_formats())
    assert named_formats(cell) == list(rotation_formats())


def test_marker_loaders_list_the_marker_formats():
    for page in ("MixedCheckpointLoader.md", "QuantizedCLIPLoader.md"):
        assert named_formats(marker_passage(page)) == list(marker_formats()), page


def test_save_page_gives_the_layout_of_every_format_a_file_can_hold():
    first_cells = [line.strip().strip("|").split("|")[0] for line in (DOCS / "SaveQuantizedModel.md").read_text()
                   .splitlines() if line.strip().startswith("| ") and "`" in line.split("|")[1]]
    listed = [name for cell in first_cells for name in named_formats(cell)]
    assert listed == [name for name, spec in formats().items() if spec.unsaveable is None]
