"""Bad checkpoints, each written from a plain Wan-shaped file (any width), and what refusing it must say.

`BAD_FILES[case] = (writer, words, layer)`: `writer(src, workdir, dst)` writes
the bad file to `dst` (intermediate good files go to `workdir`); the loader's
error must start with the file's name and contain `words` and `layer`. The
unit tests inspect each file directly; the integration tests load each one
through a real ComfyUI and check that the server keeps serving.
"""
import json
import struct
from pathlib import Path

import torch

from checkpoint_files import (edit_checkpoint, load, marker_tensor, quanto_map, truncate, write_kitchen, write_markers,
                              write_nvfp4_awq, write_quanto, write_scaled_fp8)

from bigdit.loaders.markers import MAX_MARKER_DEPTH
from bigdit.loaders.safetensors_header import MAX_METADATA_BYTES

LAYER = "blocks.0.ffn.0"
QUANTO_LAYERS = ["blocks.0.ffn.0", "blocks.0.ffn.2"]


def _int8_file(src, workdir):
    return write_markers(src, workdir / "int8.safetensors",
                         {LAYER: {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 64}})


def _nvfp4_file(src, workdir):
    return write_markers(src, workdir / "nvfp4.safetensors", {LAYER: {"format": "nvfp4"}})


def _quanto_file(src, workdir):
    return write_quanto(src, workdir / "quanto.safetensors", QUANTO_LAYERS)


def _fp8_file(src, workdir):
    return write_markers(src, workdir / "fp8.safetensors", {LAYER: {"format": "float8_e4m3fn"}})


def _scaled_fp8_file(src, workdir):
    return write_scaled_fp8(src, workdir / "scaled_fp8.safetensors", [LAYER, "blocks.0.ffn.2"])


def bad_scaled(tensors=None, drop=()):
    """A bad-file writer: the scaled_fp8 file with tensors replaced (a callable gets the file's tensors)."""
    def write(src, workdir, dst):
        path = _scaled_fp8_file(src, workdir)
        return edit_checkpoint(path, dst, tensors(load(path)[0]) if callable(tensors) else tensors, drop)
    return write


def write_raw(dst, header: bytes, data: bytes = b""):
    """A file with this exact header text (for headers no safetensors writer would produce)."""
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + data)
    return dst


def relaid(shift=0, trailing=0):
    """A bad-file writer: the plain file with LAYER's weight moved to the end of the data section, `shift` bytes
    past the end of the tensor before it (negative: inside that tensor), then `trailing` bytes no tensor holds."""
    def write(src, workdir, dst):
        raw = Path(src).read_bytes()
        (size,) = struct.unpack("<Q", raw[:8])
        header, data = json.loads(raw[8:8 + size]), raw[8 + size:]
        moved = f"{LAYER}.weight"
        keys = sorted((key for key in header if key not in ("__metadata__", moved)),
                      key=lambda key: header[key]["data_offsets"]) + [moved]
        out = bytearray()
        for key in keys:
            begin, end = header[key]["data_offsets"]
            at = len(out) + (shift if key == moved else 0)
            out += bytes(max(0, at - len(out)))
            out[at:] = data[begin:end]
            header[key]["data_offsets"] = [at, at + end - begin]
        return write_raw(dst, json.dumps(header).encode(), bytes(out) + bytes(trailing))
    return write


def _with_scale(writer, role, change):
    """A bad-file writer: the file of `writer` with LAYER's `role` tensor replaced by change(tensor)."""
    def write(src, workdir, dst):
        path = writer(src, workdir)
        return edit_checkpoint(path, dst, {f"{LAYER}.{role}": change(_tensor(path, f"{LAYER}.{role}").clone())})
    return write


def _set_row(value):
    def change(scale):
        scale[3] = value if not callable(value) else value(scale[3])
        return scale
    return change


def _tensor(path, key):
    return load(path)[0][key]


def bad_truncated(src, workdir, dst):
    return truncate(_int8_file(src, workdir), dst, 1000)


def bad_marker_json(src, workdir, dst):
    return edit_checkpoint(_int8_file(src, workdir), dst,
                           {f"{LAYER}.comfy_quant": torch.tensor(list(b'{"format": "int8_'), dtype=torch.uint8)})


def bad_unknown_format(src, workdir, dst):
    return edit_checkpoint(_int8_file(src, workdir), dst,
                           {f"{LAYER}.comfy_quant": marker_tensor({"format": "float3_e1m1"})})


