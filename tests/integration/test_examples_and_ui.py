"""What a ComfyUI user sees of the pack, checked against each real ComfyUI host and its own front end.

- example_workflows/api/*.json: every node and input matches the server's node definitions
  (/object_info); the server accepts each graph but for the model files it does not have; each
  runs for real with tiny models swapped in. The MiniMax-H3 example needs a host with native H3
  (and torchaudio, for VAEDecodeAudio): on others these checks are skipped with that reason.
- example_workflows/*.json (UI format) load in the front end to exactly the API graphs, and
  have their preview picture.
- Every node of the pack has a description, a tooltip on every input, and a help page that
  the front end finds where it looks (/extensions/<pack>/docs/<Node>.md).
- In headless Chromium: a workflow with QuantizeModelINT8, queued from the page, shows the
  report on the node (web/js/bigdit_report.js). The screenshot goes to test-output/, and to
  web/screenshots/report.png with BIGDIT_UPDATE_SCREENSHOT=1.
"""
import copy
import json
import os
import re
import shutil
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
import torch

from browser import CHROMIUM, Browser
from checkpoint_files import write_markers
from comfy_harness import PromptError
from graphs import H3_TEXT_LENGTH, node_report, wan_t2v_graph
from workflow_ui import build_ui_workflow, load_ui_workflow, open_comfy, screenshot_node

pytestmark = pytest.mark.integration

PACK_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = PACK_ROOT / "example_workflows"
API_FILES = sorted((EXAMPLES / "api").glob("*.json"))
UI_FILES = sorted(EXAMPLES.glob("*.json"))
ARTIFACTS = PACK_ROOT / "test-output"
PACK_MODULE = "custom_nodes.bigdit"  # the harness links the pack as custom_nodes/bigdit
# Inputs naming a model file: the examples name the files users download, which no test server has.
MODEL_FILE_INPUTS = {"unet_name", "clip_name", "vae_name"}
PREVIEW_MAX_BYTES = 200_000
# Examples that need host features (comfy_harness.FEATURES) beyond the pack's.
NEEDS = {"bigdit-3-minimax-h3-24gb": ("minimax_h3", "torchaudio")}


def load_json(path):
    return json.loads(Path(path).read_text())


def skip_unless_host_runs(comfy, path):
    if reason := comfy.host.lacks(*NEEDS.get(Path(path).stem, ())):
        pytest.skip(reason)


def validation_problems(graph, specs):
    """Mismatches between an API graph and node definitions, as ComfyUI's validation would see them
    (required inputs, known input names, link targets and types, combo values, number ranges)."""
    problems = []
    for node_id, node in graph.items():
        class_type = node["class_type"]
        spec = specs.get(class_type)
        if spec is None:
            problems.append(f"{node_id}: unknown node type {class_type}")
            continue
        declared = {**spec["input"].get("required", {}), **spec["input"].get("optional", {})}
        missing = set(spec["input"].get("required", {})) - set(node["inputs"])
        problems += [f"{node_id} {class_type}: required input {name} missing" for name in sorted(missing)]
        for name, value in node["inputs"].items():
            if name not in declared:
                problems.append(f"{node_id} {class_type}: no input named {name}")
                continue
            kind, options = declared[name][0], (declared[name][1] if len(declared[name]) > 1 else {})
            if isinstance(value, list):
                source = graph.get(value[0])
                outputs = specs.get(source["class_type"], {}).get("output", []) if source else []
                if source is None or value[1] >= len(outputs):
                    problems.append(f"{node_id} {class_type}.{name}: links to a missing output {value}")
                elif kind != "*" and outputs[value[1]] != "*" and outputs[value[1]] != kind:
                    problems.append(f"{node_id} {class_type}.{name}: {outputs[value[1]]} linked to a {kind} input")
            elif isinstance(kind, list) or kind == "COMBO":
                allowed = set(kind if isinstance(kind, list) else options.get("options", []))
                if value not in allowed and name not in MODEL_FILE_INPUTS:
                    problems.append(f"{node_id} {class_type}.{name}: {value!r} is not one of its values")
            elif kind in ("INT", "FLOAT"):
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    problems.append(f"{node_id} {class_type}.{name}: {value!r} is not a number")
                elif not options.get("min", value) <= value <= options.get("max", value):
                    problems.append(f"{node_id} {class_type}.{name}: {value} outside "
                                    f"[{options.get('min')}, {options.get('max')}]")
    return problems


