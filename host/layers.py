"""ComfyUI's cast and weight-patch protocols on the pack's quantized layer.

`ComfyQuantLinear` is the QuantLinear every loader and QuantizeModelINT8 build
for a ComfyUI model (the core builds it through the `layer_type` it is handed).
ComfyUI finds these protocols by name, never by type:
- `comfy_cast_weights`: ComfyUI's partial loading marks a layer it leaves in RAM
  (its tensors are then moved per call, QuantLinear.tensors_on); upstream's
  dynamic VRAM treats a module with the attribute as a cast layer and pages its
  weight and bias (host/dynamic_vram.py sets the layer's `weight_pager`);
- per-call patches: `weight_function` / `bias_function`, and upstream's dynamic
  VRAM's `weight_lowvram_function` (a LoRA on an offloaded or paged layer), all
  applied by the core to the dequantized weight (`weight_patches`), less those
  the layer's LoRA branch computes;
- a LoRA as a low-rank branch beside the GEMM (`lora_branch`, the core's
  `output_branches`; host/lora_branch.py installs it);
- the weight-patch protocol (`convert_weight` / `set_weight`, looked up by
  ModelPatcher as `convert_<name>` / `set_<name>`): a LoRA is written in and
  requantized with fresh scales; the tensors it replaced come back when ComfyUI
  assigns the weight again, its restore (`register_parameter`), while the
  streamer's swaps of `_parameters` entries leave the patch in place.
"""
from __future__ import annotations

import torch
from torch import nn

from ..dtypes import FLOAT_DTYPES
from ..quant.linear import QuantLinear


class ComfyQuantLinear(QuantLinear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.comfy_cast_weights = False
        self.weight_function: list = []
        self.bias_function: list = []
        # Upstream's dynamic VRAM attaches a LoRA here instead of in weight_function
        # (its cast layers apply it while copying the weight in).
        self.weight_lowvram_function = None
        self.bias_lowvram_function = None
        self.lora_branch = None  # host.lora_branch.LoraBranch: a LoRA computed beside the GEMM

    def weight_patches(self, name: str) -> list:
        """ComfyUI's per-call patches of `name`, in the order its own cast layers apply them, less those the LoRA
        branch computes (a LowVramPatch ComfyUI's partial unload adds to a layer it offloads)."""
        lowvram = getattr(self, f"{name}_lowvram_function")
        patches = ([] if lowvram is None else [lowvram]) + list(getattr(self, f"{name}_function"))
        if self.lora_branch is not None:
            patches = [p for p in patches if not self.lora_branch.covers(p)]
        return patches

    def output_branches(self) -> list:
        return [] if self.lora_branch is None else [self.lora_branch]

    def convert_weight(self, weight: torch.Tensor, inplace: bool = False, **_) -> torch.Tensor:
        """The dequantized weight ComfyUI's patches apply to: the unpatched one where this layer holds it.

        ComfyUI computes a weight patch from its backup of the unpatched weight
        and expects to find that weight in the layer. A layer whose LoRA was
        folded in while it was offloaded (host/lora_fold.py) and that ComfyUI
        then loads onto the GPU is patched again: from the unpatched weight, or
        the LoRA would be added twice. `weight` is a float copy for a LoRA, or,
        in upstream's dynamic VRAM forced load, a copy of the stored tensor
        (int8, fp8, packed): a float comes back either way, never the storage dtype.
        """
        dtype = weight.dtype if weight.dtype in FLOAT_DTYPES else self.compute_dtype
        return self.dequantized(weight.device, dtype, unpatched=True)

    def set_weight(self, weight: torch.Tensor, inplace_update: bool = False, seed=None, return_weight: bool = False,
                   **_) -> torch.Tensor | None:
        """Requantize a patched weight with fresh scales (QuantLinear.write_patched).

        ComfyUI backs up and later restores only `weight`, so the tensors it
        replaces are kept by the layer and put back when ComfyUI assigns the weight
        again (register_parameter). The unpatched weight itself is kept where it
        costs nothing: in host memory, where ComfyUI's backup is the same tensor.
        With `return_weight` (0.3.75's partial loading, model saving) nothing is
        stored: the weight this layer would compute with comes back, in `weight`'s dtype.
        """
        if return_weight:
            fresh = self.method.quantize_weight(weight.to(self.compute_dtype))
            stored = QuantLinear(self.method, self.in_features, self.out_features, fresh, None, self.compute_dtype)
            return self.method.dequantize(stored).to(weight.dtype)
        if inplace_update:
            # An in-place restore would bring back the weight but not the scales, unnoticed.
            raise RuntimeError("in-place weight patching (weight_inplace_update) of a quantized layer is not "
                               "supported; patch the model before quantizing it instead")
        self.write_patched(weight, keep_weight=self.weight.device.type == "cpu")

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        """Assigning `weight` while a patch is written in is ComfyUI restoring the unpatched weight
        (unpatch_model, partially_unload): the scales it replaced come back with it.

        An assignment, not a comparison with the patched tensor: the pack's
        streaming (offload/streaming.py) swaps a streamed layer's tensors for
        device copies in `_parameters` for the duration of a block.
        """
        if name == "weight" and self.__dict__.get("_unpatched") is not None:
            self.restore_unpatched(weight_too=False)
        super().register_parameter(name, param)


def fp8_weight_scale(module: nn.Module) -> torch.Tensor | None:
    """The per-tensor scale of ComfyUI 0.3.75's scaled_fp8 Linear (`scale_weight`), which a plain FP8 weight is
    multiplied by; None for any other layer."""
    return getattr(module, "scale_weight", None)
