"""Write the pack's example workflows: example_workflows/<name>.json (UI format, what ComfyUI's
template browser lists and what drag-and-drop loads), <name>.jpg (its preview) and
example_workflows/api/<name>.json (API format, for POST /prompt), and example_workflows/input/ the pictures
the examples' Load Image nodes name (tests/example_inputs.py draws them).

    python tests/make_example_workflows.py [NAME ...]   (default: every example)

The Wan graphs below are written once, in API terms with readable node keys. A headless ComfyUI
(tests/comfy_harness.py) with this pack and its own front end in Chromium (tests/workflow_ui.py)
builds the UI workflow from each, and graphToPrompt gives the API file, so both files are what the
front end itself saves and queues. The MiniMax-H3 examples are Comfy-Org's official templates with
the pack's nodes (tests/template_workflows.py writes the UI workflow); the front end loads each and
gives its API file. Each example is built on the first host that has every feature it needs
(ComfyUI 0.3.75 for the Wan ones, upstream 0.33.0 for MiniMax-H3's native nodes).
Needs /usr/bin/chromium (Debian package 'chromium') and the hosts of .ci/setup_env.sh.
"""
import json
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

import example_inputs  # noqa: E402
import template_workflows  # noqa: E402
from browser import Browser  # noqa: E402
from comfy_harness import HOSTS, ComfyServer  # noqa: E402
from workflow_ui import build_ui_workflow, load_ui_workflow, open_comfy, screenshot_graph  # noqa: E402

OUT = TESTS.parent / "example_workflows"
PREVIEW_MAX_BYTES = 200_000

# Files as Comfy-Org's Wan 2.1 repackage names them (models/diffusion_models, text_encoders, vae), and where
# it publishes them: each loader carries its file's download hint (`properties.models`, as Comfy-Org's own
# Wan 2.1 templates do), so the front end offers the download and knows the folder of a file it misses.
WAN_UNET_BF16 = "wan2.1_t2v_14B_bf16.safetensors"
WAN_UNET_FP8_SCALED = "wan2.1_t2v_14B_fp8_scaled.safetensors"
WAN_TEXT_ENCODER = "umt5_xxl_fp8_e4m3fn_scaled.safetensors"
WAN_VAE = "wan_2.1_vae.safetensors"
WAN_REPACKAGED = "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files"
# Loader inputs naming a model file -> its models/ folder.
MODEL_FOLDERS = {"unet_name": "diffusion_models", "clip_name": "text_encoders", "vae_name": "vae"}
PROMPT = "A red fox trotting through a snowy pine forest at dawn, soft light, snow falling, cinematic."
NEGATIVE = "blurry, low quality, static, distorted, watermark, text"


def wan_t2v(model_chain, loader, title_suffix="", prefix="bigdit/wan"):
    """Wan 2.1 text-to-video, 832x480, 33 frames: `loader` -> model_chain -> KSampler."""
    graph = {"loader": loader}
    model = "loader"
    for key, node in model_chain:
        graph[key] = {**node, "inputs": {**node["inputs"], "model": [model, 0]}}
        model = key
    graph.update({
        "shift": {"class_type": "ModelSamplingSD3", "inputs": {"model": [model, 0], "shift": 8.0}},
        "clip": {"class_type": "CLIPLoader",
                 "inputs": {"clip_name": WAN_TEXT_ENCODER, "type": "wan", "device": "default"}},
        "positive": {"class_type": "CLIPTextEncode", "title": "Prompt",
                     "inputs": {"text": PROMPT, "clip": ["clip", 0]}},
        "negative": {"class_type": "CLIPTextEncode", "title": "Negative prompt",
                     "inputs": {"text": NEGATIVE, "clip": ["clip", 0]}},
        "latent": {"class_type": "EmptyHunyuanLatentVideo",
                   "inputs": {"width": 832, "height": 480, "length": 33, "batch_size": 1}},
        "sampler": {"class_type": "KSampler", "title": "KSampler" + title_suffix, "inputs": {
            "model": ["shift", 0], "seed": 42, "steps": 30, "cfg": 6.0, "sampler_name": "uni_pc",
            "scheduler": "simple", "denoise": 1.0, "positive": ["positive", 0], "negative": ["negative", 0],
            "latent_image": ["latent", 0]}},
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": WAN_VAE}},
        "decode": {"class_type": "VAEDecode", "inputs": {"samples": ["sampler", 0], "vae": ["vae", 0]}},
        "save": {"class_type": "SaveAnimatedWEBP", "inputs": {
            "images": ["decode", 0], "filename_prefix": prefix, "fps": 16.0, "lossless": False,
            "quality": 90, "method": "default"}},
    })
    for node in graph.values():
        hints = [download_hint(name, value) for name, value in node["inputs"].items() if name in MODEL_FOLDERS]
        if hints:
            node["models"] = hints
    return graph


