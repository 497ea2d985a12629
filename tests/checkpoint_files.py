"""Quantized checkpoint writers for the loader tests.

From a plain state dict they write:
- ComfyUI scaled_fp8 files (`write_scaled_fp8`, the layout of Comfy-Org's `*_fp8_scaled` files);
- ComfyUI per-layer marker files, markers as `<layer>.comfy_quant` uint8 JSON
  tensors or in the `_quantization_metadata` header, any mix of formats, with
  tensors quantized by the pack's methods (comfy-kitchen layouts);
- Quanto qint8 files with our own writer (`write_quanto`), and with the real
  one (`write_quanto_reference`: optimum-quanto quantizes, mmgp writes the
  self-describing metadata) run in a subprocess, as those packages patch torch;
- marker files written by a real converter, convert_to_quant 1.3.4's command
  line (`write_converted`, also in a subprocess, on CPU);
- marker files written by comfy-kitchen itself (`write_kitchen`: its layouts'
  own quantize and QuantizedTensor serialization, markers as upstream ComfyUI
  writes them), and ModelOpt's NVFP4 AWQ layout (`write_nvfp4_awq`: a
  `pre_quant_scale` per input channel, the weight quantized divided by it).

Bad files are made from good ones by `edit_checkpoint` (rewrite tensors or
metadata) and `truncate`.
"""
import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import safetensors.torch
import torch
from safetensors import safe_open

# Marker format -> the pack's registry name of the method that writes it.
WRITERS = {"int8_tensorwise": "int8_tensorwise", "float8_e4m3fn": "float8_e4m3fn", "nvfp4": "nvfp4", "mxfp8": "mxfp8"}


def load(path):
    """(tensors, metadata) of a safetensors file."""
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}


def write_lora(path, targets: dict, seed: int, rank: int = 4, scale: float = 0.3) -> str:
    """A random LoRA on `targets` {module name: (out_features, in_features)} of a diffusion model,
    in ComfyUI's lora_up/lora_down naming; returns the file name."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (out_f, in_f) in targets.items():
        tensors[f"diffusion_model.{module}.lora_up.weight"] = torch.randn(out_f, rank, generator=gen) * scale
        tensors[f"diffusion_model.{module}.lora_down.weight"] = torch.randn(rank, in_f, generator=gen) * scale
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tensors, str(path))
    return path.name


def write_loha(path, targets: dict, seed: int, rank: int = 4, scale: float = 0.3) -> str:
    """A random LoHa (LyCORIS Hadamard product, which a LoRA branch cannot compute) on `targets` {module name:
    (out_features, in_features)}; returns the file name."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (out_f, in_f) in targets.items():
        for i in (1, 2):
            tensors[f"diffusion_model.{module}.hada_w{i}_a"] = torch.randn(out_f, rank, generator=gen) * scale
            tensors[f"diffusion_model.{module}.hada_w{i}_b"] = torch.randn(rank, in_f, generator=gen) * scale
        tensors[f"diffusion_model.{module}.alpha"] = torch.tensor(float(rank))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tensors, str(path))
    return path.name


def marker_tensor(marker: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(marker).encode()), dtype=torch.uint8)