def bad_shape(src, workdir, dst):
    path = _int8_file(src, workdir)
    rows = _tensor(path, f"{LAYER}.weight").shape[0]
    return edit_checkpoint(path, dst, {f"{LAYER}.weight_scale": torch.ones(rows + 1, 1)})


def bad_dtype(src, workdir, dst):
    path = _int8_file(src, workdir)
    weight = _tensor(path, f"{LAYER}.weight")
    return edit_checkpoint(path, dst, {f"{LAYER}.weight": torch.zeros(weight.shape, dtype=torch.bfloat16)})


def bad_quanto_activations(src, workdir, dst):
    return edit_checkpoint(_quanto_file(src, workdir), dst, metadata={
        "quantization_map_base64": quanto_map(QUANTO_LAYERS, activations="qint8")})


def bad_quanto_scale(src, workdir, dst):
    return edit_checkpoint(_quanto_file(src, workdir), dst,
                           {f"{LAYER}.input_scale": torch.tensor(0.5, dtype=torch.bfloat16)})


def bad_prefix_set(src, workdir, dst):
    return edit_checkpoint(_quanto_file(src, workdir), dst, metadata={"quantization_map_base64": quanto_map([LAYER])})


def bad_oversized_metadata(src, workdir, dst):
    return edit_checkpoint(_int8_file(src, workdir), dst, metadata={"notes": "x" * (MAX_METADATA_BYTES + 1)})


def bad_nan_scale(src, workdir, dst):
    path = _int8_file(src, workdir)
    scale = _tensor(path, f"{LAYER}.weight_scale").clone()
    scale[3] = float("nan")
    return edit_checkpoint(path, dst, {f"{LAYER}.weight_scale": scale})


def bad_nan_block_scale(src, workdir, dst):
    path = _nvfp4_file(src, workdir)
    block = _tensor(path, f"{LAYER}.weight_scale").clone()
    block.view(torch.uint8)[5, 1] = 0x7F  # E4M3FN NaN
    return edit_checkpoint(path, dst, {f"{LAYER}.weight_scale": block})


def bad_negative_block_scale(src, workdir, dst):
    path = _nvfp4_file(src, workdir)
    block = _tensor(path, f"{LAYER}.weight_scale").clone()
    block.view(torch.uint8)[3, 0] = 0xB8  # E4M3FN -1.0: the byte range is read first, a sign bit sends it to the decode
    return edit_checkpoint(path, dst, {f"{LAYER}.weight_scale": block})


def bad_missing_companion(src, workdir, dst):
    return edit_checkpoint(_nvfp4_file(src, workdir), dst, drop=[f"{LAYER}.weight_scale_2"])


def bad_unknown_companion(src, workdir, dst):
    """A companion no format stores (pre_quant_scale was one until NVFP4 took AWQ's: now it loads)."""
    path = _nvfp4_file(src, workdir)
    width = _tensor(src, f"{LAYER}.weight").shape[1]
    return edit_checkpoint(path, dst, {f"{LAYER}.weight_zero_point": torch.zeros(width)})


def _awq_file(src, workdir):
    path = workdir / "awq.safetensors"
    write_nvfp4_awq(src, path, [LAYER])
    return path


def _kitchen_file(fmt, **options):
    def write(src, workdir):
        return write_kitchen(src, workdir / f"{fmt}.safetensors", {LAYER: {"format": fmt, **options}})[0]
    return write


_w4a4_file = _kitchen_file("convrot_w4a4", convrot_groupsize=64)
_w4a8_file = _kitchen_file("asym_w4a8_int8", group_size=16, convrot_groupsize=64)


def _with_marker(writer, marker):
    """A bad-file writer: the file of `writer` with LAYER's marker replaced."""
    def write(src, workdir, dst):
        return edit_checkpoint(writer(src, workdir), dst, {f"{LAYER}.comfy_quant": marker_tensor(marker)})
    return write


def bad_e8m0_weight(src, workdir, dst):
    """An MXFP8 block scale (E8M0) stored where the plain file has a layer's weight."""
    path = write_markers(src, workdir / "mxfp8.safetensors", {LAYER: {"format": "mxfp8"}})
    return edit_checkpoint(src, dst, {f"{LAYER}.weight": _tensor(path, f"{LAYER}.weight_scale")})


def bad_conflicting_markers(src, workdir, dst):
    meta = {"format_version": "1.0", "layers": {LAYER: {"format": "float8_e4m3fn"}}}
    return edit_checkpoint(_int8_file(src, workdir), dst, metadata={"_quantization_metadata": json.dumps(meta)})


