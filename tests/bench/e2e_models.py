"""Random-weight diffusion models at full size for the end-to-end benchmark (tests/bench/comfy_e2e.py).

A model is built from the host's own class on the meta device (no memory), only
to learn its state_dict names and shapes; each tensor is then drawn on the
generation device (the GPU where there is one) from a per-tensor seed, cast to
bf16 and written straight into a safetensors file (`StreamingSafetensorsWriter`),
so the host never holds the model and the file is the same bytes on every run on
the same device type.

Initialisation keeps activations finite through all blocks (ComfyUI 0.3.75 runs a
bf16 Wan file in fp16): matrices and convolution kernels N(0, 1/fan_in),
modulation tables N(0, 1/dim), norm scales 1 and norm shifts 0, other vectors
(biases) N(0, 0.02^2).

`MODELS` names the shapes the benchmark knows; `generate(spec, path, comfyui)`
runs the generation in a subprocess with the host's ComfyUI importable (as
tests/tiny_models.py does), and returns what it measured. `make_lora` writes a
random LoRA for a generated model file.

`generate(..., fmt=...)` writes the same weights (same draws) as a ComfyUI
per-layer marker file instead (FORMATS): every linear inside the blocks quantized
on the generation device, with its `<layer>.comfy_quant` marker, the rest bf16.
"int8_convrot" is {"format": "int8_tensorwise", "convrot": true,
"convrot_groupsize": 256} with comfy-kitchen's per-channel ConvRot weight
quantization, and plain per-channel {"format": "int8_tensorwise"} where 256 does
not divide the layer's input (the full H3's AdaLN projections: Comfy-Org's 34 GB
full int8_convrot file holds them in 8 bits, in a layout not readable here); "fp8" is {"format": "float8_e4m3fn"} with one fp32 absmax/448
scale per tensor (QUANTIZATION.md's float8_e4m3fn row); "w4a8" and "w4a4" are
upstream's asym_w4a8_int8 (group 16) and convrot_w4a4, and "nvfp4" its nvfp4 (E2M1 with
fp8 scales per 16 and a global scale), written by comfy-kitchen's own layouts. Upstream ComfyUI's
UNETLoader loads them as its own QuantizedTensor layers.

The whole-job benchmark (tests/bench/whole_job.py) also writes the MiniMax-H3 template's other files in their
published layouts: `COMPONENTS` (the Qwen3-VL-32B text encoder as NVFP4 with AWQ scales, the video VAE with an
INT8 ConvRot decoder, the fp32 audio VAE; `generate_component`) and the turbo LoRA (`make_turbo_lora`).
"""
from __future__ import annotations

import functools
import json
import math
import queue
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

# safetensors dtype names of the torch dtypes we write
_ST_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "int8": "I8", "uint8": "U8",
              "float8_e4m3fn": "F8_E4M3"}

# file format -> the ComfyUI marker of its quantized layers (None: plain bf16)
FORMATS = {"bf16": None,
           "int8_convrot": {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256},
           "fp8": {"format": "float8_e4m3fn"},
           "w4a8": {"format": "asym_w4a8_int8", "group_size": 16, "convrot_groupsize": 256},
           "w4a4": {"format": "convrot_w4a4", "convrot_groupsize": 256},
           "nvfp4": {"format": "nvfp4"}}
# the kitchen-layout markers' comfy-kitchen layouts and the marker keys their quantize takes (as upstream's
# QUANT_ALGOS)
KITCHEN_LAYOUTS = {"asym_w4a8_int8": ("AsymW4A8Int8Layout", ("group_size", "convrot_groupsize")),
                   "convrot_w4a4": ("TensorCoreConvRotW4A4Layout", ("convrot_groupsize",)),
                   "nvfp4": ("TensorCoreNVFP4Layout", ())}
CONVROT_GROUP = 256


@dataclass(frozen=True)
class Length:
    """One video size: the empty-latent node's width, height and length (frames); ModelSpec.tokens counts it."""
    name: str
    width: int
    height: int
    frames: int

    @property
    def label(self) -> str:
        return f"{self.width}x{self.height}x{self.frames}"