def write_markers(src, dst, layers: dict, form="tensor", per_tensor_fp8=False):
    """Quantize `layers` {name: marker dict} of the plain file `src` into `dst`.

    form: "tensor" (comfy_quant tensors), "header" (_quantization_metadata) or
    "both" (each layer's marker in both forms). per_tensor_fp8 stores FP8
    weight scales per tensor (ComfyUI's scaled-fp8 layout) instead of per channel.
    """
    from bigdit.quant.registry import get_method
    sd, metadata = load(src)
    for name, marker in layers.items():
        weight = sd.pop(f"{name}.weight").float()
        params = marker.get("params")
        flags = {**(params if isinstance(params, dict) else {}), **marker}
        options = {k: v for k, v in flags.items() if k in ("convrot", "convrot_groupsize")}
        if marker["format"] == "float8_e4m3fn" and per_tensor_fp8:
            scale = weight.abs().amax() / torch.finfo(torch.float8_e4m3fn).max
            tensors = {"weight": (weight / scale).to(torch.float8_e4m3fn), "weight_scale": scale.reshape(())}
        else:
            tensors = get_method(WRITERS[marker["format"]], **options).quantize_weight(weight)
        for role, tensor in tensors.items():
            sd[f"{name}.{role}"] = tensor.contiguous()
        if form in ("tensor", "both"):
            sd[f"{name}.comfy_quant"] = marker_tensor(marker)
    if form in ("header", "both"):
        metadata = {**metadata, "_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}
    save(sd, dst, metadata)
    return Path(dst)


# Marker format -> comfy-kitchen layout (upstream ComfyUI's QUANT_ALGOS) and the keys upstream's state_dict adds.
KITCHEN_LAYOUTS = {"convrot_w4a4": ("TensorCoreConvRotW4A4Layout", ("convrot_groupsize",)),
                   "asym_w4a8_int8": ("AsymW4A8Int8Layout", ("group_size", "convrot_groupsize")),
                   "nvfp4": ("TensorCoreNVFP4Layout", ())}


def write_kitchen(src, dst, layers: dict, form="tensor"):
    """Quantize `layers` {name: marker dict} of `src` with comfy-kitchen's own layouts (not the pack's methods):
    the layout's `quantize` with the marker's options, its QuantizedTensor's `state_dict` for the tensors, the
    marker as upstream ComfyUI's `_quantized_weight_state_dict` writes it. Returns (the file, {layer: the
    kitchen QuantizedTensor written})."""
    from comfy_kitchen.tensor import QuantizedTensor, get_layout_class
    sd, metadata = load(src)
    weights = {}
    for name, marker in layers.items():
        layout, keys = KITCHEN_LAYOUTS[marker["format"]]
        weight = sd.pop(f"{name}.weight")
        qdata, params = get_layout_class(layout).quantize(weight, **{k: marker[k] for k in keys if k in marker})
        weights[name] = QuantizedTensor(qdata, layout, params)
        sd.update({k: v.contiguous() for k, v in weights[name].state_dict(f"{name}.weight").items()})
        if form in ("tensor", "both"):
            sd[f"{name}.comfy_quant"] = marker_tensor(marker)
    if form in ("header", "both"):
        metadata = {**metadata, "_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}
    save(sd, dst, metadata)
    return Path(dst), weights


def awq_scale(width: int, seed: int) -> torch.Tensor:
    """A per-input-channel smoothing scale as AWQ finds them: positive, a few channels far from 1."""
    gen = torch.Generator().manual_seed(seed)
    return torch.exp(torch.randn(width, generator=gen) * 0.3)


def write_nvfp4_awq(src, dst, layers, seed=0, dtype=torch.bfloat16):
    """ModelOpt's NVFP4 AWQ export, as upstream ComfyUI and comfy-kitchen read Comfy-Org's `*_nvfp4_awq` text
    encoders: per layer `weight` / `weight_scale` / `weight_scale_2` of kitchen's NVFP4 layout for the weight
    divided by `pre_quant_scale` [in_features] (bf16), which the layer multiplies its input by, and the marker
    {"format": "nvfp4"} as a comfy_quant tensor. Returns {layer: pre_quant_scale}."""
    from comfy_kitchen.tensor import QuantizedTensor, get_layout_class
    sd, metadata = load(src)
    scales = {}
    for i, name in enumerate(layers):
        weight = sd.pop(f"{name}.weight").float()
        scale = awq_scale(weight.shape[1], seed + i).to(dtype)
        qdata, params = get_layout_class("TensorCoreNVFP4Layout").quantize(weight / scale.float())
        sd.update({k: v.contiguous() for k, v in QuantizedTensor(qdata, "TensorCoreNVFP4Layout", params)
                   .state_dict(f"{name}.weight").items()})
        sd[f"{name}.pre_quant_scale"] = scale
        sd[f"{name}.comfy_quant"] = marker_tensor({"format": "nvfp4"})
        scales[name] = scale
    save(sd, dst, metadata)
    return scales


_QWEN3_06B = """
import sys
import torch
from comfy.cli_args import args
args.cpu = not torch.cuda.is_available()
import comfy.ops, comfy.text_encoders.llama, safetensors.torch
with torch.device("meta"):
    model = comfy.text_encoders.llama.Qwen3_06B({}, torch.bfloat16, "meta", comfy.ops.manual_cast)
gen, sd = torch.Generator().manual_seed(0), {}
for name, ref in model.state_dict().items():
    if ref.dim() >= 2:
        sd[name] = ((torch.rand(ref.shape, generator=gen) * 2 - 1) * ref.shape[-1] ** -0.5).to(torch.bfloat16)
    else:
        sd[name] = torch.ones(ref.shape, dtype=torch.bfloat16)
safetensors.torch.save_file(sd, sys.argv[1])
"""
QWEN3_06B_NVFP4_LAYERS = [f"model.layers.{b}.{name}" for b in range(2) for name in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


def write_qwen3_06b_nvfp4_awq(dst, python, comfyui):
    """A random Qwen3-0.6B text encoder (upstream's smallest whose loader reads per-layer markers; 0.6B parameters,
    bf16, made by upstream's own model class with `python` in its folder `comfyui`) with its first two blocks'
    Linear layers (QWEN3_06B_NVFP4_LAYERS) in NVFP4 with AWQ scales, as Comfy-Org's H3 encoder stores its layers."""
    plain = Path(dst).with_suffix(".plain.safetensors")
    subprocess.run([str(python), "-c", _QWEN3_06B, str(plain)], cwd=comfyui, check=True, timeout=600)
    write_nvfp4_awq(plain, dst, QWEN3_06B_NVFP4_LAYERS)
    plain.unlink()


def fp8_linear_names(sd) -> list[str]:
    """The Linear layers of a plain state dict: every 2-D float `.weight`."""
    return [k[:-len(".weight")] for k, v in sd.items() if k.endswith(".weight") and v.dim() == 2
            and v.is_floating_point()]


def write_scaled_fp8(src, dst, layers=None, scale_input=None, full_precision=False):
    """ComfyUI's scaled_fp8 layout from the plain file `src`: a `scaled_fp8` marker (E4M3, empty, or two
    elements with `full_precision`), and for each of `layers` (default: every Linear) an E4M3 weight with a
    per-tensor fp32 `scale_weight` (absmax / 448) and, if `scale_input` is given, that fp32 `scale_input`."""
    sd, metadata = load(src)
    for name in fp8_linear_names(sd) if layers is None else layers:
        weight = sd[f"{name}.weight"].float()
        scale = weight.abs().amax() / torch.finfo(torch.float8_e4m3fn).max
        sd[f"{name}.weight"] = (weight / scale).to(torch.float8_e4m3fn)
        sd[f"{name}.scale_weight"] = scale.reshape(()).float()
        if scale_input is not None:
            sd[f"{name}.scale_input"] = torch.tensor(float(scale_input))
    sd["scaled_fp8"] = torch.zeros(2 if full_precision else 0, dtype=torch.float8_e4m3fn)
    save(sd, dst, metadata)
    return Path(dst)


def quanto_map(prefixes, activations="none", weights="qint8") -> str:
    qmap = {p: {"weights": weights, "activations": activations} for p in prefixes}
    return base64.b64encode(json.dumps(qmap).encode()).decode()


def write_quanto(src, dst, prefixes):
    """Our own writer of the mmgp/DeepBeepMeep layout: per-channel qint8, unit auxiliary scales."""
    sd, metadata = load(src)
    for prefix in prefixes:
        weight = sd.pop(f"{prefix}.weight")
        scale = weight.abs().amax(dim=1, keepdim=True) / 127
        sd[f"{prefix}.weight._data"] = torch.round(weight / scale).clamp(-128, 127).to(torch.int8)
        sd[f"{prefix}.weight._scale"] = scale
        sd[f"{prefix}.input_scale"] = torch.ones((), dtype=weight.dtype)
        sd[f"{prefix}.output_scale"] = torch.ones((), dtype=weight.dtype)
    save(sd, dst, {**metadata, "quantization_format": "quanto", "quantization_map_base64": quanto_map(prefixes)})
    return Path(dst)


def write_quanto_reference(src, dst, prefixes, activations=None):
    """The real writers: optimum-quanto quantizes (weights qint8, activations as given), mmgp.safetensors2
    writes the file."""
    job = json.dumps({"src": str(src), "dst": str(dst), "prefixes": list(prefixes), "activations": activations})
    result = subprocess.run([sys.executable, __file__, job], capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"optimum-quanto/mmgp writer failed:\n{result.stdout}{result.stderr}")
    return Path(dst)


# convert_to_quant 1.3.4 command lines for the formats it writes as ComfyUI markers. --simple skips its
# learned rounding (minutes per layer on CPU); the file layout is the same.
# No release writes an int4 format a host loads (all 27, 1.0.1 to 1.3.4, read): only 1.0.7 writes int4, as its
# own "sdnq" marker (SD.Next's grouped layout, dropped in 1.1.0), which neither host nor the pack reads. So
# the W4A4 / W4A8 fixtures come from comfy-kitchen's own quantizers (write_kitchen).
CONVERTER_MODES = {
    "int8_row_convrot": ["--int8", "--scaling_mode", "row", "--convrot", "--convrot-group-size", "256"],
    "int8_row": ["--int8", "--scaling_mode", "row"],
    "int8_tensor": ["--int8", "--scaling_mode", "tensor"],
    "fp8": ["--scaling_mode", "tensor"],
    "nvfp4": ["--nvfp4"],
}


def write_converted(src, files: dict):
    """`src` quantized by convert_to_quant for each {dst: mode} (modes: CONVERTER_MODES), markers in both forms.

    Its command line is parsed and run by its own `get_parser` / `run_conversion` (what its `main` does), all
    files in one subprocess: importing the converter costs several seconds, a conversion of a tiny model less.
    """
    jobs = [[str(dst), "-i", str(src), "-o", str(dst), *CONVERTER_MODES[mode], "--comfy_quant",
             "--save-quant-metadata", "--simple", "--device", "cpu"] for dst, mode in files.items()]
    result = subprocess.run([sys.executable, __file__, json.dumps({"kind": "convert", "jobs": jobs})],
                            capture_output=True, text=True)
    missing = [dst for dst in files if not Path(dst).exists()]
    if result.returncode or missing:
        raise RuntimeError(f"convert_to_quant failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return {dst: Path(dst) for dst in files}


def converter_dequantized(sd, name):
    """The fp32 [out, in] weight a convert_to_quant layer stands for, decoded with the converter's own code
    (NVFP4 through its PyTorch decoder, ConvRot undone with its Hadamard matrix)."""
    from convert_to_quant.converters.nvfp4_converter import NVFP4Converter
    from convert_to_quant.utils.convrot import build_hadamard
    marker = json.loads(sd[f"{name}.comfy_quant"].numpy().tobytes())
    q, scale = sd[f"{name}.weight"], sd[f"{name}.weight_scale"]
    if marker["format"] == "nvfp4":
        return NVFP4Converter(optimize=False)._dequantize_pytorch(q, sd[f"{name}.weight_scale_2"], scale,
                                                                  torch.float32)
    scale = scale.double()
    weight = q.double() * (scale.reshape(-1, 1) if scale.numel() > 1 else scale)
    if marker.get("convrot"):
        group = marker["convrot_groupsize"]
        # the converter stores W @ H^T per group of inputs; H is orthogonal
        weight = weight.reshape(weight.shape[0], -1, group) @ build_hadamard(group, dtype=torch.float64)
    return weight.reshape(q.shape).float()


def write_dequantized(converted, dst):
    """A plain bf16 file of what a convert_to_quant file stands for: its layers dequantized, the rest as stored."""
    sd, metadata = load(converted)
    layers = [key[:-len(".comfy_quant")] for key in sd if key.endswith(".comfy_quant")]
    plain = {key: value for key, value in sd.items()
             if not any(key.startswith(f"{layer}.") and not key.endswith(".bias") for layer in layers)}
    for layer in layers:
        plain[f"{layer}.weight"] = converter_dequantized(sd, layer).to(torch.bfloat16)
    save(plain, dst, {k: v for k, v in metadata.items() if k != "_quantization_metadata"})
    return Path(dst)


def _converter(job):
    import gc
    from convert_to_quant.cli.main import get_parser, run_conversion
    # It calls gc.collect() per layer, which walks every object torch's import made (most of its time here):
    # frozen, those are skipped.
    gc.freeze()
    for _dst, *argv in job["jobs"]:
        run_conversion(get_parser().parse_args(argv))


def save(sd, dst, metadata=None):
    safetensors.torch.save_file(sd, str(dst), metadata=metadata or None)


def edit_checkpoint(src, dst, tensors=None, drop=(), metadata=None):
    """Copy `src` to `dst` with tensors replaced/added, keys dropped, metadata merged."""
    sd, meta = load(src)
    for key in drop:
        sd.pop(key)
    sd.update(tensors or {})
    save(sd, dst, {**meta, **(metadata or {})})
    return Path(dst)


def truncate(src, dst, missing_bytes):
    data = Path(src).read_bytes()
    Path(dst).write_bytes(data[:len(data) - missing_bytes])
    return Path(dst)


def _reference_writer(job):
    from mmgp import safetensors2
    from optimum.quanto import freeze, qint8, quantization_map, quantize
    from torch import nn

    sd, _ = load(job["src"])
    root = nn.Module()
    for prefix in job["prefixes"]:
        weight = sd.pop(f"{prefix}.weight")
        bias = sd.pop(f"{prefix}.bias", None)
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if bias is not None:
                linear.bias.copy_(bias)
        parent = root
        *path, leaf = prefix.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(leaf, linear)
    quantize(root, weights=qint8, activations={"qint8": qint8, None: None}[job["activations"]])
    freeze(root)
    out = {**sd, **root.state_dict()}
    safetensors2.torch_write_file(out, job["dst"], quantization_map=quantization_map(root))


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    _job = json.loads(sys.argv[1])
    (_converter if _job.get("kind") == "convert" else _reference_writer)(_job)