def download_hint(input_name, file_name):
    """Where Comfy-Org publishes a Wan 2.1 file, and the models/ folder the loader's input reads."""
    folder = MODEL_FOLDERS[input_name]
    return {"name": file_name, "url": f"{WAN_REPACKAGED}/{folder}/{file_name}", "directory": folder}


def quantize_while_loading():
    """The bf16 file, each layer quantized as it is read: RAM never holds the bf16 model beside the INT8 one."""
    return {"class_type": "LoadH3Quantized", "inputs": {
        "unet_name": WAN_UNET_BF16, "quantization": "int8_convrot", "offload": "auto", "group_size": "256",
        "ignored_layers": ""}}


def quantize_online():
    return wan_t2v([], quantize_while_loading(), prefix="bigdit/wan_int8")


def mixed_checkpoint():
    loader = {"class_type": "MixedCheckpointLoader", "inputs": {"unet_name": WAN_UNET_FP8_SCALED, "nvfp4": "auto"}}
    return wan_t2v([], loader, prefix="bigdit/wan_mixed")


def attention_ab():
    """One model, two samplers on the same seed: SDPA and Sol (sparse) with 3 dense steps."""
    graph = wan_t2v([], quantize_while_loading(), title_suffix=" A: sdpa", prefix="bigdit/attention_A_sdpa")
    graph["attention_a"] = {"class_type": "SetAttentionBackend", "title": "A: sdpa (dense reference)", "inputs": {
        "model": ["shift", 0], "backend": "sdpa", "dense_backend": "auto", "sol_tau": 1.0, "dense_steps": 0,
        "dense_layers": ""}}
    graph["attention_b"] = {"class_type": "SetAttentionBackend", "title": "B: sol (sparse), 3 dense steps", "inputs": {
        "model": ["shift", 0], "backend": "sol", "dense_backend": "sdpa", "sol_tau": 1.0, "dense_steps": 3,
        "dense_layers": ""}}
    graph["sampler"]["inputs"]["model"] = ["attention_a", 0]
    graph["sampler_b"] = {**graph["sampler"], "title": "KSampler B: sol",
                          "inputs": {**graph["sampler"]["inputs"], "model": ["attention_b", 0]}}
    graph["decode_b"] = {"class_type": "VAEDecode", "inputs": {"samples": ["sampler_b", 0], "vae": ["vae", 0]}}
    graph["save_b"] = {"class_type": "SaveAnimatedWEBP", "inputs": {
        **graph["save"]["inputs"], "images": ["decode_b", 0], "filename_prefix": "bigdit/attention_B_sol"}}
    return graph


# Examples that need host features (comfy_harness.FEATURES) beyond the pack's.
NEEDS = {name: ("minimax_h3", "torchaudio") for name in template_workflows.EXAMPLES}

EXAMPLES = {
    "bigdit-1-quantize-wan-int8-online": (quantize_online, """\
Quantize a bf16 model to INT8 while it loads (BigDiT).

Wan 2.1 T2V 14B in bf16 is about 28 GB of weights. "Load Diffusion Model
(quantize while loading)" reads the file layer by layer and turns each Linear
layer into INT8 ConvRot (about half the bytes) as it is read, so RAM never
holds the bf16 model beside the INT8 one; offload "auto" streams the blocks
that do not fit in VRAM. After the run the node shows its report: formats,
GiB saved, the memory plan and how many quantized layers ran.

Files: models/diffusion_models/wan2.1_t2v_14B_bf16.safetensors,
models/text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors,
models/vae/wan_2.1_vae.safetensors (Comfy-Org's Wan 2.1 repackage; the
loaders carry their download links). Any other model ComfyUI loads works
the same way. To skip the quantization at the next load, save the result
once with Save Quantized Model and load that file with "Load Quantized
Diffusion Model"."""),
    "bigdit-2-load-mixed-quantized-checkpoint": (mixed_checkpoint, """\
Load a checkpoint whose layers are stored quantized (BigDiT).

"Load Quantized Diffusion Model" reads ComfyUI per-layer markers (INT8 with or without
ConvRot, FP8, NVFP4, MXFP8, mixed in one file), ComfyUI's scaled_fp8 files or a
self-describing Quanto qint8 file, checks the whole file first, and builds each
layer in its format. The architecture is detected by ComfyUI, so this works for
any model ComfyUI knows, also on ComfyUI versions without these formats.

The file here is Comfy-Org's FP8 Wan 2.1 T2V 14B (a scaled_fp8 file; the loaders
carry their download links); put your own quantized file in
models/diffusion_models and pick it in the loader. The report lists layers per
format and how block formats run on this GPU (native or dequantized).

nvfp4 = requantize: on GPUs without an NVFP4 GEMM (before sm100), re-quantize
NVFP4 layers to this GPU's fastest native format at load."""),
    "bigdit-4-attention-a-b-sdpa-vs-sol": (attention_ab, """\
Attention A/B: the same model, seed and prompt through two attention backends (BigDiT).

A: PyTorch SDPA (dense, the reference). B: Sol sparse attention, with the first
3 steps dense. Compare the two videos and the time each sampler takes (ComfyUI's
log shows it, and Set Attention Backend logs which kernel ran how often).
Sol pays off above about 12k tokens; at short lengths it falls back to dense.

Change B's backend to sage, flash or kitchen_int8 to compare those. The model
is quantized once and shared by both branches."""),
}


