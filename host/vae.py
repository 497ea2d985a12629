"""SetVAEKernels (nodes/vae_kernels.py): a VAE's decode on the pack's kernels, on a copy of the VAE.

The copy's patcher is a clone; the input VAE, its patcher and its model stay as they are. Three parts, each
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
  (`free_memory`: the sampled model's pages go first), then their tensors are copied onto the card once and
  every tile computes from those copies, which go when the decode ends; where the card cannot hold them,
  ComfyUI's paging stays and the report says why. Without dynamic VRAM ComfyUI's own load puts the VAE on the
  card whole where the decode's estimate lets it, and the layers compute there.
The VAE's own decode runs, with its tiling: only the layers and the attention function differ.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import sys
import time
from dataclasses import dataclass, field

import comfy.model_management
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

log = pack_logger(__name__)

TITLE = "SetVAEKernels"
HOST = "host"  # an input's value that leaves that part to ComfyUI
LINEARS = ("pack", HOST)
WEIGHTS = ("resident", HOST)
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
    comfy.model_management.free_memory(wanted, device)
    free = comfy.model_management.get_free_memory(device)
    if free < wanted:
        yield (f"weights paged by ComfyUI: {format_gib(free)} free on {device}, resident weights and the decode "
               f"need {format_gib(wanted)}")
        return
    start = time.perf_counter()
    copies = {id(layer): {key: None if t is None else t.to(device) for key, t in layer._parameters.items()}
              for layer in layers.values()}
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


@dataclass
class VAEKernels:
    """One node's settings on its VAE copy: its `decode` and `decode_tiled` run the VAE's own through `run`."""
    layers: dict[str, QuantLinear]
    modules: tuple
    router: Router | None
    resident: bool
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
        start = time.perf_counter()
        with weights as placed, attention:
            out = method(vae, samples, *args, **kwargs)
        parts = [f"{time.perf_counter() - start:.2f} s", placed]
        if self.layers:
            parts.append(self.witness.take().render())
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


def set_vae_kernels(vae, attention: str, linears: str, weights: str, node_id=None) -> tuple[object, str, str]:
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
    name = type(model).__name__
    if not replacements and not modules:
        why = ("linears left to ComfyUI" if linears == HOST else "no layer stored quantized",
               "attention left to ComfyUI" if attention == HOST else "no ComfyUI attention function the pack routes")
        text = f"passed through unchanged ({name}: {'; '.join(why)})"
        log.info("%s: %s", TITLE, text)
        return vae, text, text
    new = copy.copy(vae)
    new.patcher = vae.patcher.clone()
    for path, layer in replacements.items():
        new.patcher.add_object_patch(path, layer)
    prepare_dynamic_vram(new.patcher, replacements)
    router = Router(attention) if modules else None
    text = "\n".join((_linears_line(replacements, report, linears), _attention_line(router, attention, name),
                      _weights_line(new.patcher, weights == "resident" and bool(replacements))))
    kernels = VAEKernels(replacements, modules, router, weights == "resident", text, node_id)
    new.decode = functools.partial(kernels.run, type(vae).decode, new)
    new.decode_tiled = functools.partial(kernels.run, type(vae).decode_tiled, new)
    setattr(new, _SOURCE, vae)
    full = text if report is None else f"{text}\n{report.render()}"
    log.info("%s on %s:\n%s", TITLE, name, full)
    return new, text, full
