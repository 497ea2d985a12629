"""INT8 linear layers (ConvRot or plain) in Triton: the pack's own kernels for Int8ConvRotMethod on CUDA.

comfy-kitchen's `int8_linear`, which ComfyUI runs for these layers too, reached about 38% of an H200's
dense INT8 rate at MiniMax-H3's shapes (0.75-1.21x bf16 F.linear). Two kernels take its place:

- `_rotate_quantize_kernel`, the activations in one kernel (torch has no fused form): the input
  activation (SwiGLU), ConvRot's group-wise Hadamard rotation and per-row INT8 quantization. A row's
  scale spans all its groups: a row up to 16384 wide is held whole and read once, in one power-of-two tile
  or, where a config asks, in up to three that add up to the row (no padding rotated); a wider one is read
  twice (rotate for the absmax, rotate again to quantize). The rotation runs on fp16 tensor cores, a
  group of 256 as H16 (x) H16 (two 16-wide products instead of one 256-wide one).
- the GEMM: int8 x int8 -> int32 on tensor cores, the row scale times the weight's channel (or tensor)
  scale and the bias applied in the epilogue, which writes the output dtype. From Hopper on operands
  come by TMA (`_gemm_tma_kernel`), before through pointer loads (`_gemm_kernel`), both K-major as
  Hopper's INT8 wgmma needs, in grouped tile order.

Each launch takes its config (tiles, warps, stages) from, in order: the tuning store (quant/tuning.py, this
GPU's entry for the shape at this `KERNEL_VERSION`); a search of the candidates below, only where the user asked
for one (BIGDIT_INT8_TUNE=1), its winner put in the store; the configs the pack ships per GPU family
(`int8_triton_tuned.json`, used while its kernel version is this one); a rule of the shape and the GPU's shared
memory. Nothing is timed unless asked, so a first call costs a compilation, not a search.

`int8_linear` has comfy_kitchen.int8_linear's contract for weights stored by TensorWiseINT8Layout
(int8 [N, K], already rotated; scale fp32 [N, 1] or per tensor). Its arithmetic, which the tests hold
the kernels to: the input activation rounded to x's dtype, as kitchen's unfused `apply_input_act`
computes it; the rotation to fp32's precision (see `_rotated`); per row scale = max(absmax / 127, 1e-30)
as kitchen's; q = round-half-even(clamp(v * (1 / scale), -128, 127)), the reciprocal correctly rounded
once per row; out = acc * (row scale * weight scale) + bias in fp32, rounded once to the output dtype.
Kitchen's eager reference rounds the rotated row to x's dtype and divides in it, and adds the bias in the
output dtype; these kernels keep fp32, so they are no less accurate.

`available` / `unavailable_reason` say where the kernels take a call (a CUDA tensor, or a CPU one under
Triton's interpreter); elsewhere the caller runs kitchen. `linear_or_kitchen` is the call the method
makes, counted in the run witness (quant/witness.py): a kernel that fails at run time has kitchen compute
that call; an out-of-memory is tried again at the next call, any other failure (a Triton that cannot compile
for this GPU) leaves kitchen computing for the rest of the process. Either is logged and reported once.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..hardware import cuda_capability, time_ms
from ..pack_logging import pack_logger
from ..units import next_pow2
from . import compile_ahead, tuning, witness
from .kernel_select import rows_bucket

log = pack_logger(__name__)

try:
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # missing or broken Triton (or one without tensor descriptors): kitchen runs instead
    triton = None
    OutOfResources = ()

GROUP_SIZES = (16, 64, 256)
INPUT_ACTS = (None, "swiglu")
X_DTYPES = (torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KRON = 16  # a group of 256 rotates as H16 (x) H16: two 16-wide steps instead of one 256-wide product
TALLY = "int8"  # these kernels' and kitchen's INT8 linears in the run reports ("ran int8: triton x400 calls")
_failure: str | None = None  # why the kernels failed for good at run time, once they did
_warned: set[str] = set()  # failure kinds logged

# The configs' shape keys, as the kernels take them; `shape_text` writes them into the store.
SHAPE_KEYS = {"activation": ("M_BUCKET", "K", "G", "SWIGLU", "ROTATE"), "gemm": ("M_BUCKET", "N", "K"),
              "gemm_tma": ("M_BUCKET", "N", "K")}
LAUNCH = ("num_warps", "num_stages")
SHIPPED_FILE = Path(__file__).with_name("int8_triton_tuned.json")
SMEM_MARGIN = 8192  # bytes of shared memory a GEMM config leaves beside its pipeline (barriers, the epilogue)
_CHOSEN: dict[tuple, tuple[dict, str]] = {}  # (kernel, device, shape) -> (config, where it came from)
_LAUNCHED: set[tuple] = set()  # Launch.key launched before in this process (its first launch is timed)


def _interpreter_on() -> bool:
    knobs = getattr(triton, "knobs", None)
    return knobs is not None and bool(knobs.runtime.interpret)


# Triton's interpreter (TRITON_INTERPRET=1: CPU tensors) is chosen once, when the kernels below are defined
_INTERPRETED = _interpreter_on()


def runs_on(device: torch.device) -> bool:
    """Whether the kernels run on `device`'s tensors (CUDA, or CPU under Triton's interpreter) and have not failed
    for good in this process."""
    on = device.type == "cuda" or (device.type == "cpu" and _INTERPRETED)
    return on and triton is not None and _failure is None


def unavailable_reason(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None, out_dtype: torch.dtype | None, convrot: bool, group_size: int,
                       input_act: str | None) -> str | None:
    """Why the Triton kernels cannot take this call (the caller then runs kitchen), or None."""
    if triton is None:
        return "Triton (with tensor descriptors) cannot be imported"
    if _failure is not None:
        return f"the Triton kernels failed earlier in this process ({_failure})"
    if not (x.is_cuda or (x.device.type == "cpu" and _INTERPRETED)):
        return f"the input is on {x.device.type} (the kernels run on CUDA)"
    if x.dtype not in X_DTYPES:
        return f"input dtype {x.dtype} (bfloat16 or float16 only)"
    if (out_dtype or torch.bfloat16) not in OUT_DTYPES:
        return f"output dtype {out_dtype}"
    if input_act not in INPUT_ACTS:
        return f"input activation {input_act!r} (none or swiglu only)"
    if x.dim() < 1 or x.stride(-1) != 1:
        return "the input's last dimension is not contiguous"
    k = x.shape[-1] // (2 if input_act == "swiglu" else 1)
    if weight.dtype != torch.int8 or weight.dim() != 2 or weight.shape[1] != k or weight.device != x.device:
        return f"weight {tuple(weight.shape)} {weight.dtype} on {weight.device} for {k} inputs on {x.device}"
    n = weight.shape[0]
    # TMA and 16-byte rows: K and N multiples of 16, the weight's rows contiguous (its address is checked per
    # call, in `linear_or_kitchen`: torch.compile traces this function, and a traced address is no address)
    if k % 16 or n % 16 or weight.stride(1) != 1 or weight.stride(0) % 16:
        return f"shape {n}x{k} or the weight's layout is not 16-byte aligned"
    if convrot and (group_size not in GROUP_SIZES or k % group_size):
        return f"rotation group {group_size} (one of {GROUP_SIZES}, dividing {k})"
    if weight_scale.numel() not in (1, n) or weight_scale.device != x.device:
        return f"weight scale of {weight_scale.numel()} values on {weight_scale.device} for {n} channels"
    if bias is not None and (bias.numel() != n or bias.device != x.device):
        return f"bias of {bias.numel()} values on {bias.device} for {n} channels"
    return None


def available(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
              out_dtype: torch.dtype | None, convrot: bool, group_size: int, input_act: str | None) -> bool:
    return unavailable_reason(x, weight, weight_scale, bias, out_dtype, convrot, group_size, input_act) is None


def transient(exc: BaseException) -> bool:
    """Whether a failure may pass by itself (an out-of-memory), so that the kernels are tried again."""
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def linear_or_kitchen(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize, input_act, kitchen):
    """`int8_linear`, counted in the run witness; `kitchen` (the same arguments, counting itself) for a weight off
    16-byte alignment, where the kernels failed (see the module's docstring) and while they compile ahead."""
    global _failure
    if _failure is None and weight.data_ptr() % 16 == 0:  # TMA's alignment (a view into a file may lack it)
        try:
            out = int8_linear(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize, input_act)
        except Compiling:
            pass
        except Exception as exc:  # a Triton that cannot compile or launch for this GPU, or no memory left
            why, again = f"{type(exc).__name__}: {exc}", transient(exc)
            if not again:
                _failure = why
            witness.kernel_failed(TALLY, "triton", why, retried=again)
            if type(exc).__name__ not in _warned:
                _warned.add(type(exc).__name__)
                log.warning("INT8: the Triton kernels failed (%s); comfy-kitchen's int8_linear computed the call "
                            "(slower), %s", why, "and Triton is tried again at the next call" if again else
                            "and computes the rest of this process's calls")
        else:
            witness.count_kernel(TALLY, "triton")
            return out
    return kitchen(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize, input_act)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype | None, convrot: bool, convrot_groupsize: int,
                input_act: str | None) -> torch.Tensor:
    """comfy_kitchen.int8_linear's result, computed by the Triton kernels (see the module docstring); `Compiling`
    where they are compiling ahead (nothing launched)."""
    out_dtype = out_dtype or torch.bfloat16
    x2d = x.reshape(-1, x.shape[-1])
    q, scale, rows = _rows_launch(x2d, convrot, convrot_groupsize, input_act)
    out, product = _gemm_launch(q, scale, weight, weight_scale, bias, out_dtype, tma=_tma(x.device))
    run_when_compiled(rows, product)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _tma(device: torch.device) -> bool:
    capability = cuda_capability(device)
    return capability is not None and capability >= (9, 0)


