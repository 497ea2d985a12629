"""`auto`: the fastest exact dense kernel for the GPU, by a measured table.

For each call, `auto` tries the kernels measured on this GPU's compute
capability from fastest to slowest and runs the first one that can take the
call (dtype, head dim, mask...), then plain SDPA. GPUs without an entry, and
every CPU, get SDPA.

Only exact kernels (attention up to rounding) are in the table. FA3's FP8
kernel (`fa3_fp8`) is faster but not exact: in a real ComfyUI sampling run of
a Wan 14B-shaped model it moved the latent to cosine 0.994 of the resident
reference, against 0.9994 for FP8 linears alone (README, end-to-end table), so
it is chosen by name only, as Sol is.
"""
from __future__ import annotations

import torch

from ..hardware import cuda_capability
from .base import Backend
from .kernels import FA2, FA4, FA3Fwd, FA3Interface, KitchenInt8, Sage, Sdpa, SdpaCudnn, SdpaFlash
from .registry import register_backend

# Milliseconds for one attention of 56 heads x 32760 tokens x head dim 128,
# bf16 (MiniMax-H3 at 1344x768x107), keyed by compute capability.
# (9, 0): one H200, torch 2.11 cu130, sageattention 1.0.6, comfy-kitchen
# 0.2.40, fa3-fwd 0.0.3; tests/bench/attention.py measures it again.
MEASURED_MS = {
    (9, 0): {"fa3": 43.0, "sdpa_cudnn": 52.8, "kitchen_int8": 66.2, "sage": 69.8},
}

# table name -> kernels, in preference order (both FA3 builds are "fa3")
KERNELS = {
    "fa3": (FA3Fwd, FA3Interface),
    "fa2": (FA2,),
    "fa4": (FA4,),
    "sdpa_flash": (SdpaFlash,),
    "sdpa_cudnn": (SdpaCudnn,),
    "kitchen_int8": (KitchenInt8,),
    "sage": (Sage,),
    "sdpa": (Sdpa,),
}


def ranking(cap: tuple[int, int] | None) -> list[str]:
    """Table names for a compute capability (None: not a CUDA GPU), fastest
    first, always ending with plain SDPA."""
    times = MEASURED_MS.get(cap, {})
    return sorted(times, key=times.get) + ["sdpa"]


@register_backend("auto", selector=True)
class Auto(Backend):
    def __init__(self, **_):
        super().__init__("auto", [])
        self._by_cap = {}

    def impls_for(self, device: torch.device):
        cap = cuda_capability(device)
        if cap not in self._by_cap:
            self._by_cap[cap] = [cls() for name in ranking(cap) for cls in KERNELS[name]]
        return self._by_cap[cap]
