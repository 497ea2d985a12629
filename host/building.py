"""The host of loaders/load.py: ComfyUI's model construction, interrupt and progress, by feature detection.

The loaders hand ComfyUI an operations class (`custom_operations`), which
replaces the ops ComfyUI would pick, for every layer. Its Linear allocates no
weight up front; when ComfyUI loads the state dict, each Linear asks the
LayerBuilder for its module by name. A quantized layer is built right there
(from the checkpoint's tensors, or by quantizing the plain weight the file
maps lazily) and swapped in once loading is done; every other layer loads as
ComfyUI's own `manual_cast` Linear. ComfyUI's architecture detection and model
classes do the rest, so any architecture ComfyUI knows loads this way.
"""
from __future__ import annotations

import torch

import comfy.model_detection
import comfy.model_management
import comfy.ops
import comfy.sd
import comfy.utils

from ..loaders import CheckpointError, CheckpointContents, LayerBuilder
from ..quant.quantize_pass import apply_replacements
from .file_backed import file_slice_marker
from .layers import ComfyQuantLinear
from .model import set_model_size


def progress_counter(total: int):
    """A callable that advances ComfyUI's progress bar by one step per call."""
    bar = comfy.utils.ProgressBar(max(total, 1))
    return lambda: bar.update(1)


def building_operations(builder: LayerBuilder):
    """An ops class for `custom_operations`: manual_cast, with a Linear that builds through `builder`."""
    base = comfy.ops.manual_cast

    class BuildingOperations(base):
        class Linear(base.Linear):
            def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
                torch.nn.Module.__init__(self)
                self.in_features, self.out_features = in_features, out_features
                self.factory = {"device": device, "dtype": dtype}
                self.register_parameter("weight", None)  # allocated at load, and only if kept plain
                self.bias = torch.nn.Parameter(torch.empty(out_features, **self.factory)) if bias else None
                self._set_built(None)

            def _set_built(self, module):
                # A plain attribute, not a submodule: load_state_dict would otherwise walk into it and
                # report its tensors as missing keys (`<layer>.built.weight`, ...).
                self.__dict__["built"] = module

            def reset_parameters(self):
                return None

            def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs):
                weight = state_dict.get(prefix + "weight")
                bias = state_dict.get(prefix + "bias") if self.bias is not None else None
                dtype = self.factory["dtype"] or (weight.dtype if weight is not None else torch.float32)
                self._set_built(builder.build(prefix[:-1], weight, self.in_features, self.out_features, bias,
                                              dtype, self.factory["device"]))
                if self.built is None:
                    self.weight = torch.nn.Parameter(torch.empty((self.out_features, self.in_features),
                                                                 **self.factory))
                    super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                  unexpected_keys, error_msgs)
                    for given, held in ((weight, self.weight), (bias, self.bias)):
                        # copied: its pages of the file go back (with assign=True it is the layer's own)
                        if given is not None and held is not None and held.data_ptr() != given.data_ptr():
                            builder.source.file_map.release(given)

        class Embedding(base.Embedding):
            def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs):
                dtype = self.weight.dtype if self.weight is not None else torch.float32
                table = builder.build_embedding(prefix[:-1], self.num_embeddings, self.embedding_dim, dtype)
                if table is not None:  # the file's quantized table, dequantized in place of its stand-in
                    state_dict[prefix + "weight"] = table
                super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                              unexpected_keys, error_msgs)

    return BuildingOperations


def install_built_layers(root: torch.nn.Module, operations) -> int:
    """Swap every Linear the builder built for its built module; returns how many."""
    built = {name: module.built for name, module in root.named_modules()
             if isinstance(module, operations.Linear) and module.built is not None}
    apply_replacements(root, built)
    return len(built)


def diffusion_namespace(contents: CheckpointContents) -> CheckpointContents:
    """The contents in the diffusion model's own names, stripping the prefix ComfyUI strips
    (e.g. "model.diffusion_model." in full checkpoints) and dropping what it drops."""
    keys = list(contents.plain_keys) + [f"{name}.weight" for name in contents.layers]
    prefix = comfy.model_detection.unet_prefix_from_state_dict(dict.fromkeys(keys))
    if not any(key.startswith(prefix) for key in keys):
        return contents
    return contents.renamed([(prefix, "")], only_matching=True)