def bad_fp8_input_scale(value):
    def write(src, workdir, dst):
        return edit_checkpoint(_fp8_file(src, workdir), dst, {f"{LAYER}.input_scale": torch.tensor(float(value))})
    return write


def bad_conflicting_convrot(src, workdir, dst):
    meta = {"format_version": "1.0", "layers": {LAYER: {"format": "int8_tensorwise"}}}
    return edit_checkpoint(_int8_file(src, workdir), dst, metadata={"_quantization_metadata": json.dumps(meta)})


def bad_conflicting_group_size(src, workdir, dst):
    meta = {"format_version": "1.0", "layers": {LAYER: {"format": "int8_tensorwise", "convrot": True,
                                                        "convrot_groupsize": 16}}}
    return edit_checkpoint(_int8_file(src, workdir), dst, metadata={"_quantization_metadata": json.dumps(meta)})


def bad_nested_header(src, workdir, dst):
    return write_raw(dst, b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")


def bad_nested_marker(src, workdir, dst):
    """Deeper than Python's recursion limit, within the marker size bound."""
    text = b'{"format": "int8_tensorwise", "x": ' + b"[" * 2000 + b"]" * 2000 + b"}"
    return edit_checkpoint(_int8_file(src, workdir), dst,
                           {f"{LAYER}.comfy_quant": torch.tensor(list(text), dtype=torch.uint8)})


def bad_deep_marker(src, workdir, dst):
    nested = "x"
    for _ in range(MAX_MARKER_DEPTH + 1):
        nested = [nested]
    return edit_checkpoint(_int8_file(src, workdir), dst, {f"{LAYER}.comfy_quant": marker_tensor(
        {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 64, "x": nested})})


def bad_nested_quanto_map(src, workdir, dst):
    import base64
    text = b'{"' + LAYER.encode() + b'": {"weights": "qint8", "activations": "none", "x": ' + b"[" * 100_000 \
        + b"]" * 100_000 + b"}}"
    return edit_checkpoint(_quanto_file(src, workdir), dst,
                           metadata={"quantization_map_base64": base64.b64encode(text).decode()})


def bad_oversized_marker(src, workdir, dst):
    text = json.dumps({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 64,
                       "notes": "x" * 10_000_000}).encode()
    return edit_checkpoint(_int8_file(src, workdir), dst,
                           {f"{LAYER}.comfy_quant": torch.frombuffer(bytearray(text), dtype=torch.uint8)})


def many_markers_file(dst, n, form="tensor", scales=True):
    """n int8 layers with zero-size weight (and, with `scales`, weight_scale) tensors, marked in `form`
    ("tensor" or "header"): a valid file that is all header."""
    marker = {"format": "int8_tensorwise"}
    text = json.dumps(marker).encode()
    header, data = {}, bytearray()
    for i in range(n):
        layer = f"blocks.{i}.linear"
        if form == "tensor":
            header[f"{layer}.comfy_quant"] = {"dtype": "U8", "shape": [len(text)],
                                              "data_offsets": [len(data), len(data) + len(text)]}
            data += text
        header[f"{layer}.weight"] = {"dtype": "I8", "shape": [0, 0], "data_offsets": [len(data), len(data)]}
        if scales:
            header[f"{layer}.weight_scale"] = {"dtype": "F32", "shape": [0], "data_offsets": [len(data), len(data)]}
    if form == "header":
        layers = {f"blocks.{i}.linear": marker for i in range(n)}
        header["__metadata__"] = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}
    return write_raw(dst, json.dumps(header).encode(), bytes(data))