@dataclass(frozen=True)
class ModelSpec:
    """A DiT shape: the host class that builds it, its text width and the lengths to run.

    `module`/`cls`/`kwargs`: the host's model class and its constructor arguments;
    `text_dim`: the width of the cross-attention context the conditioning node makes;
    `text_len`: its token count; `latent_node`: the host node that makes the empty latent of a
    Length; `family` "wan" (EmptyHunyuanLatentVideo: width, height, length, batch_size; a video
    latent) or "h3" (upstream's EmptyMiniMaxH3LatentAV: width, height, length; a video+audio latent
    that the graph splits, the video part saved and compared); `keep_fp32`: the tensors the host
    class builds in fp32 even in a bf16 model (H3's patch and output projections, its AdaLN curve
    basis) are written in fp32, as in the published files; everything else is bf16.
    """
    name: str
    module: str
    cls: str
    kwargs: dict
    text_dim: int
    text_len: int
    lengths: tuple[Length, ...] = field(default_factory=tuple)
    latent_node: str = "EmptyHunyuanLatentVideo"
    family: str = "wan"
    keep_fp32: bool = False

    def tokens(self, length: Length) -> int:
        """The sequence one model call sees: Wan's video tokens (VAE 4x8x8, patch 1x2x2); H3's text, video
        (VAE 16x16 in space, patch 1x2x2, latent frames as upstream's temporal_shape) and audio tokens
        (40 latent frames a second at 24 fps)."""
        if self.family == "h3":
            frames = length.frames
            while frames % 17 != 5:  # upstream snaps the length to its 17k+5 grid
                frames += 1
            latent_t = 2 if frames <= 5 else (frames - 5) // 17 * 5 + 2
            return self.text_len + latent_t * (length.height // 32) * (length.width // 32) + round(frames / 24 * 40)
        latent_frames = (length.frames - 1) // 4 + 1
        return latent_frames * (length.height // 16) * (length.width // 16)

    def latent_inputs(self, length: Length) -> dict:
        inputs = {"width": length.width, "height": length.height, "length": length.frames}
        return inputs if self.family == "h3" else {**inputs, "batch_size": 1}

    def length(self, name: str) -> Length:
        for length in self.lengths:
            if length.name == name:
                return length
        try:  # WIDTHxHEIGHTxFRAMES
            width, height, frames = (int(v) for v in name.lower().split("x"))
        except ValueError:
            raise ValueError(f"unknown length {name!r} for {self.name}: use one of "
                             f"{', '.join(l.name for l in self.lengths)} or WIDTHxHEIGHTxFRAMES") from None
        return Length(name, width, height, frames)

    def file_name(self, fmt: str = "bf16") -> str:
        return f"bench_{self.name}_random_{fmt}.safetensors"


def _wan(name, dim, ffn_dim, num_layers, lengths):
    return ModelSpec(name, "comfy.ldm.wan.model", "WanModel",
                     dict(model_type="t2v", dim=dim, ffn_dim=ffn_dim, num_heads=dim // 128, num_layers=num_layers,
                          in_dim=16, out_dim=16, text_dim=4096, freq_dim=256),
                     text_dim=4096, text_len=512, lengths=lengths)


# Wan 2.1 T2V 14B: 832x480x81 -> 21x30x52 = 32,760 tokens; x17 -> 7,800 tokens.
WAN14B = _wan("wan14b", 5120, 13824, 40,
              (Length("long", 832, 480, 81), Length("short", 832, 480, 17)))
# The same class at a size a CPU runs in a second (ComfyUI 0.3.75 needs dim = 128 * heads).
TINY_WAN = _wan("tiny_wan", 256, 512, 2,
                (Length("long", 96, 64, 9), Length("short", 64, 64, 5)))

# MiniMax-H3's pruned DiT as Comfy-Org ships it (40 GB bf16): upstream's defaults (50 blocks, hidden 5376,
# 56 x 128 heads, ffn 14336) in curve form, where each block's AdaLN projection reads a small shared basis of
# the time-embedding curve (`adaln_t_table`, grid x basis) instead of the 2688-wide embedding: 6.2 M fp32
# parameters a block instead of 260 M. The grid and basis sizes are this benchmark's choice.
# 1344x768x107: 256 text + 32 x 24 x 42 video + 178 audio = 32,690 tokens; x22: 7,349.
def _h3(name, lengths, **kwargs):
    return ModelSpec(name, "comfy.ldm.minimax.model", "MiniMaxH3Model", kwargs, text_dim=kwargs.get("text_dim", 5120),
                     text_len=256, lengths=lengths, latent_node="EmptyMiniMaxH3LatentAV", family="h3",
                     keep_fp32=True)


H3_PRUNED = _h3("h3pruned", (Length("long", 1344, 768, 107), Length("short", 1344, 768, 22)),
                adaln_curve_grid=1000, time_embed_dim=64)
# The pruned DiT as Comfy-Org's minimax_h3_fl2va_pruned_* files store it: their AdaLN curve table is 1025 x 8
# (`adaln_t_table`), so each block's AdaLN projection reads 8 basis values. 1,000 fewer MB than h3pruned in INT8.
H3_PRUNED_RELEASED = _h3("h3pruned_released", H3_PRUNED.lengths, adaln_curve_grid=1025, time_embed_dim=8)
# The full MiniMax-H3 (issue 19): upstream's defaults with the full-width AdaLN projections (2688 -> 96768 a
# block, 13 B of its 33 B parameters, computed from the timestep alone) and its time embedder; 66 GB in bf16,
# more than the GPU machine's disk, so the benchmark writes only its marker files (int8_convrot about 35 GB).
H3_FULL = _h3("h3full", H3_PRUNED.lengths)
# The same class at a size a CPU runs in seconds (text_dim differs from hidden, as upstream's detection needs).
TINY_H3 = _h3("tiny_h3", (Length("long", 64, 64, 22), Length("short", 64, 64, 5)),
              hidden_size=256, num_layers=2, token_refiner_num_layers=1, num_attention_heads=2,
              ffn_hidden_size=512, text_dim=320, time_embed_hidden_size=256, adaln_curve_grid=100,
              time_embed_dim=64)
MODELS = {spec.name: spec for spec in (WAN14B, TINY_WAN, H3_PRUNED, H3_PRUNED_RELEASED, H3_FULL, TINY_H3)}


# ---- init and writing (no ComfyUI needed) ------------------------------------

def init_kind(name: str, shape, norm_names=()) -> str:
    """How a state_dict entry is drawn: "matrix", "modulation", "ones", "zeros" or "vector". `norm_names`: more
    module names (ends of the path) that are norms, as Qwen's `input_layernorm` and `q_norm`."""
    leaf = name.rsplit(".", 1)[-1]
    is_norm = ".norm" in name or name.startswith("norm") or name.rsplit(".", 1)[0].endswith(tuple(norm_names))
    if leaf == "modulation":
        return "modulation"
    if is_norm and leaf in ("weight", "gamma"):
        return "ones"
    if is_norm and leaf == "bias":
        return "zeros"
    if len(shape) >= 2:
        return "matrix"
    return "vector"


def draw(name: str, shape, seed: int, device, dtype, norm_names=()):
    """One tensor of the random model, drawn in fp32 on `device` and cast to `dtype`."""
    import torch
    kind = init_kind(name, shape, norm_names)
    if kind == "ones":
        return torch.ones(shape, device=device, dtype=dtype)
    if kind == "zeros":
        return torch.zeros(shape, device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    value = torch.randn(shape, device=device, dtype=torch.float32, generator=gen)
    if kind == "matrix":
        value *= math.prod(shape[1:]) ** -0.5
    elif kind == "modulation":
        value *= shape[-1] ** -0.5
    else:
        value *= 0.02
    return value.to(dtype)


class StreamingSafetensorsWriter:
    """Write a safetensors file tensor by tensor, in the order declared, never holding more than two.

    The header (names, dtypes, shapes, offsets) is written first from `entries`
    [(name, shape, torch dtype)]; then `write(name, tensor)` must come in the same
    order with matching shapes. Disk writes run on a thread, overlapping the next
    tensor's generation and device-to-host copy.
    """

    def __init__(self, path, entries, metadata=None):
        import torch
        self.path = Path(path)
        self._expected = []
        header, offset = {}, 0
        for name, shape, dtype in entries:
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _ST_DTYPES[str(dtype).removeprefix("torch.")], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self._expected.append((name, tuple(shape), dtype, nbytes))
            offset += nbytes
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
        self.total_bytes = offset
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._file = open(self._tmp, "wb")
        self._file.write(len(blob).to_bytes(8, "little") + blob)
        self._next = 0
        self._queue: queue.Queue = queue.Queue(maxsize=2)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is None:
                try:
                    self._file.write(memoryview(item))
                except BaseException as e:  # reported by the next write() or close()
                    self._error = e

    def write(self, name, tensor):
        import torch
        if self._error is not None:
            raise self._error
        exp_name, shape, dtype, nbytes = self._expected[self._next]
        if (name, tuple(tensor.shape), tensor.dtype) != (exp_name, shape, dtype):
            raise ValueError(f"{self.path.name}: expected {exp_name} {shape} {dtype}, got "
                             f"{name} {tuple(tensor.shape)} {tensor.dtype}")
        host = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        assert host.nbytes == nbytes
        self._queue.put(host)
        self._next += 1

    def close(self):
        self._queue.put(None)
        self._thread.join()
        self._file.close()
        if self._error is not None:
            self._tmp.unlink(missing_ok=True)
            raise self._error
        if self._next != len(self._expected):
            self._tmp.unlink(missing_ok=True)
            raise ValueError(f"{self.path.name}: {len(self._expected) - self._next} tensors were never written")
        self._tmp.replace(self.path)


# ---- generation (subprocess with ComfyUI importable) ------------------------

LORA_RANK = 32
LORA_FILE = "bench_lora_r32.safetensors"
# A LoRA of the size of Comfy-Org's turbo LoRA for MiniMax-H3 (1.82 GiB in bf16): on H3 the turbo LoRA itself
# (make_turbo_lora), on other models the rank that makes a LoRA on every block linear that size
LORA_2G_FILE = "bench_lora_1p82gib.safetensors"
LORA_2G_BYTES = 1_956_193_000
LORAS = {LORA_FILE: {"rank": LORA_RANK}, LORA_2G_FILE: {"target_bytes": LORA_2G_BYTES}}  # file -> make_lora's size


def lora_targets(shapes: dict) -> list[tuple[str, int, int]]:
    """(module, out, in) of every linear layer inside the transformer blocks, where LoRAs go."""
    return [(name[:-len(".weight")], shape[0], shape[1]) for name, shape in shapes.items()
            if name.startswith("blocks.") and name.endswith(".weight") and len(shape) == 2]


def make_lora(model_path, lora_path, rank: int = LORA_RANK, seed: int = 0,
              target_bytes: float | None = None) -> dict:
    """A random LoRA (kohya names, no alpha: scale 1) of `rank` on every block linear of the model file; with
    `target_bytes`, of the rank that comes nearest that size.

    down ~ N(0, 1/in), up ~ N(0, 0.02^2 / rank): each layer's delta has about
    2% of a unit-variance weight's scale, so the latent stays finite and the
    LoRA is visible. Returns {"layers", "bytes", "rank"}.
    """
    import safetensors
    import safetensors.torch
    import torch
    with safetensors.safe_open(str(model_path), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    targets = lora_targets(shapes)
    if target_bytes is not None:  # bf16 up [out, rank] and down [rank, in]; no rank past a layer's own
        rank = max(1, min(round(target_bytes / sum(2 * (n_out + n_in) for _, n_out, n_in in targets)),
                          *(min(n_out, n_in) for _, n_out, n_in in targets)))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, n_out, n_in in targets:
        tensors[f"diffusion_model.{module}.lora_down.weight"] = (
            torch.randn(rank, n_in, generator=gen) * n_in ** -0.5).bfloat16()
        tensors[f"diffusion_model.{module}.lora_up.weight"] = (
            torch.randn(n_out, rank, generator=gen) * (0.02 / rank ** 0.5)).bfloat16()
    Path(lora_path).parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tensors, str(lora_path))
    return {"layers": len(tensors) // 2, "bytes": sum(t.nbytes for t in tensors.values()), "rank": rank}


def layer_marker(fmt: str, name: str, shape) -> dict | None:
    """The marker of a layer in a file of format `fmt`, or None where the file keeps it bf16: a marker file
    quantizes the linears inside the blocks. Where ConvRot's group does not divide a layer's input (the full
    H3's AdaLN projections, 2688 wide), the ConvRot formats (int8_convrot, both 4-bit ones) write it as plain
    per-channel INT8; FP8 and NVFP4 (blocks of 16) have no such bound."""
    if FORMATS[fmt] is None or not (name.startswith("blocks.") and name.endswith(".weight") and len(shape) == 2):
        return None
    if "convrot_groupsize" in FORMATS[fmt] and shape[1] % CONVROT_GROUP:
        return PLAIN_INT8
    return FORMATS[fmt]


PLAIN_INT8 = {"format": "int8_tensorwise"}


def quantize(marker: dict, weight) -> dict:
    """{role: tensor} of one layer under `marker` (a layer_marker), from its bf16 weight: FP8 and INT8 as in
    the module's docstring, the 4-bit formats by their comfy-kitchen layout's own quantize and serialization
    (as upstream ComfyUI saves them)."""
    import torch
    if marker["format"] in KITCHEN_LAYOUTS:
        from comfy_kitchen.tensor import QuantizedTensor, get_layout_class
        layout, keys = KITCHEN_LAYOUTS[marker["format"]]
        qdata, params = get_layout_class(layout).quantize(weight, **{k: marker[k] for k in keys})
        return {key[len("w."):]: t.contiguous() for key, t in QuantizedTensor(qdata, layout, params).state_dict(
            "w.weight").items()}
    if marker["format"] == "float8_e4m3fn":
        w = weight.float()
        scale = w.abs().amax().clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
        return {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale.reshape(())}
    if marker["format"] == "int8_tensorwise":
        from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout
        convrot = bool(marker.get("convrot"))
        qdata, params = TensorWiseINT8Layout.quantize(weight, is_weight=True, per_channel=True, convrot=convrot,
                                                      **({"convrot_groupsize": CONVROT_GROUP} if convrot else {}))
        return {"weight": qdata, "weight_scale": params.scale.float()}
    raise ValueError(f"unknown marker {marker!r}")


def marker_tensor(marker: dict):
    import torch
    return torch.tensor(list(json.dumps(marker).encode()), dtype=torch.uint8)


@functools.lru_cache(maxsize=None)
def _roles(marker_json: str, shape: tuple, device: str) -> tuple:
    """(role, shape, dtype) of what `quantize` writes for a `shape` weight under a marker (as JSON), from a
    constant weight of that shape: layouts pad their scales (NVFP4's swizzled blocks to 128 rows), so no
    smaller probe tells the real extents. Cached per shape, and a model has few."""
    import torch
    tensors = quantize(json.loads(marker_json), torch.full(shape, 0.5, device=device, dtype=torch.bfloat16))
    return tuple((role, tuple(t.shape), t.dtype) for role, t in tensors.items())


def layer_plan(layout: str, name: str, shape) -> tuple[dict, bool] | None:
    """(marker, AWQ smoothing) of a layer in a file of `layout` (a FORMATS name, for a DiT, or a LAYOUTS name),
    or None where the file keeps it as stored."""
    if layout in LAYOUTS:
        return LAYOUTS[layout](name, shape)
    marker = layer_marker(layout, name, shape)
    return None if marker is None else (marker, False)


def layer_entries(fmt: str, name: str, shape, device, dtype=None) -> list[tuple[str, tuple, object]]:
    """The file's (name, shape, dtype) entries for one state_dict entry in a file of layout `fmt` (see
    layer_plan): quantized roles, AWQ scale and marker, or the tensor as stored (`dtype`, default bf16; fp32
    tensors are never quantized)."""
    import torch
    dtype = dtype or torch.bfloat16
    plan = layer_plan(fmt, name, shape) if dtype in (torch.bfloat16, torch.float16) else None
    if plan is None:
        return [(name, tuple(shape), dtype)]
    marker, awq = plan
    prefix = name[:-len(".weight")]
    entries = [(f"{prefix}.{role}", role_shape, role_dtype)
               for role, role_shape, role_dtype in _roles(json.dumps(marker), tuple(shape), str(device))]
    if awq:
        entries.append((f"{prefix}.pre_quant_scale", (shape[1],), torch.bfloat16))
    entries.append((f"{prefix}.comfy_quant", tuple(marker_tensor(marker).shape), torch.uint8))
    return entries


# ---- the MiniMax-H3 template's other files ----------------------------------

NVFP4_AWQ = {"format": "nvfp4", "full_precision_matrix_mult": True}
INT8_ROWS = {"format": "int8_tensorwise"}
_QWEN_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
_VAE_DECODER_LINEAR = re.compile(r"decoder\.transformer_blocks\.\d+\.(attn\.to_qkv|attn\.to_out|ff\.w1|ff\.w2)\.weight")


def qwen3vl_nvfp4_awq(name: str, shape) -> tuple[dict, bool] | None:
    """Comfy-Org's qwen3vl_32b_minimax_h3_nvfp4_awq: the 350 linears of the 50 language layers in NVFP4, computed
    dequantized (`full_precision_matrix_mult`), with AWQ's pre_quant_scale (bf16 [in]) on o_proj and down_proj
    only (the others' smoothing is folded into the norms before them), and the token embedding in INT8 with one
    scale per row; the vision tower and the norms bf16. That layout is 15,687,142,551 bytes at full size, the
    published file's size less its header."""
    if _QWEN_LINEAR.fullmatch(name):
        return NVFP4_AWQ, name.endswith(("o_proj.weight", "down_proj.weight"))
    return (INT8_ROWS, False) if name == "model.embed_tokens.weight" else None


def video_vae_int8_convrot(name: str, shape) -> tuple[dict, bool] | None:
    """Comfy-Org's minimax_h3_video_vae_int8_convrot: the linears of the ViT decoder's blocks INT8 ConvRot (the
    layers upstream builds with the file's operations), the rest fp16 as in its fp16 file."""
    return (FORMATS["int8_convrot"], False) if _VAE_DECODER_LINEAR.fullmatch(name) else None


ENCODER_PROBE_LAYERS = ("text_model.embeddings.token_embedding", "text_model.encoder.layers.0.self_attn.out_proj")


def encoder_probe(name: str, shape) -> tuple[dict, bool] | None:
    """A CLIP-L with the two layer kinds of qwen3vl_nvfp4_awq that a loader may not know (ENCODER_PROBE_LAYERS):
    the token embedding in INT8 rows, and one NVFP4 layer with AWQ's scale and `full_precision_matrix_mult`."""
    embedding, linear = (f"{layer}.weight" for layer in ENCODER_PROBE_LAYERS)
    if name == embedding:
        return INT8_ROWS, False
    return (NVFP4_AWQ, True) if name == linear else None


LAYOUTS = {"nvfp4_awq": qwen3vl_nvfp4_awq, "int8_convrot_decoder": video_vae_int8_convrot,
           "encoder_probe": encoder_probe, "plain": lambda name, shape: None}


@dataclass(frozen=True)
class Component:
    """A template file other than the DiT, built by upstream's own class on the meta device (the audio VAE on
    the CPU, for its filter buffers) and written in `layout` (LAYOUTS), the rest in `dtype`. `kind`:
    "text_encoder", "video_vae", "audio_vae" or "clip_l" (ComfyUI's CLIP-L, 123 M parameters); `norm_names`: norm
    modules init_kind would not recognise; `tiny`: tests/fixtures/bigdit_testnodes/tiny_vae.py's config, written
    into the file's metadata."""
    name: str
    kind: str
    layout: str
    dtype: str
    norm_names: tuple = ()
    tiny: dict | None = None


TINY_VAE = {"video_encoder_ch": 32, "video_decoder": {"num_layers": 1, "heads": 4, "dim_head": 64},
            "audio": {"encoder_dim": 8, "latent_dim": 64, "decoder_dim": 128}}
COMPONENTS = {c.name: c for c in (
    Component("qwen3vl_32b_nvfp4_awq", "text_encoder", "nvfp4_awq", "bfloat16",
              norm_names=("layernorm", "q_norm", "k_norm")),
    Component("video_vae_int8_convrot", "video_vae", "int8_convrot_decoder", "float16"),
    Component("audio_vae_fp32", "audio_vae", "plain", "float32"),
    Component("tiny_video_vae", "video_vae", "int8_convrot_decoder", "float16", tiny=TINY_VAE),
    Component("tiny_audio_vae", "audio_vae", "plain", "float32", tiny=TINY_VAE),
    Component("encoder_probe", "clip_l", "encoder_probe", "bfloat16",
              norm_names=("layer_norm1", "layer_norm2", "final_layer_norm")),
)}

# The turbo LoRAs (minimax_h3_fl2v_turbo_{8step,4step}_*_comfyui_bf16): 1,956,193,000 bytes, which is rank 128 on
# out_proj, fc1 and fc2 and rank 384 on the fused qkv_proj (q, k and v's rank-128 LoRAs side by side) of the 50
# blocks and the 2 token-refiner blocks, in bf16, and a header. Side by side, up is block-diagonal: q's outputs
# take only q's ranks. The size alone does not say whether the file's up matrices are so (a rank-384 LoRA trained on
# the fused projection is as large): QKV_LAYOUTS draws either.
TURBO_LORA_RANK = 128
QKV_LAYOUTS = ("side_by_side", "dense")
_TURBO_TARGET = re.compile(r"(token_refiner\.)?blocks\.\d+\.(attn\.qkv_proj|attn\.out_proj|mlp\.fc1|mlp\.fc2)")


def turbo_lora_targets(shapes: dict, rank: int = TURBO_LORA_RANK) -> list[tuple[str, int, int, int]]:
    """(module, out, in, rank) of the turbo LoRA's layers, from the DiT's {name: shape}."""
    return [(name[:-len(".weight")], shape[0], shape[1], 3 * rank if ".qkv_proj." in name else rank)
            for name, shape in shapes.items()
            if name.endswith(".weight") and _TURBO_TARGET.fullmatch(name[:-len(".weight")])]


def _subprocess(job: dict, comfyui, what: str) -> dict:
    result = subprocess.run([sys.executable, __file__, json.dumps(job)], cwd=comfyui, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{what} failed:\n{result.stdout[-3000:]}{result.stderr[-6000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def generate(spec: ModelSpec, path, comfyui, seed: int = 0, cpu: bool = False, fmt: str = "bf16") -> dict:
    """Write `spec`'s random model to `path` in format `fmt` (FORMATS); returns {"seconds", "bytes", "tensors",
    "params", "device", "format", "quantized_layers"}."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown model format {fmt!r} (known: {', '.join(FORMATS)})")
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    job = {"kind": "dit", "module": spec.module, "cls": spec.cls, "kwargs": spec.kwargs, "path": str(path),
           "comfyui": str(comfyui), "seed": seed, "cpu": cpu, "format": fmt, "keep_fp32": spec.keep_fp32}
    return _subprocess(job, comfyui, f"generating {path.name}")


def generate_component(component: Component, path, comfyui, seed: int = 0, cpu: bool = False) -> dict:
    """Write `component`'s random file to `path`; returns what generate returns."""
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    job = {"kind": "component", "component": component.__dict__, "path": str(path), "comfyui": str(comfyui),
           "seed": seed, "cpu": cpu}
    return _subprocess(job, comfyui, f"generating {path.name}")


def make_turbo_lora(model_path, lora_path, comfyui, rank: int = TURBO_LORA_RANK, seed: int = 0,
                    cpu: bool = False, qkv: str = "side_by_side") -> dict:
    """A random turbo LoRA (turbo_lora_targets, lora_up/lora_down names, no alpha: scale 1) for the DiT file at
    `model_path`, drawn on the GPU where there is one as make_lora draws: down ~ N(0, 1/in), up ~ N(0, 0.02^2 /
    rank), each layer's delta about 2% of a unit-variance weight. `qkv` (QKV_LAYOUTS): the fused qkv_proj's up
    block-diagonal (q, k and v's rank-`rank` LoRAs side by side, the off-diagonal blocks zero) or dense. Returns
    generate's keys and "layers", "rank", "qkv"."""
    if qkv not in QKV_LAYOUTS:
        raise ValueError(f"unknown qkv layout {qkv!r} (known: {', '.join(QKV_LAYOUTS)})")
    lora_path = Path(lora_path).resolve()
    lora_path.parent.mkdir(parents=True, exist_ok=True)
    job = {"kind": "lora", "model": str(Path(model_path).resolve()), "path": str(lora_path), "rank": rank,
           "comfyui": str(comfyui), "seed": seed, "cpu": cpu, "qkv": qkv}
    return _subprocess(job, comfyui, f"generating {lora_path.name}")


# ---- in the subprocess, with ComfyUI importable ------------------------------

def awq_scale(n: int, seed: int, device):
    """An AWQ-like per-input-channel smoothing scale, exp(N(0, 0.3^2)), in bf16."""
    import torch
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.exp(0.3 * torch.randn(n, device=device, generator=gen)).bfloat16()


def _tiny_vae_classes(config):
    """tests/fixtures/bigdit_testnodes/tiny_vae.py's tiny_classes, or nothing to do for a full-size file."""
    import contextlib
    if config is None:
        return contextlib.nullcontext()
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "fixtures" / "bigdit_testnodes" / "tiny_vae.py"
    spec = importlib.util.spec_from_file_location("bigdit_tiny_vae", path)
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    return tiny.tiny_classes(config)


def _build(job):
    """(state_dict entries [(name, shape)], stored dtypes {name: dtype}, constants {name: tensor}, layout,
    metadata) of the job's model, built by the host's own class without its weights."""
    import importlib

    import torch

    import comfy.ops
    ops = comfy.ops.disable_weight_init
    if job["kind"] == "dit":
        cls = getattr(importlib.import_module(job["module"]), job["cls"])
        # built in bf16, the modules the class pins to fp32 come out fp32; without keep_fp32 all is written bf16
        module = cls(**job["kwargs"], device="meta", dtype=torch.bfloat16, operations=ops)
        stored = {name: (torch.float32 if job["keep_fp32"] and t.dtype == torch.float32 else torch.bfloat16)
                  for name, t in module.state_dict().items()}
        return ([(n, tuple(t.shape)) for n, t in module.state_dict().items()], stored, {}, job["format"],
                {"bigdit_bench": f"random {job['cls']}, seed {job['seed']}, {job['format']}"})
    component = Component(**{**job["component"], "norm_names": tuple(job["component"]["norm_names"])})
    dtype = getattr(torch, component.dtype)
    constants = {}
    with _tiny_vae_classes(component.tiny):
        if component.kind == "text_encoder":
            from comfy.text_encoders.minimax import MiniMaxQwen3VL
            module = MiniMaxQwen3VL({}, dtype, "meta", ops)
        elif component.kind == "clip_l":
            import comfy.sd1_clip
            module = comfy.sd1_clip.SDClipModel(device="meta", dtype=dtype,
                                                model_options={"custom_operations": ops}).transformer
        elif component.kind == "video_vae":
            import comfy.ldm.minimax.vae as video
            with torch.device("meta"):
                module = video.MiniMaxH3VideoVAE(operations=ops)
            constants = {"latents_mean": torch.tensor(video.LATENTS_MEAN),
                         "latents_std": torch.tensor(video.LATENTS_STD)}
        else:
            import comfy.ldm.minimax.audio_vae as audio
            module = audio.MiniMaxH3AudioVAE()  # on the CPU (0.6 GB): its anti-aliasing filters are computed buffers
            constants = {name: t.clone() for name, t in module.named_buffers() if name.endswith(".filter")}
            size = module.latents_mean.shape
            constants.update(latents_mean=torch.zeros(size), latents_std=torch.ones(size))
    sd = module.state_dict()
    metadata = {"bigdit_bench": f"random {component.name}, seed {job['seed']}"}
    if component.tiny is not None:
        metadata["bigdit_tiny_vae"] = json.dumps(component.tiny)
    return ([(n, tuple(t.shape)) for n, t in sd.items()], dict.fromkeys(sd, dtype), constants, component.layout,
            metadata)


def _write_model(job, device):
    shapes, stored, constants, layout, metadata = _build(job)
    norm_names = tuple(job.get("component", {}).get("norm_names", ()))
    entries = [layer_entries(layout, name, shape, device, stored[name]) for name, shape in shapes]
    writer = StreamingSafetensorsWriter(job["path"], [e for layer in entries for e in layer], metadata=metadata)
    t_build = time.perf_counter()
    quantized = 0
    for index, ((name, shape), layer) in enumerate(zip(shapes, entries)):
        seed = job["seed"] * 1_000_003 + index
        if name in constants:
            weight = constants[name].to(device=device, dtype=stored[name])
        else:  # the same draw in every format: a marker file holds the bf16 file's weights, quantized
            weight = draw(name, shape, seed, device, stored[name], norm_names)
        if len(layer) == 1:
            writer.write(name, weight)
            continue
        marker, awq = layer_plan(layout, name, shape)
        tensors = {}
        if awq:  # the layer multiplies its input by the scale: its weight is stored divided by it
            tensors["pre_quant_scale"] = awq_scale(shape[1], seed, device)
            weight = (weight.float() / tensors["pre_quant_scale"].float()).to(weight.dtype)
        tensors.update(quantize(marker, weight), comfy_quant=marker_tensor(marker))
        prefix = name[:-len(".weight")]
        for entry_name, _, _ in layer:
            writer.write(entry_name, tensors[entry_name[len(prefix) + 1:]])
        quantized += 1
    writer.close()
    return {"write_seconds": round(time.perf_counter() - t_build, 2), "bytes": writer.total_bytes,
            "tensors": len(shapes), "params": sum(math.prod(s) for _, s in shapes), "format": layout,
            "quantized_layers": quantized}


def _write_lora(job, device):
    import safetensors
    import torch
    with safetensors.safe_open(job["model"], "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    targets = turbo_lora_targets(shapes, job["rank"])
    entries = []
    for module, n_out, n_in, rank in targets:
        entries += [(f"diffusion_model.{module}.lora_up.weight", (n_out, rank), torch.bfloat16),
                    (f"diffusion_model.{module}.lora_down.weight", (rank, n_in), torch.bfloat16)]
    qkv = job.get("qkv", "side_by_side")
    writer = StreamingSafetensorsWriter(job["path"], entries, metadata={"bigdit_bench": f"random turbo LoRA, "
                                                                                      f"seed {job['seed']}, qkv {qkv}"})
    gen = torch.Generator(device=device).manual_seed(job["seed"])
    for module, n_out, n_in, rank in targets:
        up, terms = torch.randn(n_out, rank, device=device, generator=gen), rank  # terms: each output's delta's
        if rank != job["rank"] and qkv == "side_by_side":  # the fused qkv: q, k and v's ranks on their own outputs
            blocks, terms = rank // job["rank"], job["rank"]
            up *= torch.block_diag(*[torch.ones(n_out // blocks, terms, device=device)] * blocks)
        writer.write(f"diffusion_model.{module}.lora_up.weight", (up * (0.02 / terms ** 0.5)).bfloat16())
        writer.write(f"diffusion_model.{module}.lora_down.weight",
                     (torch.randn(rank, n_in, device=device, generator=gen) * n_in ** -0.5).bfloat16())
    writer.close()
    return {"bytes": writer.total_bytes, "tensors": len(entries), "layers": len(targets), "rank": job["rank"],
            "qkv": qkv, "params": sum(math.prod(s) for _, s, _ in entries), "format": "lora_bf16",
            "quantized_layers": 0}


def _main(job):
    t0 = time.perf_counter()
    sys.path.insert(0, job["comfyui"])
    from comfy.cli_args import args
    if job["cpu"]:
        args.cpu = True
    import torch
    device = torch.device("cuda" if torch.cuda.is_available() and not job["cpu"] else "cpu")
    info = _write_lora(job, device) if job["kind"] == "lora" else _write_model(job, device)
    print(json.dumps({"seconds": round(time.perf_counter() - t0, 2), "device": str(device), **info}))


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