def hadamard(group_size: int, device: torch.device) -> torch.Tensor:
    """The fp32 matrix the kernel multiplies each group by: kitchen's ConvRot matrix, or for a group of 256 its
    16-wide factor (kitchen builds H256 as H16 (x) H16, both Kronecker powers of one symmetric 4x4)."""
    from .kitchen_api import hadamard as kitchen_hadamard
    return kitchen_hadamard(KRON if group_size == KRON * KRON else group_size, device)


class Compiling(Exception):
    """A call's kernels are compiling ahead (quant/compile_ahead.py); its caller computes it another way."""


@dataclass
class Launch:
    """One kernel launch of a call, prepared: `launch(config, warmup)` launches it with a config (or, with
    `warmup`, compiles it as that launch would), chosen for `kernel` at `shape` on `device` (`config_for`)."""
    kernel: str
    shape: dict
    device: torch.device
    launch: Callable[[dict, bool], object]
    variant: str = ""  # another kernel with the same configs (the GEMM with a LoRA in its epilogue: "+lora")

    @property
    def key(self) -> tuple:
        return (self.kernel + self.variant, *_chosen_key(self.kernel, self.shape, self.device)[1:])

    def warm(self) -> object:
        return self.launch(config_for(self.kernel, self.shape, self.device), True)

    def run(self) -> None:
        _run(self)