def test_every_example_comes_in_both_formats_with_a_preview():
    assert [p.name for p in API_FILES] == [p.name for p in UI_FILES]
    assert len(API_FILES) >= 4
    for ui in UI_FILES:
        preview = ui.with_suffix(".jpg")  # the template browser asks for <name>.jpg
        assert preview.exists(), preview
        assert preview.read_bytes()[:3] == b"\xff\xd8\xff", f"{preview} is not a JPEG"
        assert preview.stat().st_size < PREVIEW_MAX_BYTES, preview


@pytest.mark.parametrize("path", API_FILES, ids=lambda p: p.stem)
def test_api_workflow_matches_node_definitions(comfy, path):
    skip_unless_host_runs(comfy, path)
    assert validation_problems(load_json(path), comfy.object_info()) == []


def test_validation_catches_broken_graphs(comfy):
    specs = comfy.object_info()
    graph = load_json(EXAMPLES / "api" / "bigdit-1-quantize-wan-int8-online.json")
    quantize = next(k for k, n in graph.items() if n["class_type"] == "LoadH3Quantized")
    sampler = next(k for k, n in graph.items() if n["class_type"] == "KSampler")
    broken = copy.deepcopy(graph)
    broken[quantize]["inputs"]["group_size"] = "128"
    broken[quantize]["inputs"]["groupsize"] = "256"
    broken[sampler]["inputs"]["steps"] = 0
    broken[sampler]["inputs"]["positive"] = [quantize, 0]
    del broken[sampler]["inputs"]["cfg"]
    problems = "\n".join(validation_problems(broken, specs))
    for words in ("group_size: '128'", "no input named groupsize", "steps: 0 outside", "MODEL linked to a CONDITIONING",
                  "required input cfg missing"):
        assert words in problems


@pytest.mark.parametrize("path", API_FILES, ids=lambda p: p.stem)
def test_comfyui_accepts_example_but_for_model_files(comfy, path):
    skip_unless_host_runs(comfy, path)
    graph = load_json(path)
    with pytest.raises(PromptError) as info:
        comfy.run(graph)
    errors = [(node_id, error) for node_id, node in info.value.node_errors.items() for error in node["errors"]]
    assert errors
    for node_id, error in errors:
        assert error["type"] == "value_not_in_list", (node_id, error)
        assert error["extra_info"]["input_name"] in MODEL_FILE_INPUTS, (node_id, error)


# ---- the Wan examples, run on the tiny model ---------------------------------

@pytest.fixture(scope="module")
def tiny_mixed(comfy, tiny_wan):
    layers = {"blocks.0.self_attn.q": {"format": "int8_tensorwise"}, "blocks.0.ffn.0": {"format": "float8_e4m3fn"}}
    path = write_markers(tiny_wan["path"], comfy.models_dir / "diffusion_models" / "tiny_wan_mixed.safetensors",
                         layers)
    return path.name


def tiny_variant(graph, tiny_wan, tiny_mixed):
    """The example with the tiny Wan files, zero conditioning for the text encoder, 64x64x1, 2 steps."""
    graph = copy.deepcopy(graph)
    for node_id, node in list(graph.items()):
        inputs = node["inputs"]
        if node["class_type"] in ("UNETLoader", "LoadH3Quantized"):
            inputs["unet_name"] = tiny_wan["unet_name"]
        elif node["class_type"] == "MixedCheckpointLoader":
            inputs["unet_name"] = tiny_mixed
        elif node["class_type"] == "VAELoader":
            inputs["vae_name"] = tiny_wan["vae_name"]
        elif node["class_type"] == "CLIPLoader":
            del graph[node_id]
        elif node["class_type"] == "CLIPTextEncode":
            graph[node_id] = {"class_type": "BigditZeroConditioning", "inputs": {"length": 8}}
        elif node["class_type"] == "EmptyHunyuanLatentVideo":
            inputs.update(width=64, height=64, length=1)
        elif node["class_type"] == "KSampler":
            inputs["steps"] = 2
    return graph


