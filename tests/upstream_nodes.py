"""Node definitions of upstream ComfyUI that ComfyUI 0.3.75 lacks, for the MiniMax-H3 example workflow.

Written in /object_info format from the source of Comfy-Org/ComfyUI (read, not run):
- comfy_extras/nodes_minimax_h3.py @ 13a83ce7: MiniMaxH3SigmaShift (V3 schema:
  io.Float.Input(name, default, min, max, step)); @ 003617c4: MiniMaxH3ImageToVideo (H3's
  text-to-video+audio conditioning: clip, vae, prompt, size, length, optional first/last
  frame -> positive, AV latent).
- nodes.py @ 02217e36: CLIPLoader lists the text-encoder type "minimax" ("MiniMax H3
  Qwen3-VL"), i.e. comfy.sd.CLIPType.MINIMAX, which the pack's QuantizedCLIPLoader lists too
  where ComfyUI has it (its types are CLIPType's names). VAEDecode takes the video part of
  H3's nested video+audio latent, VAEDecodeAudio (comfy_extras/nodes_audio.py @ 3fa38fd9)
  the audio part. ComfyUI 0.3.75 has VAEDecodeAudio too, but loads it only where torchaudio is
installed (the test environment has none), so its definition is here as well.

The example-workflow test validates the H3 graph against these, and the workflow generator
registers them in the 0.3.75 frontend so the graph is laid out with its real widgets.
"""

MAX_RESOLUTION = 16384  # nodes.MAX_RESOLUTION

UPSTREAM_NODES = {
    "MiniMaxH3ImageToVideo": {
        "input": {
            "required": {
                "clip": ["CLIP", {}],
                "vae": ["VAE", {}],
                "prompt": ["STRING", {"multiline": True, "dynamicPrompts": True}],
                "width": ["INT", {"default": 1344, "min": 32, "max": MAX_RESOLUTION, "step": 32}],
                "height": ["INT", {"default": 768, "min": 32, "max": MAX_RESOLUTION, "step": 32}],
                "length": ["INT", {"default": 124, "min": 5, "max": 3600, "step": 17,
                                   "tooltip": "Frame count at 24 fps, snapped up to the model's 17k+5 grid"}],
            },
            "optional": {"first_frame": ["IMAGE", {}], "last_frame": ["IMAGE", {}]},
        },
        "input_order": {"required": ["clip", "vae", "prompt", "width", "height", "length"],
                        "optional": ["first_frame", "last_frame"]},
        "output": ["CONDITIONING", "LATENT"], "output_is_list": [False, False],
        "output_name": ["positive", "LATENT"],
        "name": "MiniMaxH3ImageToVideo", "display_name": "MiniMax H3 Image to Video",
        "description": "", "category": "model/conditioning/minimax",
        "python_module": "comfy_extras.nodes_minimax_h3", "output_node": False,
    },
    "MiniMaxH3SigmaShift": {
        "input": {"required": {
            "model": ["MODEL", {}],
            "shift_video": ["FLOAT", {"default": 12.0, "min": 0.01, "max": 100.0, "step": 0.01}],
            "shift_audio": ["FLOAT", {"default": 3.0, "min": 0.01, "max": 100.0, "step": 0.01}],
        }},
        "input_order": {"required": ["model", "shift_video", "shift_audio"]},
        "output": ["MODEL"], "output_is_list": [False], "output_name": ["MODEL"],
        "name": "MiniMaxH3SigmaShift", "display_name": "ModelSamplingMiniMaxH3",
        "description": "Set the video/audio flow shifts.", "category": "model/patch/minimax",
        "python_module": "comfy_extras.nodes_minimax_h3", "output_node": False,
    },
    "VAEDecodeAudio": {
        "input": {"required": {"samples": ["LATENT", {}], "vae": ["VAE", {}]}},
        "input_order": {"required": ["samples", "vae"]},
        "output": ["AUDIO"], "output_is_list": [False], "output_name": ["AUDIO"],
        "name": "VAEDecodeAudio", "display_name": "VAE Decode Audio",
        "description": "", "category": "latent/audio",
        "python_module": "comfy_extras.nodes_audio", "output_node": False,
    },
}

# Combo values that upstream accepts and 0.3.75 does not list: (node, input) -> values.
UPSTREAM_COMBO_VALUES = {
    ("CLIPLoader", "type"): {"minimax"},
    ("QuantizedCLIPLoader", "type"): {"minimax"},
}