def run_when_compiled(*launches: Launch | None) -> None:
    """Each launch (None: nothing to launch), in order, once every one is compiled; else `Compiling`, nothing
    launched, with the compiles of those not compiled handed to the pool (all of them, not only the first)."""
    compiling = [launch.key for launch in launches if launch is not None and launch.key not in _LAUNCHED
                 and not compile_ahead.ready(launch.warm, launch.device)]
    if compiling:
        kernels = ", ".join(f"{kernel} at {shape}" for kernel, _, shape in compiling)
        compile_ahead.said_once(f"INT8: the Triton kernels compile on a thread pool ({kernels} first); comfy-kitchen's "
                                f"int8_linear computes a call until its kernels are ready")
        raise Compiling(kernels)
    for launch in launches:
        if launch is not None:
            launch.run()


def quantize_rows(x: torch.Tensor, convrot: bool, group_size: int,
                  input_act: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [M, K], fp32 [M, 1]) for a 2-D activation [M, K] ([M, 2K] with SwiGLU): activation, rotation,
    per-row quantization in one kernel."""
    q, scale, launch = _rows_launch(x, convrot, group_size, input_act)
    if launch is not None:
        launch.run()
    return q, scale


def _rows_launch(x: torch.Tensor, convrot: bool, group_size: int,
                 input_act: str | None) -> tuple[torch.Tensor, torch.Tensor, Launch | None]:
    """quantize_rows' outputs, allocated, and its launch (None for no rows)."""
    swiglu = input_act == "swiglu"
    rows, k = x.shape[0], x.shape[1] // (2 if swiglu else 1)
    q = torch.empty(rows, k, device=x.device, dtype=torch.int8)
    scale = torch.empty(rows, 1, device=x.device, dtype=torch.float32)
    if rows == 0:
        return q, scale, None
    group = group_size if convrot else 16  # unrotated rows step in 16-wide groups (the matrix is loaded, not used)
    h = hadamard(group, x.device)
    args = dict(x_ptr=x, h_ptr=h, q_ptr=q, scale_ptr=scale, M=rows, stride_x=x.stride(0), stride_q=q.stride(0),
                K=k, G=group, HG=KRON if group == KRON * KRON else group, SWIGLU=swiglu, ROTATE=convrot)

    def launch(config: dict, warmup: bool = False):
        meta, run = _split(config)
        grid = (triton.cdiv(rows, meta["ROWS"]),)
        meta.update(row_tiles(meta["WIDTH"], k, group))
        if warmup:
            return _rotate_quantize_kernel.warmup(**args, **meta, **run, grid=grid)
        _rotate_quantize_kernel[grid](**args, **meta, **run)

    shape = {"M_BUCKET": rows_bucket(rows), "K": k, "G": group, "SWIGLU": swiglu, "ROTATE": convrot}
    return q, scale, Launch("activation", shape, x.device, launch)