def preview_jpeg(browser, path: Path):
    for quality in (80, 65, 50, 35):
        screenshot_graph(browser, path, fmt="jpeg", quality=quality)
        if path.stat().st_size <= PREVIEW_MAX_BYTES:
            return
    raise RuntimeError(f"{path} stays over {PREVIEW_MAX_BYTES} bytes")



def placeholder_models(base: Path, graphs) -> None:
    """Empty files named as the examples' models: the front end then lists them in the loaders, and newer
    ones mark no loader as missing its model in the previews."""
    for graph in graphs:
        for node in graph.values():
            for name, value in node["inputs"].items():
                if name in MODEL_FOLDERS:
                    path = base / "models" / MODEL_FOLDERS[name] / value
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.touch()


def placeholder_template_files(base: Path, workflows) -> None:
    """Empty files named as the templates' download hints (properties.models), in their folders, and the
    pack's input pictures in the input folder, so that the previews show no missing file."""
    for workflow in workflows:
        nodes = workflow["nodes"] + [n for s in workflow.get("definitions", {}).get("subgraphs", []) for n in s["nodes"]]
        for node in nodes:
            for model in node.get("properties", {}).get("models", []):
                path = base / "models" / model["directory"] / model["name"]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
            if node["type"] == "LoadImage":
                (base / "input").mkdir(parents=True, exist_ok=True)
                shutil.copy(example_inputs.INPUT_DIR / node["widgets_values"][0], base / "input")


def host_for(name):
    """The first host with every feature the example needs."""
    for host in HOSTS:
        if host.lacks(*NEEDS.get(name, ())) is None:
            return host
    raise RuntimeError(f"no host has what {name} needs: {NEEDS[name]}")


def main(chosen):
    everything = [*EXAMPLES, *template_workflows.EXAMPLES]
    unknown = set(chosen) - set(everything)
    if unknown:
        raise SystemExit(f"no examples {sorted(unknown)}; known: {everything}")
    (OUT / "api").mkdir(parents=True, exist_ok=True)
    for host in HOSTS:
        names = [name for name in chosen or everything if host_for(name) is host]
        if not names:
            continue
        graphs = {name: EXAMPLES[name][0]() for name in names if name in EXAMPLES}
        workflows = {name: template_workflows.build(name) for name in names if name in template_workflows.EXAMPLES}
        for workflow in workflows.values():
            for image in example_inputs.load_image_files(workflow):
                example_inputs.write(image)
        with tempfile.TemporaryDirectory(prefix="bigdit-examples-") as base:
            placeholder_models(Path(base), graphs.values())
            placeholder_template_files(Path(base), workflows.values())
            with ComfyServer(base, host) as server, Browser(width=1600, height=1000, timeout=60) as browser:
                open_comfy(browser, server.url)
                for name in names:
                    if name in graphs:
                        build(browser, name, graphs[name], host)
                    else:
                        build_from_template(browser, name, workflows[name], host)


def build_from_template(browser, name, workflow, host):
    prompt = load_ui_workflow(browser, workflow)
    (OUT / f"{name}.json").write_text(json.dumps(workflow, indent=1) + "\n")
    (OUT / "api" / f"{name}.json").write_text(json.dumps(prompt, indent=1) + "\n")
    preview_jpeg(browser, OUT / f"{name}.jpg")
    print(f"wrote {name} on ComfyUI {host.version}: {len(prompt)} nodes")


def build(browser, name, graph, host):
    built = build_ui_workflow(browser, graph, EXAMPLES[name][1])
    workflow = {**built["workflow"], "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"bigdit/{name}"))}
    (OUT / f"{name}.json").write_text(json.dumps(workflow, indent=1) + "\n")
    (OUT / "api" / f"{name}.json").write_text(json.dumps(built["prompt"], indent=1) + "\n")
    preview_jpeg(browser, OUT / f"{name}.jpg")
    print(f"wrote {name} on ComfyUI {host.version}: {len(built['prompt'])} nodes")


if __name__ == "__main__":
    main(sys.argv[1:])