@pytest.mark.parametrize("name, report_node", [
    ("bigdit-1-quantize-wan-int8-online", "LoadH3Quantized"),
    ("bigdit-2-load-mixed-quantized-checkpoint", "MixedCheckpointLoader"),
    ("bigdit-4-attention-a-b-sdpa-vs-sol", "LoadH3Quantized"),
])
def test_wan_example_runs_on_the_tiny_model(comfy, tiny_wan, tiny_mixed, name, report_node):
    graph = tiny_variant(load_json(EXAMPLES / "api" / f"{name}.json"), tiny_wan, tiny_mixed)
    history = comfy.run(graph)
    saves = [k for k, n in graph.items() if n["class_type"] == "SaveAnimatedWEBP"]
    samplers = [k for k, n in graph.items() if n["class_type"] == "KSampler"]
    assert len(saves) == len(samplers) >= 1
    for save in saves:
        (image,) = comfy.output_files(history, save)
        assert image.read_bytes()[8:12] == b"WEBP"
    (reporter,) = [k for k, n in graph.items() if n["class_type"] == report_node]
    report = node_report(history, reporter)
    assert re.match(r"quantized \d+/\d+ linear layers$", report.splitlines()[0])
    assert "kept in original precision" in report
    short = history["outputs"][reporter]["text"][0]  # the ui text the web extension renders
    assert re.match(r"quantized \d+/\d+ linear layers: \w+ x\d+", short.splitlines()[0]), short
    assert re.search(r"^weights: .* \(saved [\d.]+ GiB\); \d+ kept in original precision", short, re.M), short


# ---- the MiniMax-H3 example, run on the tiny H3 ---------------------------------