def load_diffusion_model(contents: CheckpointContents, builder: LayerBuilder, state_dict: dict,
                         patcher_options: dict):
    """A ModelPatcher for the diffusion model, built through `builder`. Raises CheckpointError
    if ComfyUI does not recognize the architecture or a quantized layer found no Linear."""
    operations = building_operations(builder)
    patcher = comfy.sd.load_diffusion_model_state_dict(state_dict, model_options={"custom_operations": operations},
                                                       **patcher_options)
    if patcher is None:
        raise CheckpointError(contents.path, "ComfyUI could not detect the model type of this diffusion model")
    builder.finish()
    install_built_layers(patcher.model.diffusion_model, operations)
    set_model_size(patcher)  # it may have measured the model before the swap
    return patcher


class ComfyHost:
    """loaders.load's Host: a diffusion model, or with `clip_type` a text encoder of that type."""
    layer_type = ComfyQuantLinear

    def __init__(self, clip_type: str | None = None, embedding_directory=None, disable_dynamic: bool = False):
        self.clip_type, self.embedding_directory = clip_type, embedding_directory
        # a patcher without dynamic VRAM, where the host has it (reload_patcher's callers ask for one)
        self.patcher_options = {"disable_dynamic": True} if disable_dynamic else {}

    def check(self) -> None:
        comfy.model_management.throw_exception_if_processing_interrupted()

    def progress(self, total: int):
        return progress_counter(total)

    def namespace(self, contents: CheckpointContents) -> CheckpointContents:
        return diffusion_namespace(contents)

    def file_slices(self, path: str):
        return file_slice_marker(path)

    def build(self, contents: CheckpointContents, builder: LayerBuilder, state_dict: dict):
        if self.clip_type is None:
            patcher = load_diffusion_model(contents, builder, state_dict, self.patcher_options)
            return patcher, patcher.model
        clip = load_text_encoder(contents, builder, state_dict, self.clip_type, self.embedding_directory,
                                 self.patcher_options)
        return clip, clip.cond_stage_model


def clip_types() -> list[str]:
    """The text-encoder types this ComfyUI knows, as CLIPLoader lists them."""
    return [t.name.lower() for t in comfy.sd.CLIPType]


def host_marker_formats() -> dict[str, frozenset[str]]:
    """The marker formats ComfyUI's own loaders read (comfy.quant_ops' QUANT_ALGOS), by name, with the tensors
    each takes beside the weight; none on a host without them."""
    try:
        import comfy.quant_ops
    except ImportError:
        return {}
    algos = getattr(comfy.quant_ops, "QUANT_ALGOS", None) or {}
    return {name: frozenset(spec.get("parameters", ())) for name, spec in algos.items()}


def host_text_encoder(path: str, clip_type: str, embedding_directory, quantized: int):
    """(the text encoder at `path` as ComfyUI's CLIPLoader loads it, None) where ComfyUI made `quantized` of its
    layers quantized tensors (its loaders read markers only for some text-encoder families); else (None, why)."""
    from comfy.quant_ops import QuantizedTensor
    try:
        clip = comfy.sd.load_clip(ckpt_paths=[path], embedding_directory=embedding_directory,
                                  clip_type=getattr(comfy.sd.CLIPType, clip_type.upper()))
    except Exception as exc:  # e.g. a family whose loader reads no markers: packed weights of the wrong shape
        return None, f"ComfyUI's own loader failed ({type(exc).__name__}: {' '.join(str(exc).split())[:160]}...)"
    held = sum(1 for module in clip.cond_stage_model.modules()
               if isinstance(getattr(getattr(module, "weight", None), "data", None), QuantizedTensor))
    if held != quantized:
        return None, f"ComfyUI's own loader kept {held} of the file's {quantized} quantized layers"
    return clip, None


def load_text_encoder(contents: CheckpointContents, builder: LayerBuilder, state_dict: dict, clip_type: str,
                      embedding_directory, patcher_options: dict):
    """A CLIP object whose text encoder was built through `builder` (same guarantees as above)."""
    operations = building_operations(builder)
    clip = comfy.sd.load_text_encoder_state_dicts(
        [state_dict], embedding_directory=embedding_directory,
        clip_type=getattr(comfy.sd.CLIPType, clip_type.upper()),
        model_options={"custom_operations": operations}, **patcher_options)
    builder.finish()
    install_built_layers(clip.cond_stage_model, operations)
    set_model_size(clip.patcher)
    return clip