def gemm(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
         bias: torch.Tensor | None, out_dtype: torch.dtype, tma: bool) -> torch.Tensor:
    """(a [M, K] int8 . weight [N, K]^T int8) * a_scale [M, 1] * weight_scale ([N] or one) + bias, in out_dtype."""
    out, launch = _gemm_launch(a, a_scale, weight, weight_scale, bias, out_dtype, tma)
    if launch is not None:
        launch.run()
    return out


def _gemm_launch(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype, tma: bool) -> tuple[torch.Tensor, Launch | None]:
    """gemm's output, allocated, and its launch (None for no rows)."""
    m, k = a.shape
    n = weight.shape[0]
    out = torch.empty(m, n, device=a.device, dtype=out_dtype)
    if m == 0:
        return out, None
    w_scale = weight_scale.reshape(-1).float()
    common = dict(out_ptr=out, a_scale_ptr=a_scale, w_scale_ptr=w_scale,
                  bias_ptr=bias if bias is not None else w_scale, M=m, N=n, K=k, stride_out=out.stride(0),
                  PER_CHANNEL=w_scale.numel() > 1, HAS_BIAS=bias is not None)

    def launch(config: dict, warmup: bool = False):
        meta, run = _split(config)
        tiles = (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
        if tma:
            kernel, operands = _gemm_tma_kernel, dict(
                a_desc=TensorDescriptor(a, [m, k], [a.stride(0), 1], [meta["BLOCK_M"], meta["BLOCK_K"]]),
                w_desc=TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [meta["BLOCK_N"], meta["BLOCK_K"]]))
        else:
            kernel, operands = _gemm_kernel, dict(a_ptr=a, w_ptr=weight, stride_a=a.stride(0),
                                                  stride_w=weight.stride(0))
        if warmup:
            return kernel.warmup(**operands, **common, **meta, **run, grid=tiles)
        kernel[tiles](**operands, **common, **meta, **run)

    return out, Launch("gemm_tma" if tma else "gemm", {"M_BUCKET": rows_bucket(m), "N": n, "K": k}, a.device, launch)


def _run(launch: Launch) -> None:
    """The launch with the config chosen for its kernel at its shape; a GEMM config this GPU has not the shared
    memory or registers for (a shipped or rule config on a card it was not measured on) gives way, for the process,
    to the smallest tiles (`gemm_small`), said once."""
    kernel, shape, device = launch.kernel, launch.shape, launch.device
    config = config_for(kernel, shape, device, launch.launch)
    try:
        witness.launch(TALLY, launch.key not in _LAUNCHED, launch.launch, config)
    except OutOfResources as exc:
        small = None if kernel == "activation" else gemm_small(shape)
        if small is None or small == config:
            raise
        log.warning("INT8 Triton %s at %s: %s does not run on this GPU (%s); %s instead", kernel,
                    shape_text(kernel, shape), config, exc, small)
        _CHOSEN[_chosen_key(kernel, shape, device)] = (small, "fallback")
        launch.launch(small)
    _LAUNCHED.add(launch.key)


def _split(config: dict) -> tuple[dict, dict]:
    """A config's kernel parameters and its launch options (warps, stages)."""
    return ({key: value for key, value in config.items() if key not in LAUNCH},
            {key: config[key] for key in LAUNCH if key in config})


# -- configs: the tuning store, a search where asked, the shipped table, a rule --------------------------------

def shape_text(kernel: str, shape: dict) -> str:
    """A shape as the store and the shipped table key it: "M_BUCKET=32768,N=21504,K=5376"."""
    return ",".join(f"{key}={int(shape[key])}" for key in SHAPE_KEYS[kernel])