BAD_FILES = {
    # name: (writer, expected words, layer named)
    "truncated": (bad_truncated, "truncated file", f"{LAYER}.weight"),
    "bad marker JSON": (bad_marker_json, "bad marker JSON", LAYER),
    "unknown format": (bad_unknown_format, "unsupported quantization format 'float3_e1m1'", LAYER),
    "shape mismatch": (bad_shape, "shape mismatch: int8_tensorwise weight_scale", LAYER),
    "dtype mismatch": (bad_dtype, "dtype mismatch: int8_tensorwise weight must be I8, found BF16", LAYER),
    "activation-quantized Quanto": (bad_quanto_activations, "activation quantization is not supported", LAYER),
    "non-unit Quanto scale": (bad_quanto_scale, "non-unit Quanto input_scale", LAYER),
    "prefix-set mismatch": (bad_prefix_set, "prefix-set mismatch", "blocks.0.ffn.2"),
    # the header is refused before any layer is read: the error names the oversized key
    "oversized metadata": (bad_oversized_metadata, "oversized metadata", "'notes'"),
    "NaN scale": (bad_nan_scale, "non-finite (NaN/Inf) values in int8_tensorwise weight_scale", LAYER),
    "NaN block scale": (bad_nan_block_scale, "non-finite (NaN/Inf) values in nvfp4 weight_scale", LAYER),
    "negative block scale": (bad_negative_block_scale, "negative values in nvfp4 weight_scale (min -1)", LAYER),
    "missing companion": (bad_missing_companion, "missing tensor(s) weight_scale_2", LAYER),
    "unknown companion": (bad_unknown_companion, "unsupported companion tensor(s) for nvfp4: weight_zero_point", LAYER),
    "conflicting markers": (bad_conflicting_markers, "conflicting markers", LAYER),
    "conflicting ConvRot": (bad_conflicting_convrot, "they differ in convrot", LAYER),
    "conflicting group size": (bad_conflicting_group_size, "they differ in convrot_groupsize", LAYER),
    # scales no quantizer writes
    "huge int8 scale": (_with_scale(_int8_file, "weight_scale", lambda s: torch.full_like(s, 1e30)),
                        "int8_tensorwise weight_scale too large (max 1e+30)", LAYER),
    "zero int8 scale": (_with_scale(_int8_file, "weight_scale", _set_row(0.0)),
                        "zero values in int8_tensorwise weight_scale", LAYER),
    "negative int8 scale": (_with_scale(_int8_file, "weight_scale", _set_row(lambda v: -v)),
                            "negative values in int8_tensorwise weight_scale", LAYER),
    "zero Quanto scale": (_with_scale(_quanto_file, "weight._scale", _set_row(0.0)),
                          "zero values in quanto_qint8 weight_scale", LAYER),
    "negative Quanto scale": (_with_scale(_quanto_file, "weight._scale", _set_row(lambda v: -v)),
                              "negative values in quanto_qint8 weight_scale", LAYER),
    "zero FP8 input_scale": (bad_fp8_input_scale(0), "zero values in float8_e4m3fn input_scale", LAYER),
    "negative FP8 input_scale": (bad_fp8_input_scale(-1), "negative values in float8_e4m3fn input_scale", LAYER),
    "zero NVFP4 weight_scale_2": (_with_scale(_nvfp4_file, "weight_scale_2", lambda s: torch.zeros_like(s)),
                                  "zero values in nvfp4 weight_scale_2", LAYER),
    "negative NVFP4 weight_scale_2": (_with_scale(_nvfp4_file, "weight_scale_2", lambda s: -s),
                                      "negative values in nvfp4 weight_scale_2", LAYER),
    # ComfyUI scaled_fp8 files
    "scaled_fp8 per-channel scale": (bad_scaled(lambda sd: {f"{LAYER}.scale_weight": torch.ones(
        sd[f"{LAYER}.weight"].shape[0], 1)}), "shape mismatch: scaled_fp8 scale_weight must be a scalar", LAYER),
    "scaled_fp8 integer scale": (bad_scaled({f"{LAYER}.scale_weight": torch.tensor(1, dtype=torch.int32)}),
                                 "dtype mismatch: scaled_fp8 scale_weight must be", LAYER),
    "scaled_fp8 NaN scale": (bad_scaled({f"{LAYER}.scale_weight": torch.tensor(float("nan"))}),
                             "non-finite (NaN/Inf) values in scaled_fp8 scale_weight", LAYER),
    "scaled_fp8 zero scale": (bad_scaled({f"{LAYER}.scale_weight": torch.tensor(0.0)}),
                              "zero values in scaled_fp8 scale_weight", LAYER),
    "scaled_fp8 zero scale_input": (bad_scaled({f"{LAYER}.scale_input": torch.tensor(0.0)}),
                                    "zero values in scaled_fp8 scale_input", LAYER),
    "scaled_fp8 scale without weight": (bad_scaled(drop=[f"{LAYER}.weight"]),
                                        "scaled_fp8 scale_weight without a weight", LAYER),
    "scaled_fp8 scale_input alone": (bad_scaled({"blocks.0.self_attn.q.scale_input": torch.tensor(0.5)}),
                                     "scaled_fp8 scale_input without a scale_weight", "blocks.0.self_attn.q"),
    "scaled_fp8 bf16 weight": (bad_scaled(lambda sd: {f"{LAYER}.weight": sd[f"{LAYER}.weight"].to(torch.bfloat16)}),
                               "dtype mismatch: scaled_fp8 weight must be F8_E4M3, found BF16", LAYER),
    "scaled_fp8 e5m2": (bad_scaled({"scaled_fp8": torch.zeros(0, dtype=torch.float8_e5m2)}),
                        "unsupported scaled_fp8 weights float8_e5m2", "scaled_fp8"),
    "scaled_fp8 scale outside its prefix": (bad_scaled({"model.diffusion_model.scaled_fp8": torch.zeros(
        0, dtype=torch.float8_e4m3fn)}, drop=["scaled_fp8"]), "outside the model the scaled_fp8 marker covers", LAYER),
    "scale_weight without a marker": (bad_scaled(drop=["scaled_fp8"]),
                                      "FP8 weights with scale_weight but no scaled_fp8 marker", LAYER),
    "scaled_fp8 and markers": (bad_scaled({f"{LAYER}.comfy_quant": marker_tensor({"format": "float8_e4m3fn"})}),
                               "both ComfyUI markers and a scaled_fp8 marker", "scaled_fp8"),
    # marker values no writer means, used by the format or not (an unknown key is only warned about)
    "int8 group size 0": (_with_marker(_int8_file, {"format": "int8_tensorwise", "convrot_groupsize": 0}),
                          "bad marker: convrot_groupsize 0 is a value no writer means", LAYER),
    # upstream reads it as no options: this ConvRot data would run as plain INT8
    "params not an object": (_with_marker(_int8_file, {"format": "int8_tensorwise", "params": "convrot"}),
                             "bad marker: params 'convrot' is not a JSON object", LAYER),
    "int8 convrot as text": (_with_marker(_int8_file, {"format": "int8_tensorwise", "convrot": "yes"}),
                             "bad marker: convrot 'yes' is a value no writer means (expected true or false)", LAYER),
    "per_row as text": (_with_marker(_int8_file, {"format": "int8_tensorwise", "convrot": True,
                                                  "convrot_groupsize": 64, "per_row": "yes"}),
                        "bad marker: per_row 'yes' is a value no writer means", LAYER),
    "W4A4 group size 0": (_with_marker(_w4a4_file, {"format": "convrot_w4a4", "convrot_groupsize": 0}),
                          "bad marker: convrot_groupsize 0 is a value no writer means", LAYER),
    "W4A4 group not dividing": (_with_marker(_w4a4_file, {"format": "convrot_w4a4", "convrot_groupsize": 1024}),
                                "bad marker: convrot_groupsize 1024 and kitchen's int4 group 64 must divide", LAYER),
    "W4A4 linear dtype": (_with_marker(_w4a4_file, {"format": "convrot_w4a4", "linear_dtype": "fp4"}),
                          "bad marker: linear_dtype 'fp4' is a value no writer means (expected int4 or int8)", LAYER),
    "W4A8 group size 0": (_with_marker(_w4a8_file, {"format": "asym_w4a8_int8", "group_size": 0}),
                          "bad marker: group_size 0 is a value no writer means", LAYER),
    "W4A8 group size 12": (_with_marker(_w4a8_file, {"format": "asym_w4a8_int8", "group_size": 12}),
                           "bad marker: group_size 12 is a value no writer means (expected at least 4, dividing 16",
                           LAYER),
    "W4A8 group size 32 on g16 scales": (
        _with_marker(_w4a8_file, {"format": "asym_w4a8_int8", "group_size": 32, "convrot_groupsize": 64}),
        "shape mismatch: asym_w4a8_int8 weight_s_rel must be [N,K/group_size] = ", LAYER),
    # 4-bit layers' companions (comfy-kitchen's own files, edited)
    "W4A4 per-tensor layout scale": (_with_scale(_w4a4_file, "weight_scale", lambda s: s.reshape(-1, 1)),
                                     "shape mismatch: convrot_w4a4 weight_scale must be [N] = [256]", LAYER),
    "W4A4 bf16 weight": (_with_scale(_w4a4_file, "weight", lambda w: w.to(torch.bfloat16)),
                         "dtype mismatch: convrot_w4a4 weight (packed signed int4 pairs) must be I8", LAYER),
    "W4A4 zero scale": (_with_scale(_w4a4_file, "weight_scale", _set_row(0.0)),
                        "zero values in convrot_w4a4 weight_scale", LAYER),
    "W4A8 missing s_channel": (lambda src, workdir, dst: edit_checkpoint(
        _w4a8_file(src, workdir), dst, drop=[f"{LAYER}.weight_s_channel"]),
        "asym_w4a8_int8 layer is missing tensor(s) weight_s_channel", LAYER),
    "W4A8 bf16 s_channel": (_with_scale(_w4a8_file, "weight_s_channel", lambda s: s.to(torch.bfloat16)),
                            "dtype mismatch: asym_w4a8_int8 weight_s_channel must be F32, found BF16", LAYER),
    "W4A8 NaN group scale": (_with_scale(_w4a8_file, "weight_s_rel", lambda s: s.view(torch.uint8).fill_(0x7F)),
                             "non-finite (NaN/Inf) values in asym_w4a8_int8 weight_s_rel", LAYER),
    "W4A8 huge s_channel": (_with_scale(_w4a8_file, "weight_s_channel", lambda s: torch.full_like(s, 1e6)),
                            "asym_w4a8_int8 weight_s_channel too large (max 1e+06)", LAYER),
    "W4A8 codebook shape": (lambda src, workdir, dst: edit_checkpoint(
        _w4a8_file(src, workdir), dst, {f"{LAYER}.weight_codebook": torch.zeros(8)}),
        "shape mismatch: asym_w4a8_int8 weight_codebook must be [16] = [16]", LAYER),
    "W4A8 correction layout": (lambda src, workdir, dst: edit_checkpoint(
        _w4a8_file(src, workdir), dst, {f"{LAYER}.weight_correction": torch.zeros(256, 8)}),
        "shape mismatch: asym_w4a8_int8 weight_correction must be [K/group_size,N] = [8, 256]", LAYER),
    # NVFP4 with AWQ's pre_quant_scale
    "AWQ scale shape": (_with_scale(_awq_file, "pre_quant_scale", lambda s: s[:-16]),
                        "shape mismatch: nvfp4 pre_quant_scale must be [K] = ", LAYER),
    "AWQ zero scale": (_with_scale(_awq_file, "pre_quant_scale", _set_row(0.0)),
                       "zero values in nvfp4 pre_quant_scale", LAYER),
    "AWQ integer scale": (_with_scale(_awq_file, "pre_quant_scale", lambda s: s.to(torch.int32)),
                          "dtype mismatch: nvfp4 pre_quant_scale must be F16 or BF16 or F32 or F64, found I32", LAYER),
    # a block scale's dtype where a plain weight belongs: refused before torch's bare "size mismatch"
    "E8M0 plain weight": (bad_e8m0_weight, "F8_E8M0 tensor(s) where plain tensors belong", f"{LAYER}.weight"),
    # JSON that is too deep or too big
    "nested header JSON": (bad_nested_header, "the safetensors header is not valid JSON", "nested too deeply"),
    "nested marker JSON": (bad_nested_marker, "bad marker JSON in", f"{LAYER}.comfy_quant (nested too deeply)"),
    "deep marker JSON": (bad_deep_marker, f"nested more than {MAX_MARKER_DEPTH} levels deep", LAYER),
    "nested Quanto map": (bad_nested_quanto_map, "quantization_map_base64", "nested too deeply"),
    "oversized marker": (bad_oversized_marker, "oversized marker", LAYER),
    # data sections safetensors' own reader refuses
    "overlapping tensors": (relaid(shift=-2), "start inside tensor", f"{LAYER}.weight"),
    "gap between tensors": (relaid(shift=8), "leave a gap of 8 bytes after tensor", f"{LAYER}.weight"),
    "bytes after the last tensor": (relaid(trailing=16), "incomplete metadata, file not fully covered: the data "
                                                         "section's last 16 bytes", f"{LAYER}.weight"),
}

# Cases the unit tests cover alone: the integration tests load one of each kind through a real server (its
# error reaches the UI, the server keeps serving), not every message of the same contract check.
UNIT_ONLY = ("int8 convrot as text", "per_row as text", "W4A4 group size 0", "W4A4 group not dividing",
             "W4A4 linear dtype", "W4A8 group size 0", "W4A8 group size 12", "W4A4 per-tensor layout scale",
             "W4A4 bf16 weight", "W4A4 zero scale", "W4A8 missing s_channel", "W4A8 bf16 s_channel",
             "W4A8 NaN group scale", "W4A8 huge s_channel", "W4A8 codebook shape", "W4A8 correction layout",
             "AWQ zero scale", "AWQ integer scale", "gap between tensors", "bytes after the last tensor")