def tiny_h3_variant(graph, tiny_h3):
    """The H3 example with the tiny H3 (LoadH3Quantized, ModelSamplingMiniMaxH3, Set Attention
    Backend, ConditioningZeroOut and KSampler as they are), 64x64, 5 frames, 2 steps. What has no
    tiny form is swapped: the Qwen3-VL-32B encoder and MiniMax H3 Image to Video become test
    conditioning and upstream's EmptyMiniMaxH3LatentAV (the latent that node makes without
    keyframes); the video VAE (2.6B parameters) and audio VAE (151M), whose configs are fixed,
    become upstream's Separate AV Latent and a SaveLatent per stream."""
    graph = copy.deepcopy(graph)
    by_type = {n["class_type"]: k for k, n in graph.items()}
    conditioning = by_type["MiniMaxH3ImageToVideo"]
    size = graph[conditioning]["inputs"]
    sampler = by_type["KSampler"]
    for class_type in ("QuantizedCLIPLoader", "MiniMaxH3ImageToVideo", "VAELoader", "VAEDecode", "VAEDecodeAudio",
                       "CreateVideo", "SaveVideo"):
        for node_id in [k for k, n in graph.items() if n["class_type"] == class_type]:
            del graph[node_id]
    graph[by_type["LoadH3Quantized"]]["inputs"]["unet_name"] = tiny_h3["unet_name"]
    graph[sampler]["inputs"]["steps"] = 2
    assert graph[sampler]["inputs"]["positive"] == [conditioning, 0]
    assert graph[sampler]["inputs"]["latent_image"] == [conditioning, 1]
    graph[conditioning] = {"class_type": "BigditRandomConditioning",
                           "inputs": {"length": H3_TEXT_LENGTH, "dim": tiny_h3["text_dim"], "seed": 0}}
    graph["latent"] = {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 64, "height": 64, "length": 5}}
    graph[sampler]["inputs"]["latent_image"] = ["latent", 0]
    assert size["length"] > 5 and size["width"] > 64  # the example's own size, far too big for CPU
    graph["split"] = {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": [sampler, 0]}}
    for index, stream in enumerate(("video", "audio")):
        graph[f"save_{stream}"] = {"class_type": "SaveLatent", "inputs": {
            "samples": ["split", index], "filename_prefix": f"bigdit/example_h3_{stream}"}}
    return graph


@pytest.mark.host_feature("minimax_h3")
def test_h3_example_runs_on_the_tiny_h3(comfy, tiny_h3):
    graph = tiny_h3_variant(load_json(EXAMPLES / "api" / "bigdit-3-minimax-h3-24gb.json"), tiny_h3)
    start = len(comfy.log_text())
    history = comfy.run(graph)
    log = comfy.log_text()[start:]
    video, audio = comfy.latent(history, "save_video"), comfy.latent(history, "save_audio")
    assert tuple(video.shape) == (1, 24, 2, 4, 4) and tuple(audio.shape) == (1, 32, 2, 8)
    assert torch.isfinite(video).all() and torch.isfinite(audio).all()
    by_type = {n["class_type"]: k for k, n in graph.items()}
    report = node_report(history, by_type["LoadH3Quantized"])
    assert report.splitlines()[0] == "quantized 13/22 linear layers"
    assert "formats: int8_convrot x13" in report and "offload: auto on cpu" in report
    attention = history["outputs"][by_type["SetAttentionBackend"]]["text"][0]
    assert attention == "attention: backend sol, tau 1, dense sage, dense steps 0-2"
    # 2 steps, both within the example's 3 dense steps: sage, which falls back to SDPA on CPU
    assert re.search(r"Set Attention Backend \(.*\): ran sdpa x4; fallbacks sage -> sdpa: "
                     r"needs cuda, got a cpu tensor x4; scheduled dense step x4", log), log[-3000:]


# ---- node help -----------------------------------------------------------------

def pack_nodes(object_info):
    return {name: d for name, d in object_info.items() if d["python_module"] == PACK_MODULE}


def test_every_node_has_description_tooltips_and_help_page(comfy):
    nodes = pack_nodes(comfy.object_info())
    assert {"QuantizeModelINT8", "SetAttentionBackend", "LoadH3Quantized", "MixedCheckpointLoader"} <= set(nodes)
    for name, definition in nodes.items():
        assert definition["description"].strip(), name
        for section in ("required", "optional"):
            for input_name, spec in definition["input"].get(section, {}).items():
                assert len(spec) > 1 and spec[1].get("tooltip"), f"{name}.{input_name} has no tooltip"
        # The front end asks /extensions/<pack>/docs/<Node>/<locale>.md, then /extensions/<pack>/docs/<Node>.md.
        page = (PACK_ROOT / "web" / "docs" / f"{name}.md").read_text()
        with urllib.request.urlopen(f"{comfy.url}/extensions/bigdit/docs/{name}.md", timeout=10) as response:
            assert response.read().decode() == page
        assert page.startswith(f"# {definition['display_name']}"), name
        for input_name in (*definition["input"].get("required", {}), *definition["input"].get("optional", {})):
            assert f"`{input_name}`" in page, f"web/docs/{name}.md does not explain input {input_name}"


def test_templates_are_listed_and_served(comfy):
    with urllib.request.urlopen(f"{comfy.url}/workflow_templates", timeout=10) as response:
        listed = json.loads(response.read())
    assert sorted(listed["bigdit"]) == [p.stem for p in UI_FILES]
    name = UI_FILES[0].stem
    for suffix in (".json", ".jpg"):
        url = f"{comfy.url}/api/workflow_templates/bigdit/{name}{suffix}"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.read() == (EXAMPLES / f"{name}{suffix}").read_bytes()


# ---- the front end in Chromium -----------------------------------------------

# Skipped on a developer machine without Chromium; in CI (CI=true) a missing Chromium fails the test.
needs_chromium = pytest.mark.skipif(not CHROMIUM.exists() and not os.environ.get("CI"),
                                    reason=f"{CHROMIUM} is missing: install Debian's 'chromium' package "
                                           "(.ci/setup_env.sh does) to test the web extension")

REPORT_JS = r"""
(() => {
  const node = window.comfyAPI.app.app.graph.nodes.find((n) => n.type === "QuantizeModelINT8");
  const element = node?.widgets?.find((w) => w.name === "bigdit_report")?.element;
  if (!element?.isConnected || !element.textContent) return null;
  const headline = element.querySelector(".bigdit-headline");
  const box = element.getBoundingClientRect();
  const full = element.querySelector("details.bigdit-full");
  const short = [...element.children].filter((child) => child !== full);
  return {text: element.textContent, headline: headline.textContent, shortLines: short.map((c) => c.textContent),
          full: full?.textContent ?? null, fullOpen: full?.open ?? null,
          headlineWeight: getComputedStyle(headline).fontWeight,
          saved: element.querySelector(".bigdit-saved")?.textContent ?? null,
          visible: box.width > 100 && box.height > 30,
          saved_workflow: JSON.stringify(window.comfyAPI.app.app.graph.serialize())};
})()
"""


FITS_JS = r"""
(() => {
  const node = window.comfyAPI.app.app.graph.nodes.find((n) => n.type === "QuantizeModelINT8");
  const element = node.widgets.find((w) => w.name === "bigdit_report").element;
  return element.scrollHeight <= element.clientHeight + 1;
})()
"""


def as_this_host_queues(api, workflow, specs, default_titles):
    """The stored API graph as a host's front end queues the UI workflow: a node the workflow gives no title
    has the front end's default title for its type (`default_titles`; older front ends title some nodes by
    type, newer ones by display name), and widgets a host's node has beyond the stored inputs (newer hosts
    add some, e.g. CreateVideo's bit_depth) take their defaults."""
    titled = {str(n["id"]): n["title"] for n in workflow["nodes"] if n.get("title")}
    expected = copy.deepcopy(api)
    for node_id, node in expected.items():
        spec = specs[node["class_type"]]
        node["_meta"]["title"] = titled.get(node_id, default_titles[node["class_type"]])
        declared = {**spec["input"].get("required", {}), **spec["input"].get("optional", {})}
        for name, declaration in declared.items():
            options = declaration[1] if len(declaration) > 1 else {}
            if name not in node["inputs"] and "default" in options:
                node["inputs"][name] = options["default"]
    return expected


@pytest.fixture(scope="module")
def browser(comfy):
    with Browser(width=1400, height=900, timeout=30) as chromium:
        open_comfy(chromium, comfy.url)
        yield chromium


@needs_chromium
@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_ui_workflow_loads_to_the_api_workflow(browser, comfy, path):
    skip_unless_host_runs(comfy, path)
    api = load_json(EXAMPLES / "api" / path.name)
    titles = browser.evaluate("Object.fromEntries(%s.map((t) => [t, LiteGraph.createNode(t).title]))"
                              % json.dumps(sorted({n["class_type"] for n in api.values()})))
    expected = as_this_host_queues(api, load_json(path), comfy.object_info(), titles)
    assert load_ui_workflow(browser, load_json(path)) == expected
    nodes = [n for n in load_json(path)["nodes"] if n["type"] != "Note"]
    assert Counter(n["type"] for n in nodes) == Counter(n["class_type"] for n in api.values())


@needs_chromium
def test_report_appears_on_the_node(browser, comfy, tiny_wan):
    graph = wan_t2v_graph(tiny_wan["unet_name"], tiny_wan["vae_name"], model_chain=[
        ("QuantizeModelINT8", {"group_size": "64", "ignored_layers": "head.*", "row_split": "auto"})])
    build_ui_workflow(browser, graph)
    browser.evaluate("window.comfyAPI.app.app.queuePrompt(0, 1)")
    shown = browser.wait_for(REPORT_JS, timeout=40)
    # once laid out, the node grows until the whole report shows without scrolling
    browser.wait_for(FITS_JS, timeout=5)

    assert re.fullmatch(r"quantized \d+/\d+ linear layers: int8_convrot x\d+", shown["headline"])
    assert int(shown["headlineWeight"]) >= 600
    assert shown["saved"].startswith("saved ") and shown["saved"].endswith("GiB")
    # the formats; the memory saved and the layers kept; once the sampling is over (it may be by now), what ran
    lines = shown["shortLines"]
    assert len(lines) == 2 or (len(lines) == 3 and lines[2].startswith("last run:")), lines
    # the full report, collapsed under the short one
    assert shown["fullOpen"] is False
    assert "kept in original precision" in shown["full"] and "head.head: ignored" in shown["full"]
    assert shown["visible"]
    assert shown["headline"] not in shown["saved_workflow"]  # a run's output is not saved with the workflow

    picture = screenshot_node(browser, "QuantizeModelINT8", ARTIFACTS / "report.png")
    assert picture.stat().st_size > 5_000
    if os.environ.get("BIGDIT_UPDATE_SCREENSHOT") == "1":
        target = PACK_ROOT / "web" / "screenshots" / "report.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(picture, target)
    # after the sampling, the same report with the count of the quantized layers that ran
    quantized = re.match(r"quantized (\d+)/\d+ linear layers", shown["headline"]).group(1)
    text = browser.wait_for(node_report_js("QuantizeModelINT8", "last run:"), timeout=40)
    assert text.endswith(f"last run: ran {quantized}/{quantized} quantized layers"), text


def node_report_js(node_type: str, must_contain: str) -> str:
    """JS: the short report on the first node of `node_type` (its lines, without the collapsed full
    report) once it contains `must_contain`, else null."""
    return r"""
(() => {
  const node = window.comfyAPI.app.app.graph.nodes.find((n) => n.type === %s);
  const element = node?.widgets?.find((w) => w.name === "bigdit_report")?.element;
  const lines = [...(element?.children ?? [])].filter((child) => !child.classList.contains("bigdit-full"));
  const text = lines.map((line) => line.textContent).join("\n");
  return text.includes(%s) ? text : null;
})()
""" % (json.dumps(node_type), json.dumps(must_contain))


@needs_chromium
def test_attention_kernels_that_ran_appear_on_the_node_after_sampling(browser, comfy, tiny_wan):
    """SetAttentionBackend's report shows its choice when it runs, then what the sampling really ran."""
    graph = wan_t2v_graph(tiny_wan["unet_name"], tiny_wan["vae_name"], model_chain=[
        ("SetAttentionBackend", {"backend": "sage", "dense_backend": "sdpa", "sol_tau": 1.0, "dense_steps": 0,
                                 "dense_layers": ""})])
    build_ui_workflow(browser, graph)
    browser.evaluate("window.comfyAPI.app.app.queuePrompt(0, 1)")
    text = browser.wait_for(node_report_js("SetAttentionBackend", "last run:"), timeout=40)
    assert text.startswith("attention: backend sage, dense sdpa")
    # on CPU sage cannot run: 2 steps x (self + cross attention) ran SDPA instead
    assert "last run: ran sdpa x4; fallbacks sage -> sdpa: needs cuda, got a cpu tensor x4" in text, text
    screenshot_node(browser, "SetAttentionBackend", ARTIFACTS / "attention-report.png")


@needs_chromium
def test_loader_report_with_offload_plan_appears_on_the_node(browser, comfy, tiny_wan):
    graph = wan_t2v_graph(None, tiny_wan["vae_name"], loader=("LoadH3Quantized", {
        "unet_name": tiny_wan["unet_name"], "quantization": "int8_convrot", "offload": "auto",
        "group_size": "64", "ignored_layers": ""}))
    build_ui_workflow(browser, graph)
    browser.evaluate("window.comfyAPI.app.app.queuePrompt(0, 1)")
    # the line's last part (the offload plan's) arrives after the count of the layers that ran
    text = browser.wait_for(node_report_js("LoadH3Quantized", "nothing streamed"), timeout=40)
    quantized = re.match(r"quantized (\d+)/\d+ linear layers", text).group(1)
    # after sampling, three lines: the formats, the memory saved, and in place of the load's plan the run's (with
    # its activations), what streamed, and how many quantized layers ran
    lines = text.splitlines()
    assert len(lines) == 3 and lines[1].startswith("weights: "), text
    assert re.fullmatch(r"last run: resident 1/1 blocks, streaming 0; estimated peak [\d.]+ GiB of [\d.]+ GiB; "
                        rf"nothing streamed; ran {quantized}/{quantized} quantized layers", lines[2]), text
    full = browser.evaluate(r"""window.comfyAPI.app.app.graph.nodes.find((n) => n.type === "LoadH3Quantized")
      .widgets.find((w) => w.name === "bigdit_report").element.querySelector("details.bigdit-full").textContent""")
    assert "offload: auto on cpu" in full and "resident 1/1 blocks, streaming 0" in full, full
    screenshot_node(browser, "LoadH3Quantized", ARTIFACTS / "loader-report.png")


@needs_chromium
def test_quantization_drives_comfyuis_progress_bar(browser, comfy, tiny_wan):
    """The progress events the page gets while QuantizeModelINT8 runs: one per layer, up to all of them."""
    graph = wan_t2v_graph(tiny_wan["unet_name"], tiny_wan["vae_name"], model_chain=[
        ("QuantizeModelINT8", {"group_size": "64", "ignored_layers": "", "row_split": "auto"})])
    build_ui_workflow(browser, graph)
    browser.evaluate("""(() => {
      window.__bigditProgress = [];
      window.comfyAPI.api.api.addEventListener("progress", ({ detail }) => window.__bigditProgress.push(detail));
    })()""")
    browser.evaluate("window.comfyAPI.app.app.queuePrompt(0, 1)")
    text = browser.wait_for(node_report_js("QuantizeModelINT8", "last run:"), timeout=40)  # the prompt is done
    quantized = int(re.match(r"quantized (\d+)/", text).group(1))
    node_id = browser.evaluate(
        'String(window.comfyAPI.app.app.graph.nodes.find((n) => n.type === "QuantizeModelINT8").id)')
    events = browser.evaluate("window.__bigditProgress")
    ours = [(e["value"], e["max"]) for e in events if str(e.get("node")) == node_id]
    assert ours and ours[-1] == (quantized, quantized), (ours, events[:5])
    assert [v for v, _ in ours] == sorted(v for v, _ in ours)