def fits(kernel: str, config, shape: dict) -> bool:
    """Whether `config` (a dict, as stored) is one `kernel` can run at `shape`: its keys, and the widths the kernel
    assumes (an activation step holds whole groups and, where the rotation is one full-matrix product, 16 of them;
    a WIDTH that is no power of two is K, the row in `row_pieces`; a GEMM's K step no wider than K's power of
    two)."""
    if not isinstance(config, dict) or not all(isinstance(v, int) and v > 0 for v in config.values()):
        return False
    if kernel == "activation":
        if set(config) != {"ROWS", "WIDTH", *LAUNCH}:
            return False
        k, g, rotate, width = shape["K"], shape["G"], shape["ROTATE"], config["WIDTH"]
        if width & (width - 1):  # not a power of two: the whole row in pieces
            pieces = row_pieces(k, g) if width == k else ()
            if not pieces:
                return False
            width = pieces[-1]  # the narrowest tile
        elif not (g <= width <= next_pow2(k) and width % g == 0):
            return False
        return not rotate or g == KRON * KRON or config["ROWS"] * width // g >= 16
    return (set(config) == {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", *LAUNCH}
            and config["BLOCK_K"] <= max(16, next_pow2(shape["K"])))


def row_pieces(k: int, group: int) -> tuple[int, ...]:
    """A row of `k` columns as the activation kernel's power-of-two pieces of whole groups, widest first (K's
    binary digits from the group's up: 5376 = 4096 + 1024 + 256); () where that takes more than three, or `k` is
    not a multiple of the group."""
    if k % group:
        return ()
    pieces = tuple(1 << bit for bit in reversed(range(k.bit_length())) if k >> bit & 1)
    return pieces if len(pieces) <= 3 else ()


def row_tiles(width: int, k: int, group: int) -> dict:
    """The activation kernel's tile widths for a config's WIDTH: {WIDTH, W1, W2}, the pieces of `row_pieces` where
    WIDTH is K and no power of two, else WIDTH alone."""
    pieces = (row_pieces(k, group) if width == k and k & (k - 1) else ()) or (width,)
    return dict(zip(("WIDTH", "W1", "W2"), pieces + (0, 0)))


def activation_rule(shape: dict) -> dict:
    """The activation kernel's config by rule: a row up to 16384 wide in one step, else 1024-wide steps; warps
    as the H200's winners (4 for a row of 8192, 16 for 16384), rows per program to give a rotation of small
    groups its 16 groups."""
    k, g, rotate = shape["K"], shape["G"], shape["ROTATE"]
    width = max(g, next_pow2(k)) if k <= 16384 else max(g, 1024)
    rows = 1 if k <= 16384 else 2
    if rotate and g != KRON * KRON:
        rows = max(rows, -(-16 * g // width))
    return {"ROWS": rows, "WIDTH": width, "num_warps": 16 if width >= 16384 else 4, "num_stages": 3}


def gemm_rule(shape: dict, tma: bool, shared_memory: int) -> dict:
    """The GEMM's config by rule: the largest tile (128x256x128 first, as won on the H200 at H3's shapes) whose
    pipeline of at least 3 stages (at most 4) fits the GPU's shared memory, row tiles of 64 below 128 rows."""
    m, n, k = shape["M_BUCKET"], shape["N"], shape["K"]
    block_k_max = 128 if k >= 128 else max(16, next_pow2(k))
    tiles = [(128, 256, 128, 8), (128, 128, 128, 8), (128, 128, 64, 8), (64, 128, 64, 4), (64, 64, 64, 4),
             (64, 64, 32, 4)]
    if m < 128:
        tiles = [t for t in tiles if t[0] == 64]
    if n < 256:
        tiles = [t for t in tiles if t[1] <= 128]
    budget = shared_memory - SMEM_MARGIN
    for bm, bn, bk, warps in tiles:
        bk = min(bk, block_k_max)
        stages = min(4, budget // ((bm + bn) * bk))
        if stages >= 3 or (bm, bn) == (64, 64):
            return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 16 if tma else 8,
                    "num_warps": warps, "num_stages": max(2, stages)}
    raise AssertionError("unreachable: the last tile always returns")


def gemm_small(shape: dict) -> dict:
    """The GEMM's smallest tiles (64x64x32, 2 stages: 16 KiB of shared memory), for a GPU the others do not fit."""
    return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32 if shape["K"] >= 32 else 16, "GROUP_M": 8,
            "num_warps": 4, "num_stages": 2}


def search_candidates(kernel: str, shape: dict) -> list[dict]:
    """What a search times: each kernel's candidate list (the configs of the H200's development runs, and the
    whole row in pieces), those that fit the shape, each once."""
    if kernel == "activation":
        found = [{"ROWS": r, "WIDTH": w, "num_warps": nw, "num_stages": 3}
                 for r, w, nw in [(8, 256, 4), (2, 1024, 4), (1, 8192, 4), (1, 8192, 8), (1, 16384, 16),
                                  (1, shape["K"], 4), (1, shape["K"], 8)]]
    else:
        tiles = ([(128, 256, 128, 4, 8, 16), (128, 256, 128, 4, 8, 8), (256, 128, 128, 4, 8, 16),
                  (128, 128, 128, 4, 4, 8), (64, 256, 128, 4, 4, 8)] if kernel == "gemm_tma" else
                 [(128, 128, 128, 3, 8, 8), (256, 128, 128, 3, 8, 8), (128, 256, 128, 3, 8, 8),
                  (128, 128, 64, 4, 4, 8), (64, 64, 64, 4, 4, 8)])
        found = [{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm, "num_warps": w, "num_stages": s}
                 for bm, bn, bk, s, w, gm in tiles]
    return [config for i, config in enumerate(found) if config not in found[:i] and fits(kernel, config, shape)]


def _shipped() -> tuple[str | None, dict]:
    """(the kernel version the shipped table was tuned for, {family: {kernel: {shape: config}}})."""
    try:
        data = json.loads(SHIPPED_FILE.read_text())
        return data["kernel_version"], data["families"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("INT8: the shipped Triton configs (%s) do not read (%s); rules choose them", SHIPPED_FILE, exc)
        return None, {}


def _shared_memory(device: torch.device) -> int:
    """Shared memory a block may opt in to on `device`; off CUDA (the interpreter) an Ada's 99 KiB."""
    if device.type != "cuda":
        return 101376
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def _chosen_key(kernel: str, shape: dict, device: torch.device) -> tuple:
    return kernel, str(device), tuple(shape[k] for k in SHAPE_KEYS[kernel])


def config_for(kernel: str, shape: dict, device: torch.device, launch=None) -> dict:
    """The config `kernel` runs `shape` with on `device` (see the module's docstring); `launch(config)` runs the
    kernel, for a search. Chosen once per process and shape."""
    key = _chosen_key(kernel, shape, device)
    chosen = _CHOSEN.get(key)
    if chosen is None:
        chosen = _CHOSEN[key] = choose_config(kernel, shape, device, launch)
        log.debug("INT8 Triton %s at %s: %s (%s)", kernel, shape_text(kernel, shape), chosen[0], chosen[1])
    return chosen[0]


def choose_config(kernel: str, shape: dict, device: torch.device, launch=None) -> tuple[dict, str]:
    """(the config, where it came from: "store", "search", "shipped" or "rule")."""
    text, gpu = shape_text(kernel, shape), tuning.device_key(device)
    stored = tuning.current().get(gpu, f"int8_triton.{kernel}", KERNEL_VERSION, text)
    if fits(kernel, stored, shape):
        return dict(stored), "store"
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()  # a CUDA graph times nothing
    if launch is not None and gpu is not None and tuning.search_asked() and not capturing:
        found = _search(kernel, shape, device, launch)
        if found is not None:
            tuning.current().put(gpu, f"int8_triton.{kernel}", KERNEL_VERSION, text, found)
            return found, "search"
    version, families = SHIPPED
    shipped = families.get(tuning.gpu_family(device), {}).get(kernel, {}).get(text)
    if version == KERNEL_VERSION and fits(kernel, shipped, shape):
        return dict(shipped), "shipped"
    if kernel == "activation":
        return activation_rule(shape), "rule"
    return gemm_rule(shape, kernel == "gemm_tma", _shared_memory(device)), "rule"


def _search(kernel: str, shape: dict, device: torch.device, launch) -> dict | None:
    """The fastest of the candidates (and the rule's config) at this call, timed on its own inputs; None where
    none ran."""
    rule = (activation_rule(shape) if kernel == "activation" else
            gemm_rule(shape, kernel == "gemm_tma", _shared_memory(device)))
    candidates = [rule] + [c for c in search_candidates(kernel, shape) if c != rule]
    timings = {}
    for index, config in enumerate(candidates):
        try:
            launch(config)  # compiles
            timings[index] = time_ms(lambda: launch(config), device, 10)
        except Exception as exc:  # a config this GPU cannot run (shared memory, registers): not a candidate
            log.debug("INT8 Triton %s: %s does not run (%s: %s)", kernel, config, type(exc).__name__, exc)
    if not timings:
        return None
    best = min(timings, key=timings.get)
    log.info("INT8 Triton %s at %s: searched %d configs, %s fastest (%.3f ms); kept in the tuning store", kernel,
             shape_text(kernel, shape), len(timings), candidates[best], timings[best])
    return candidates[best]


if triton is not None:
    # 1.5 * 2^23: a sum with it keeps no fraction bits in fp32, so v + _RNE - _RNE rounds v half to even
    _RNE = tl.constexpr(12582912.0)

    @triton.jit
    def _activation(x_ptr, offs, mask, k, SWIGLU: tl.constexpr):
        """The input activation of a tile, as fp32 holding values of x's dtype (rounded as torch rounds them
        unfused: kitchen's silu(gate).mul_(up) on [gate | up] halves)."""
        dtype: tl.constexpr = x_ptr.dtype.element_ty
        if SWIGLU:
            gate = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + offs + k, mask=mask, other=0.0).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            v = (silu * up).to(dtype).to(tl.float32)
        else:
            v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        return v

    @triton.jit
    def _rotated(x_ptr, h, offs, mask, k, ROWS: tl.constexpr, WIDTH: tl.constexpr, G: tl.constexpr,
                 HG: tl.constexpr, SWIGLU: tl.constexpr, ROTATE: tl.constexpr):
        """[ROWS, WIDTH] of activations, each group of G columns times the group's Hadamard matrix, fp32.

        The products run on fp16 tensor cores: each group is scaled by the power of two that brings its largest
        value into [1, 2), where fp16 holds every bf16 and fp16 value exactly (values under 2^-14 of the
        group's largest lose bits below 2^-24 of it); the matrix's entries, +-2^-k, are exact too."""
        v = _activation(x_ptr, offs, mask, k, SWIGLU)
        if ROTATE:
            p: tl.constexpr = ROWS * WIDTH // G  # groups in the tile, one per row of the products below
            v = tl.reshape(v, (p, G))
            top = tl.max(tl.abs(v), axis=1)
            exp = tl.minimum(tl.maximum(((top.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -100), 100)
            down = ((127 - exp) << 23).to(tl.float32, bitcast=True)[:, None]  # 2^-exp
            up = ((127 + exp) << 23).to(tl.float32, bitcast=True)[:, None]
            h16 = h.to(tl.float16)
            if HG == G:
                r = tl.dot((v * down).to(tl.float16), h16)
            else:
                # x @ (H16 (x) H16): each group as [16 a, 16 b]; times H16 over b, then H16 (symmetric) over a
                u = tl.dot(tl.reshape((v * down).to(tl.float16), (p * HG, HG)), h16)
                # u's values are fp32 sums: as two fp16 parts they keep 22 significant bits
                hi = u.to(tl.float16)
                lo = (u - hi.to(tl.float32)).to(tl.float16)
                hb = tl.broadcast_to(h16[None, :, :], (p, HG, HG))
                r = tl.reshape(tl.dot(hb, tl.reshape(hi, (p, HG, HG)), tl.dot(hb, tl.reshape(lo, (p, HG, HG)))),
                               (p, G))
            v = tl.reshape(r * up, (ROWS, WIDTH))
        return v

    @triton.jit
    def _store_quantized(q_ptr, offs, r, inv_scale, mask):
        # clamp first: it also keeps the product and the rounding add from fusing into one FMA
        q = tl.clamp(r * inv_scale[:, None], -128.0, 127.0)
        q = (q + _RNE) - _RNE
        tl.store(q_ptr + offs, q.to(tl.int8), mask=mask)

    @triton.jit
    def _rotate_quantize_kernel(x_ptr, h_ptr, q_ptr, scale_ptr, M, stride_x, stride_q, K: tl.constexpr,
                                G: tl.constexpr, HG: tl.constexpr, SWIGLU: tl.constexpr, ROTATE: tl.constexpr,
                                ROWS: tl.constexpr, WIDTH: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr):
        """ROWS rows of x per program: int8 rows into q, scales into scale. With WIDTH >= K each row is read
        once, whole; with W1 (and W2) too, once in two (three) power-of-two pieces of WIDTH + W1 + W2 == K
        columns, so no masked-out column is rotated; otherwise twice, WIDTH columns (whole groups) a step: for
        the absmax, then to quantize."""
        hk = tl.arange(0, HG)
        h = tl.load(h_ptr + hk[:, None] * HG + hk[None, :])
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        cols = tl.arange(0, WIDTH)
        x_offs = rows.to(tl.int64)[:, None] * stride_x + cols[None, :]
        q_offs = rows.to(tl.int64)[:, None] * stride_q + cols[None, :]
        if W1 > 0:
            mask = row_ok[:, None] & (cols[None, :] < WIDTH)
            r = _rotated(x_ptr, h, x_offs, mask, K, ROWS, WIDTH, G, HG, SWIGLU, ROTATE)
            cols1 = tl.arange(0, W1)
            x1 = rows.to(tl.int64)[:, None] * stride_x + WIDTH + cols1[None, :]
            q1 = rows.to(tl.int64)[:, None] * stride_q + WIDTH + cols1[None, :]
            mask1 = row_ok[:, None] & (cols1[None, :] < W1)
            r1 = _rotated(x_ptr, h, x1, mask1, K, ROWS, W1, G, HG, SWIGLU, ROTATE)
            amax = tl.maximum(tl.max(tl.abs(r), axis=1), tl.max(tl.abs(r1), axis=1))
            if W2 > 0:
                cols2 = tl.arange(0, W2)
                x2 = rows.to(tl.int64)[:, None] * stride_x + (WIDTH + W1) + cols2[None, :]
                q2 = rows.to(tl.int64)[:, None] * stride_q + (WIDTH + W1) + cols2[None, :]
                mask2 = row_ok[:, None] & (cols2[None, :] < W2)
                r2 = _rotated(x_ptr, h, x2, mask2, K, ROWS, W2, G, HG, SWIGLU, ROTATE)
                amax = tl.maximum(amax, tl.max(tl.abs(r2), axis=1))
        elif WIDTH >= K:
            mask = row_ok[:, None] & (cols[None, :] < K)
            r = _rotated(x_ptr, h, x_offs, mask, K, ROWS, WIDTH, G, HG, SWIGLU, ROTATE)
            amax = tl.max(tl.abs(r), axis=1)
        else:
            amax = tl.zeros([ROWS], dtype=tl.float32)
            for k0 in range(0, K, WIDTH):
                mask = row_ok[:, None] & (cols[None, :] < K - k0)
                r = _rotated(x_ptr, h, x_offs + k0, mask, K, ROWS, WIDTH, G, HG, SWIGLU, ROTATE)
                amax = tl.maximum(amax, tl.max(tl.abs(r), axis=1))
        scale = tl.maximum(tl.math.div_rn(amax, 127.0), 1e-30)  # kitchen's (absmax / 127).clamp(min=1e-30)
        inv_scale = tl.math.div_rn(1.0, scale)  # once per row, correctly rounded; then a product per element
        if W1 > 0:
            _store_quantized(q_ptr, q_offs, r, inv_scale, mask)
            _store_quantized(q_ptr, q1, r1, inv_scale, mask1)
            if W2 > 0:
                _store_quantized(q_ptr, q2, r2, inv_scale, mask2)
        elif WIDTH >= K:
            _store_quantized(q_ptr, q_offs, r, inv_scale, mask)
        else:
            for k0 in range(0, K, WIDTH):
                mask = row_ok[:, None] & (cols[None, :] < K - k0)
                r = _rotated(x_ptr, h, x_offs + k0, mask, K, ROWS, WIDTH, G, HG, SWIGLU, ROTATE)
                _store_quantized(q_ptr, q_offs + k0, r, inv_scale, mask)
        tl.store(scale_ptr + rows, scale, mask=row_ok)

    @triton.jit
    def _tile(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """Grouped order: GROUP_M row tiles sweep the columns together, so their weight tiles are reused from L2."""
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * tiles_n
        first_m = (tile // per_group) * GROUP_M
        group_m = min(tiles_m - first_m, GROUP_M)
        return first_m + (tile % per_group) % group_m, (tile % per_group) // group_m

    @triton.jit
    def _epilogue(acc, pid_m, pid_n, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, stride_out,
                  PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """acc * (row scale * weight scale) + bias, as kitchen's epilogue multiplies, into the output dtype."""
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        a_scale = tl.load(a_scale_ptr + rows, mask=rows < M, other=0.0)
        if PER_CHANNEL:
            scales = a_scale[:, None] * tl.load(w_scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
        else:
            scales = a_scale[:, None] * tl.load(w_scale_ptr)
        c = acc.to(tl.float32) * scales
        if HAS_BIAS:
            c += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
        tl.store(out, c.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])

    @triton.jit
    def _gemm_kernel(a_ptr, w_ptr, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N,
                     stride_a, stride_w, stride_out, K: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """One output tile per program, operands through pointer loads (pipelined by num_stages)."""
        pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        # rows and columns past the edge read the first ones again; the epilogue stores none of them
        rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_a + ks[None, :]
        w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs, mask=ks[None, :] < K - k0, other=0)
            w = tl.load(w_ptrs, mask=ks[None, :] < K - k0, other=0)
            acc = tl.dot(a, w.T, acc, out_dtype=tl.int32)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        _epilogue(acc, pid_m, pid_n, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, stride_out,
                  PER_CHANNEL, HAS_BIAS, BLOCK_M, BLOCK_N)

    @triton.jit
    def _gemm_tma_kernel(a_desc, w_desc, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, stride_out,
                         K: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """One output tile per program, operands by TMA (zero past the edges) into wgmma."""
        pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([pid_m * BLOCK_M, k0])
            w = w_desc.load([pid_n * BLOCK_N, k0])
            acc = tl.dot(a, w.T, acc, out_dtype=tl.int32)
        _epilogue(acc, pid_m, pid_n, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, stride_out,
                  PER_CHANNEL, HAS_BIAS, BLOCK_M, BLOCK_N)


def _jit_functions() -> list:
    """This module's Triton functions (kernels and the helpers they call), by name."""
    return [value for _, value in sorted(globals().items())
            if type(value).__module__.startswith("triton") and callable(getattr(value, "fn", None))]


#: The kernels' version: a digest of their source, which keys their configs in the tuning store and the table
#: the pack ships (quant/int8_triton_tuned.json; tests/test_int8_tuning.py holds the two equal).
KERNEL_VERSION = tuning.source_digest(*(f.fn for f in _jit_functions())) if triton is not None else None
SHIPPED = _shipped()
