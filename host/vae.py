"""SetVAEKernels (nodes/vae_kernels.py): a VAE's decode on the pack's kernels, on a copy of the VAE.

The copy's patcher is a clone; the input VAE, its patcher and its model stay as they are. Four parts, each
of which can be left to ComfyUI (the inputs' "host" value):
- linears: the layers the VAE's file stores quantized (ComfyUI's comfy-kitchen layers: MiniMax-H3's ViT
  decoder's INT8 ConvRot linears) become the pack's layers of their own format holding the very same tensors
  (`quant.quantize_pass.adopt_stored`), installed on the clone as object patches: the pack's INT8 kernels
  (comfy-kitchen's or the Triton kernel, measured per shape) run them, nothing is copied;
- attention: upstream's VAE modules call ComfyUI's `optimized_attention` (a global of their Python module)
  without transformer_options, so no attention override reaches them; during each decode that global is
  SetAttentionBackend's router (`attention.Router`, its `auto` measured per shape), put back after;
- weights: under dynamic VRAM ComfyUI pages a cast layer's weight in on each call and keeps it while the card
  has room. For a decode, ComfyUI is first asked to free the pack's layers' bytes and the decode's own estimate
  (`ask_room`, as ComfyUI's own decode asks: the sampled model's pages give way, no model is unloaded whole
  under dynamic VRAM, the VAE's own stays loaded), then their tensors are copied onto the card once and every
  tile computes from those copies, which go when the decode ends; where the card cannot hold them, ComfyUI's
  paging stays and the report says why. Without dynamic VRAM ComfyUI's own load puts the VAE on the card whole
  where the decode's estimate lets it, and the layers compute there.
- tiles: a VAE that decodes in spatial tiles of one size (upstream's MiniMax-H3 video VAE: 15 tiles of
  1,797 tokens per temporal chunk) runs its decoder once per tile, each pass too small to fill the GPU and
  launching every kernel again. During each decode the pack decodes a call's tiles in batches (the first
  alone, its peak memory measured; ComfyUI asked to free room for the rest, as for the weights; then as many
  at once as the card's free memory holds) and hands them, in order, to the VAE's own tiled decode, which
  blends and places them as it always does.
The VAE's own decode runs, with its tiling and blending: only the layers, the attention function and the
decoder's batch differ.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import functools
import sys
import time
from dataclasses import dataclass, field

import comfy.model_management
import torch
from torch import nn

from ..attention import Router, summary
from ..pack_logging import pack_logger
from ..quant.kitchen_api import is_quantized_tensor
from ..quant.linear import QuantLinear
from ..quant.quantize_pass import adopt_stored, walk_modules
from ..quant.witness import RunWitness
from ..units import format_gib
from .attention import AttentionOverride
from .dynamic_vram import prepare_dynamic_vram
from .model import ComfyModelHost, host_reserve, is_dynamic, module_view
from .report import show_on_node
from .tuning import use_tuning_store

log = pack_logger(__name__)

TITLE = "SetVAEKernels"
HOST = "host"  # an input's value that leaves that part to ComfyUI
LINEARS = ("pack", HOST)
WEIGHTS = ("resident", HOST)
TILES = ("batched", HOST)
_TILE_API = ("tiled_decode", "_decode_pixels", "split_tiles", "vae_ratio")  # upstream's MiniMax-H3 video VAE
_BATCH_MARGIN = 1.25  # a batch's measured peak per tile times this must fit the card's free memory
ATTENTION_GLOBAL = "optimized_attention"  # ComfyUI's attention function, as upstream's model modules import it
_SOURCE = "_bigdit_vae_source"  # on a copy this node made: the VAE it was made from


def attention_modules(model: nn.Module) -> tuple:
    """The Python modules defining `model`'s layers that call ComfyUI's attention through a global of theirs."""
    names = {type(m).__module__ for m in model.modules()}
    return tuple(sys.modules[n] for n in sorted(names)
                 if n in sys.modules and callable(getattr(sys.modules[n], ATTENTION_GLOBAL, None)))


@contextlib.contextmanager
def attention_through(modules: tuple, router: Router):
    """While active, the `optimized_attention` of `modules` is `router` (ComfyUI's attention signature)."""
    saved = {module: getattr(module, ATTENTION_GLOBAL) for module in modules}
    function = AttentionOverride(router).attention
    for module in modules:
        setattr(module, ATTENTION_GLOBAL, function)
    try:
        yield
    finally:
        for module, previous in saved.items():
            setattr(module, ATTENTION_GLOBAL, previous)


def _layer_bytes(layers) -> int:
    return sum(t.nbytes for layer in layers for t in layer._parameters.values() if t is not None)


@contextlib.contextmanager
def resident_weights(patcher, layers: dict[str, QuantLinear], activation_bytes: int):
    """While active, `layers` compute from copies of their tensors on `patcher`'s device, made once (see the
    module's docstring); yields what was done, for the report."""
    device = patcher.load_device
    if not layers or device.type == "cpu":
        yield f"weights on {device}"
        return
    if not is_dynamic(patcher):
        yield "weights placed by ComfyUI"
        return
    needed = _layer_bytes(layers.values())
    wanted = needed + activation_bytes + host_reserve()
    free = ask_room(patcher, wanted, device)
    if free < wanted:
        yield (f"weights paged by ComfyUI: {format_gib(free)} free on {device}, resident weights and the decode "
               f"need {format_gib(wanted)}")
        return
    start = time.perf_counter()
    try:
        copies = {id(layer): {key: None if t is None else t.to(device) for key, t in layer._parameters.items()}
                  for layer in layers.values()}
    except torch.OutOfMemoryError:  # the room ComfyUI counted was not there after all
        comfy.model_management.soft_empty_cache()
        yield f"weights paged by ComfyUI: copying {format_gib(needed)} onto {device} ran out of memory"
        return
    seconds = time.perf_counter() - start

    @contextlib.contextmanager
    def from_copies(layer, call_device):
        yield copies.get(id(layer)) if call_device == device else None

    pagers = {name: layer.weight_pager for name, layer in layers.items()}
    for layer in layers.values():
        layer.weight_pager = from_copies
    try:
        yield f"weights resident on {device} ({format_gib(needed)} copied in {seconds:.2f} s)"
    finally:
        for name, layer in layers.items():
            layer.weight_pager = pagers[name]
        copies.clear()
        comfy.model_management.soft_empty_cache()  # the copies' memory back to the card, for the host's pages


def ask_room(patcher, memory_required: int, device) -> int:
    """ComfyUI asked to free `memory_required` bytes on `device` as its own VAE decode asks: `patcher`'s model kept
    loaded, and under dynamic VRAM no dynamic model unloaded whole (`for_dynamic`: their pages give way as memory is
    allocated); the bytes free then (`room`). A model unloaded whole is detached: the VAE's own would have its
    object patches, the pack's layers, put back mid-decode (a first H3 decode on an H100 whose 13 batched passes ran
    the host's layers that way took 10.3 s against 4.3 s in the next job), and a text encoder its pinned copy freed,
    to be read from the disk again by the next job (12.8 s there)."""
    keep = [loaded for loaded in comfy.model_management.current_loaded_models
            if getattr(loaded, "model", None) is patcher]
    dynamic = {"for_dynamic": True} if is_dynamic(patcher) else {}  # a host with dynamic VRAM takes the argument
    comfy.model_management.free_memory(memory_required, device, keep_loaded=keep, **dynamic)
    return room(patcher, device)


def room(patcher, device) -> int:
    """The bytes free on `device` as ComfyUI's own VAE decode counts them: the patcher's `get_free_memory` (torch's
    and, under dynamic VRAM, what comfy-aimdo can give back) where it has one, else ComfyUI's free memory."""
    measure = getattr(patcher, "get_free_memory", None)
    return int(measure(device)) if callable(measure) else comfy.model_management.get_free_memory(device)


def tiles_batchable(model) -> bool:
    """Whether `model` decodes in spatial tiles the way `batched_tiles` feeds them (upstream's MiniMax-H3 video
    VAE: `tiled_decode` asks `_decode_pixels` for each tile of `split_tiles`' plan, rows then columns)."""
    return all(callable(getattr(model, name, None)) for name in _TILE_API[:3]) and hasattr(model, _TILE_API[3])


@dataclass
class TileCount:
    """The tiles of one decode and the decoder passes that made them."""
    tiles: int = 0
    passes: int = 0
    alone: int = 0  # tiles the plan did not foresee, decoded one by one

    def render(self) -> str:
        text = f"tiles {self.tiles} in {self.passes} pass{'es' if self.passes != 1 else ''}"
        return text + (f" ({self.alone} decoded alone)" if self.alone else "")


def _decode_batches(decode, tiles: list, count: TileCount, patcher=None) -> list:
    """`decode` on `tiles`, the first alone and the rest in batches as large as the first pass's measured peak
    allows on a CUDA device (all at once elsewhere; ComfyUI asked for their room, `patcher`'s model kept
    loaded), a batch the card cannot hold after all halved; tiles of more than one shape each alone. Each tile's
    pixels, in order."""
    out, size, start = [], 1, 0
    cuda = tiles[0].device.type == "cuda"
    uniform = all(t.shape == tiles[0].shape for t in tiles)  # else no batch: each tile alone
    if not cuda and uniform:
        size = len(tiles)
    while start < len(tiles):
        group = tiles[start:start + size]
        if cuda and start == 0:
            torch.cuda.reset_peak_memory_stats(tiles[0].device)
            base = torch.cuda.memory_allocated(tiles[0].device)
        try:
            pixels = decode(torch.cat(group) if len(group) > 1 else group[0])
        except torch.OutOfMemoryError:
            if len(group) == 1:
                raise
            comfy.model_management.soft_empty_cache()
            size = max(1, len(group) // 2)
            continue
        out += pixels.split(tiles[0].shape[0]) if len(group) > 1 else [pixels]
        count.passes += 1
        if cuda and start == 0 and len(tiles) > 1 and uniform:
            per_tile = max(1, torch.cuda.max_memory_allocated(tiles[0].device) - base) * _BATCH_MARGIN
            # ComfyUI is asked for the rest's room, as for resident weights (ask_room)
            free = ask_room(patcher, per_tile * (len(tiles) - 1) + host_reserve(), tiles[0].device)
            size = max(1, int((free - host_reserve()) // per_tile))
        start += len(group)
    count.tiles += len(tiles)
    return out


@contextlib.contextmanager
def batched_tiles(model, count: TileCount, patcher=None):
    """While active, `model`'s own tiled decode gets each tile's pixels from batched decoder passes: the tiles
    its plan (`split_tiles`) gives for the call's latent are decoded first, in batches, then its `tiled_decode`
    runs as it is and receives them in its order; a tile it asks for that the plan did not give is decoded
    alone. `patcher`: the VAE's, kept loaded when ComfyUI is asked for the batches' room."""
    own_tiled = model.tiled_decode
    own_pixels = model._decode_pixels
    shadowed = {name: name in vars(model) for name in ("tiled_decode", "_decode_pixels")}  # instance attributes

    def tiled_decode(z, *args, **kwargs):
        ratio = model.vae_ratio
        rows = model.split_tiles(z.shape[-2] * ratio)
        columns = model.split_tiles(z.shape[-1] * ratio)
        tiles = [z[..., y // ratio:y // ratio + h // ratio, x // ratio:x // ratio + w // ratio]
                 for y, h in zip(rows[0], rows[1]) for x, w in zip(columns[0], columns[1])]
        ready = collections.deque(zip(tiles, _decode_batches(own_pixels, tiles, count, patcher)))

        def from_batch(tile):
            if ready and ready[0][0].shape == tile.shape and ready[0][0].data_ptr() == tile.data_ptr():
                return ready.popleft()[1]
            count.alone += 1
            count.passes += 1
            return own_pixels(tile)
        model._decode_pixels = from_batch
        try:
            return own_tiled(z, *args, **kwargs)
        finally:
            _restore(model, "_decode_pixels", own_pixels, shadowed["_decode_pixels"])
            ready.clear()

    model.tiled_decode = tiled_decode
    try:
        yield
    finally:
        _restore(model, "tiled_decode", own_tiled, shadowed["tiled_decode"])


def _restore(model, name: str, own, shadowed: bool) -> None:
    """Put back `model`'s instance attribute `name` as it was, or remove ours where there was none."""
    if shadowed:
        setattr(model, name, own)
    else:
        delattr(model, name)


@dataclass
class VAEKernels:
    """One node's settings on its VAE copy: its `decode` and `decode_tiled` run the VAE's own through `run`."""
    layers: dict[str, QuantLinear]
    modules: tuple
    router: Router | None
    resident: bool
    tiles: object  # the VAE's model, whose tiles are batched; None: the VAE's own passes
    text: str
    node_id: object = None
    witness: RunWitness = field(init=False)

    def __post_init__(self):
        self.witness = RunWitness(self.layers)

    def run(self, method, vae, samples, *args, **kwargs):
        self.witness.begin()
        weights = resident_weights(vae.patcher, self.layers, _decode_bytes(vae, samples)) if self.resident \
            else contextlib.nullcontext("weights placed by ComfyUI")
        attention = attention_through(self.modules, self.router) if self.router is not None \
            else contextlib.nullcontext()
        count = TileCount()
        tiles = batched_tiles(self.tiles, count, vae.patcher) if self.tiles is not None else contextlib.nullcontext()
        start = time.perf_counter()
        with weights as placed, attention, tiles:
            out = method(vae, samples, *args, **kwargs)
        parts = [f"{time.perf_counter() - start:.2f} s", placed]
        if self.tiles is not None:
            parts.append(count.render())
        if self.layers:
            taken = self.witness.take()
            parts += [taken.render(), *filter(None, [taken.render_kernels()])]
        if self.router is not None:
            counts = self.router.stats.take_run()
            parts.append(f"attention {summary(counts)}" if counts["calls"] else "no attention call reached the router")
            parts += self.router.take_choices()
        line = "; ".join(parts)
        log.info("%s: decode of %s: %s", TITLE, list(samples.shape), line)
        show_on_node(self.node_id, f"{self.text}\nlast decode: {line}")
        return out


def _decode_bytes(vae, samples) -> int:
    """The VAE's own estimate of its decode's memory (what its decode asks ComfyUI for), 0 where it has none."""
    try:
        return int(vae.memory_used_decode(samples.shape, vae.vae_dtype))
    except Exception:  # noqa: BLE001 - a VAE without a usable estimate: the layers' bytes alone are asked for
        return 0


def _stored_quantized(root: nn.Module, overrides: dict) -> bool:
    return any(is_quantized_tensor(getattr(m, "weight", None)) for _, m in walk_modules(root, overrides))


def _linears_line(replacements: dict, report, linears: str) -> str:
    if replacements:
        formats = ", ".join(f"{fmt} x{n}" for fmt, n in report.method_counts().items())
        return f"linears: {len(replacements)} on the pack's kernels ({formats}, holding the file's tensors)"
    return "linears: ComfyUI's" + (" (none stored quantized)" if linears == "pack" else "")


def _attention_line(router: Router | None, attention: str, name: str) -> str:
    if router is not None:
        return f"attention: {router.describe()}"
    return "attention: ComfyUI's" + ("" if attention == HOST else f" ({name} calls none the pack routes)")


def _weights_line(patcher, resident: bool) -> str:
    if not resident:
        return "weights: placed by ComfyUI"
    if patcher.load_device.type == "cpu":
        return "weights: on the CPU (ComfyUI's VAE device)"
    if is_dynamic(patcher):
        return "weights: resident on the card during each decode"
    return "weights: placed by ComfyUI (its load keeps the VAE on the card where it fits)"


def _tiles_line(batched: bool, tiles: str, device) -> str:
    if batched:
        return "tiles: decoded in batches, " + ("as many as the card's free memory holds" if device.type == "cuda"
                                                else f"all of a call's at once on {device.type}")
    return "tiles: ComfyUI's, one pass each" + ("" if tiles == HOST else " (the VAE has no tiles the pack batches)")


def set_vae_kernels(vae, attention: str, linears: str, weights: str, node_id=None,
                    tiles: str = "batched") -> tuple[object, str, str]:
    """(the VAE the node returns, its short text, its full report); see the module's docstring. An earlier
    SetVAEKernels copy is replaced, not stacked: this one starts from the VAE it was made from."""
    vae = getattr(vae, _SOURCE, vae)
    model = getattr(vae, "first_stage_model", None)
    if model is None:
        raise ValueError(f"{TITLE}: the VAE is invalid (no model: the loader found no VAE weights)")
    root, overrides = module_view(vae.patcher, prefix="")
    replacements, report = {}, None
    if linears == "pack" and _stored_quantized(root, overrides):
        replacements, report = adopt_stored(root, overrides, ComfyModelHost(), TITLE)
    modules = attention_modules(model) if attention != HOST else ()
    batched = tiles != HOST and tiles_batchable(model)
    name = type(model).__name__
    if not replacements and not modules and not batched:
        why = ("linears left to ComfyUI" if linears == HOST else "no layer stored quantized",
               "attention left to ComfyUI" if attention == HOST else "no ComfyUI attention function the pack routes",
               "tiles left to ComfyUI" if tiles == HOST else "no tiles the pack batches")
        text = f"passed through unchanged ({name}: {'; '.join(why)})"
        log.info("%s: %s", TITLE, text)
        return vae, text, text
    new = copy.copy(vae)
    new.patcher = vae.patcher.clone()
    for path, layer in replacements.items():
        new.patcher.add_object_patch(path, layer)
    prepare_dynamic_vram(new.patcher, replacements)
    router = Router(attention) if modules else None
    if router is not None:
        use_tuning_store()  # auto's kept decisions, as on disk now
    text = "\n".join((_linears_line(replacements, report, linears), _attention_line(router, attention, name),
                      _weights_line(new.patcher, weights == "resident" and bool(replacements)),
                      _tiles_line(batched, tiles, new.patcher.load_device)))
    kernels = VAEKernels(replacements, modules, router, weights == "resident", model if batched else None, text,
                         node_id)
    new.decode = functools.partial(kernels.run, type(vae).decode, new)
    new.decode_tiled = functools.partial(kernels.run, type(vae).decode_tiled, new)
    setattr(new, _SOURCE, vae)
    full = text if report is None else f"{text}\n{report.render()}"
    log.info("%s on %s:\n%s", TITLE, name, full)
    return new, text, full
