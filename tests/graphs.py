"""API-format ComfyUI graphs for the integration tests.

`wan_t2v_graph` builds, with fixed node ids:

    unet (UNETLoader, or `loader`) -> m0 -> m1 -> ... (model_chain) -> sampler (KSampler)
    cond (BigditZeroConditioning) -> sampler positive and negative
    latent (EmptyHunyuanLatentVideo) -> sampler -> save_latent (SaveLatent)
    sampler -> decode (VAEDecode, vae from VAELoader "vae") -> save_image (SaveImage)

A chain node gets `"model": [previous id, 0]` added to its inputs, so its output
0 must be the MODEL. `chain_id(i)` names chain node i; `add_preview` attaches a
PreviewAny to any output (e.g. a STRING report of a chain node). After
`history = comfy.run(graph)`, an output node's ui dict is
`history["outputs"][node_id]`; PreviewAny's text is `...["text"][0]`. A pack node's
full report is `node_report(history, node_id)`, its on-node one `...["text"][0]`.
"""
import re

MAX_NODE_LINES = 3  # a pack node shows its report in at most this many lines


def node_report(history, node_id) -> str:
    """The full report of a pack node (ui.report), once its on-node report (ui.text) is checked to be
    1-3 lines that the full one details (the same first words: `quantized N/M linear layers`, `saved ...`)."""
    (short,), (full,) = history["outputs"][node_id]["text"], history["outputs"][node_id]["report"]
    lines = short.splitlines()
    assert 1 <= len(lines) <= MAX_NODE_LINES, short
    def first_words(line):
        return re.split(r"[:;(]", line)[0].strip()
    assert first_words(full.splitlines()[0]) == first_words(lines[0]), (short, full)
    return full


def run_loader(comfy, vae_name, class_type, inputs):
    """(latent, the loader's report) of the tiny Wan graph with `class_type` as its loader."""
    graph = wan_t2v_graph(None, vae_name, loader=(class_type, inputs))
    report_node = add_preview(graph, "unet", 1)
    history = comfy.run(graph)
    return comfy.latent(history, "save_latent"), history["outputs"][report_node]["text"][0]


def rel_l2(a, b) -> float:
    """Relative L2 distance of `a` from the reference `b`."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def chain_id(index: int) -> str:
    return f"m{index}"


def wan_t2v_graph(unet_name, vae_name, model_chain=(), seed=0, steps=2, width=64, height=64,
                  length=1, weight_dtype="default", loader=None) -> dict:
    """The tiny Wan 2.1 T2V text-to-video graph.

    model_chain: (class_type, inputs) pairs applied in order to the model.
    loader: (class_type, inputs) replacing UNETLoader (then unet_name and
    weight_dtype are unused); its output 0 must be the MODEL.
    """
    if loader is None:
        loader = ("UNETLoader", {"unet_name": unet_name, "weight_dtype": weight_dtype})
    graph = {"unet": {"class_type": loader[0], "inputs": dict(loader[1])}}
    model = "unet"
    for index, (class_type, inputs) in enumerate(model_chain):
        graph[chain_id(index)] = {"class_type": class_type, "inputs": {**inputs, "model": [model, 0]}}
        model = chain_id(index)
    graph.update({
        "cond": {"class_type": "BigditZeroConditioning", "inputs": {"length": 8}},
        "latent": {"class_type": "EmptyHunyuanLatentVideo",
                   "inputs": {"width": width, "height": height, "length": length, "batch_size": 1}},
        "sampler": {"class_type": "KSampler", "inputs": {
            "model": [model, 0], "seed": seed, "steps": steps, "cfg": 1.0,
            "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0,
            "positive": ["cond", 0], "negative": ["cond", 0], "latent_image": ["latent", 0]}},
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": vae_name}},
        "decode": {"class_type": "VAEDecode", "inputs": {"samples": ["sampler", 0], "vae": ["vae", 0]}},
        "save_image": {"class_type": "SaveImage",
                       "inputs": {"images": ["decode", 0], "filename_prefix": "bigdit/image"}},
        "save_latent": {"class_type": "SaveLatent",
                        "inputs": {"samples": ["sampler", 0], "filename_prefix": "bigdit/latent"}},
    })
    return graph


def add_preview(graph: dict, source: str, output_index: int, node_id=None) -> str:
    """Add a PreviewAny showing output `output_index` of node `source`; return its id."""
    node_id = node_id or f"preview_{source}_{output_index}"
    graph[node_id] = {"class_type": "PreviewAny", "inputs": {"source": [source, output_index]}}
    return node_id


H3_TEXT_LENGTH = 8


def h3_graph(unet_name, text_dim, model_chain=(), seed=0, steps=2, width=64, height=64, length=5,
             weight_dtype="default", loader=None, shift_video=12.0, shift_audio=3.0) -> dict:
    """A tiny MiniMax-H3 text-to-video+audio graph with upstream's own H3 nodes, fixed node ids:

        unet (UNETLoader, or `loader`) -> shift (MiniMaxH3SigmaShift) -> m0 -> ... (model_chain) -> sampler
        cond (BigditRandomConditioning, [1, 8, text_dim]) -> sampler positive; ConditioningZeroOut -> negative
        latent (EmptyMiniMaxH3LatentAV) -> sampler -> split (LTXVSeparateAVLatent, upstream's "Separate AV
        Latent") -> save_video, save_audio (SaveLatent)

    64x64 and 5 frames give a [1, 24, 2, 4, 4] video and a [1, 32, 2, 8] audio latent.
    """
    if loader is None:
        loader = ("UNETLoader", {"unet_name": unet_name, "weight_dtype": weight_dtype})
    graph = {"unet": {"class_type": loader[0], "inputs": dict(loader[1])},
             "shift": {"class_type": "MiniMaxH3SigmaShift",
                       "inputs": {"model": ["unet", 0], "shift_video": shift_video, "shift_audio": shift_audio}}}
    model = "shift"
    for index, (class_type, inputs) in enumerate(model_chain):
        graph[chain_id(index)] = {"class_type": class_type, "inputs": {**inputs, "model": [model, 0]}}
        model = chain_id(index)
    graph.update({
        "cond": {"class_type": "BigditRandomConditioning",
                 "inputs": {"length": H3_TEXT_LENGTH, "dim": text_dim, "seed": 0}},
        "negative": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["cond", 0]}},
        "latent": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": width, "height": height,
                                                                     "length": length}},
        "sampler": {"class_type": "KSampler", "inputs": {
            "model": [model, 0], "seed": seed, "steps": steps, "cfg": 1.0,
            "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0,
            "positive": ["cond", 0], "negative": ["negative", 0], "latent_image": ["latent", 0]}},
        "split": {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["sampler", 0]}},
        "save_video": {"class_type": "SaveLatent",
                       "inputs": {"samples": ["split", 0], "filename_prefix": "bigdit/h3_video"}},
        "save_audio": {"class_type": "SaveLatent",
                       "inputs": {"samples": ["split", 1], "filename_prefix": "bigdit/h3_audio"}},
    })
    return graph
