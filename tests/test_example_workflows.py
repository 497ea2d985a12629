"""What a new user meets in example_workflows/ before running anything: the Wan examples' loaders carry
the download hints the front end offers for a missing model (and the folder it goes to), and every picture
an example's Load Image names ships with the pack, as tests/example_inputs.py draws it. (The integration
tests check each hint's folder against the loader's own file list on a real server, and the layout in
the front end.)"""
import json
from pathlib import Path

import pytest
from PIL import Image, ImageChops

import example_inputs
import make_example_workflows
import template_workflows
from workflow_ui import ORIGIN

EXAMPLE_DIR = Path(__file__).resolve().parent.parent / "example_workflows"
UI_FILES = sorted(EXAMPLE_DIR.glob("*.json"))
WAN_EXAMPLES = [EXAMPLE_DIR / f"{name}.json" for name in make_example_workflows.EXAMPLES]
# The models/ folder each loader of the Wan examples lists its files from (its first input).
LOADER_FOLDERS = {"LoadH3Quantized": "diffusion_models", "MixedCheckpointLoader": "diffusion_models",
                  "CLIPLoader": "text_encoders", "VAELoader": "vae"}
WAN_REPACKAGED = "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/"
MAX_INPUT_BYTES = 100_000


def load(path):
    return json.loads(Path(path).read_text())


def all_nodes(workflow):
    return workflow["nodes"] + [n for s in workflow.get("definitions", {}).get("subgraphs", []) for n in s["nodes"]]


def test_every_example_is_the_generators():
    assert sorted(p.stem for p in UI_FILES) == sorted([*make_example_workflows.EXAMPLES, *template_workflows.EXAMPLES])


@pytest.mark.parametrize("path", WAN_EXAMPLES, ids=lambda p: p.stem)
def test_wan_example_loaders_carry_download_hints_for_their_folder(path):
    workflow, api = load(path), load(EXAMPLE_DIR / "api" / path.name)
    loaders = [n for n in workflow["nodes"] if n["type"] in LOADER_FOLDERS]
    types = [n["type"] for n in loaders]
    assert len(types) == 3 and {"CLIPLoader", "VAELoader"} < set(types), types  # and the pack's loader
    for node in loaders:
        file_name, folder = node["widgets_values"][0], LOADER_FOLDERS[node["type"]]
        assert node["properties"].get("models") == [
            {"name": file_name, "url": f"{WAN_REPACKAGED}{folder}/{file_name}", "directory": folder}], node["type"]
        queued = api[str(node["id"])]
        assert queued["class_type"] == node["type"] and file_name in queued["inputs"].values()


@pytest.mark.parametrize("path", WAN_EXAMPLES, ids=lambda p: p.stem)
def test_wan_example_opens_at_full_size_clear_of_the_sidebar(path):
    """ComfyUI's front end restores the saved view; its sidebar and top bar lie over the canvas's corner."""
    workflow = load(path)
    assert workflow["extra"]["ds"] == {"scale": 1, "offset": [0, 0]}
    assert (min(n["pos"][0] for n in workflow["nodes"]), min(n["pos"][1] for n in workflow["nodes"])) == ORIGIN


def test_every_picture_an_example_loads_is_shipped_as_drawn():
    named = set()
    for path in UI_FILES:
        images = example_inputs.load_image_files(load(path))
        queued = [n["inputs"]["image"] for n in load(EXAMPLE_DIR / "api" / path.name).values()
                  if n["class_type"] == "LoadImage"]
        assert sorted(images) == sorted(queued), path.name
        named.update(images)
    assert named == {"transparent_rgb_gaming_mouse.png", "red_superboy_on_city_roof.png",
                     "mecha_dragon_lightning.png"}
    assert sorted(p.name for p in example_inputs.INPUT_DIR.iterdir()) == sorted(named)
    for name in named:
        path = example_inputs.INPUT_DIR / name
        assert path.stat().st_size < MAX_INPUT_BYTES, name
        with Image.open(path) as shipped:
            drawn = example_inputs.DRAWINGS[name]()
            assert shipped.format == "PNG" and shipped.mode == drawn.mode and shipped.size == drawn.size, name
            assert ImageChops.difference(shipped, drawn).getbbox() is None, \
                f"example_workflows/input/{name} is stale: run python tests/make_example_workflows.py"


@pytest.mark.parametrize("name", template_workflows.EXAMPLES)
def test_the_note_says_where_the_pictures_go(name):
    workflow = template_workflows.build(name)
    note = [n for n in workflow["nodes"] if n["type"] == "MarkdownNote"][-1]["widgets_values"][0]
    images = example_inputs.load_image_files(workflow)
    for image in images:
        assert f"`{image}`" in note, (image, note)
    assert ("`example_workflows/input/`" in note and "ComfyUI's `input` folder" in note) == bool(images), note
