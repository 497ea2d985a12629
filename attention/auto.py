"""`auto`: the fastest dense kernel for the GPU, by a measured table.

For each call, `auto` tries the kernels measured on this GPU's compute
capability from fastest to slowest and runs the first one that can take the
call (dtype, head dim, mask...), then plain SDPA. GPUs without an entry, and
every CPU, get SDPA.

An approximate kernel in the table (FA3 FP8) runs only where it measured
accurate: the first CHECKS calls of each shape run it and the fastest exact
kernel that takes the call, and compare. Within MAX_REL_ERROR of the exact
output, that shape keeps the approximate kernel; beyond it (or non-finite),
the shape runs exact kernels from then on, with one warning. A checked call
returns the exact output when the check fails.
"""
from __future__ import annotations

import logging

import torch

from .base import Backend, Impl, Plan, Unsupported, capability
from .fa3_fp8 import FA3Fp8
from .kernels import FA2, FA4, FA3Fwd, FA3Interface, KitchenInt8, Sage, Sdpa, SdpaCudnn, SdpaFlash

log = logging.getLogger(__name__)

# Milliseconds for one attention of 56 heads x 32760 tokens x head dim 128,
# bf16 (MiniMax-H3 at 1344x768x107), keyed by compute capability.
# (9, 0): one H200, torch 2.11 cu130, sageattention 1.0.6, comfy-kitchen
# 0.2.40, fa3-fwd 0.0.3; tests/bench/attention.py measures it again.
# fa3_fp8: FA3's FP8 kernel alone (33.2 ms); the fused quantization pass moves
# about 2.5 GB at this shape (under 1 ms), tests/bench/attention_fp8.py measures both.
MEASURED_MS = {
    (9, 0): {"fa3_fp8": 33.2, "fa3": 43.0, "sdpa_cudnn": 52.8, "kitchen_int8": 66.2, "sage": 69.8},
}

# table name -> kernels, in preference order (both FA3 builds are "fa3")
KERNELS = {
    "fa3_fp8": (FA3Fp8,),
    "fa3": (FA3Fwd, FA3Interface),
    "fa2": (FA2,),
    "fa4": (FA4,),
    "sdpa_flash": (SdpaFlash,),
    "sdpa_cudnn": (SdpaCudnn,),
    "kitchen_int8": (KitchenInt8,),
    "sage": (Sage,),
    "sdpa": (Sdpa,),
}
# the kernels whose output is attention up to rounding: what a check compares with
EXACT = ("fa3", "fa2", "fa4", "sdpa_flash", "sdpa_cudnn", "sdpa")
# approximate kernels auto runs only after an accuracy check
CHECKED = ("fa3_fp8",)

# Relative L2 error of the attention output against an exact kernel. FP8 E4M3
# keeps 3 mantissa bits (2.6% RMS per element at any scale), which costs about
# 0.034 on locality-structured inputs and 0.054 on unstructured random ones
# (emulated on CPU, FA3's FP8 probabilities included; the H200 measured 0.054
# for FA3 FP8 against bf16). 0.08 passes that floor and catches where
# per-head scales break down (a few outliers pushing the rest of a head into
# FP8's subnormals) and a kernel returning garbage.
MAX_REL_ERROR = 0.08
CHECKS = 3  # calls per shape compared (the first blocks of the first forward)


def ranking(cap: tuple[int, int] | None) -> list[str]:
    """Table names for a compute capability (None: not a CUDA GPU), fastest
    first, always ending with plain SDPA."""
    times = MEASURED_MS.get(cap, {})
    return sorted(times, key=times.get) + ["sdpa"]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((out.float() - ref).norm() / ref.norm().clamp(min=1e-30)).item()


class Checked(Impl):
    """`impl`, accepted per call shape only after its first CHECKS calls came
    within `max_error` of the first of `exact` that takes the call."""

    def __init__(self, impl: Impl, exact: list[Impl], max_error: float = MAX_REL_ERROR, checks: int = CHECKS):
        self.impl, self.exact = impl, exact
        self.label, self.constraints = impl.label, impl.constraints
        self.max_error, self.checks = max_error, checks
        self._seen = {}  # shape key -> (calls checked, worst error)
        self._rejected = {}  # shape key -> reason

    def unavailable(self):
        return self.impl.unavailable()

    def plan(self, q, k, v, *, layout, mask, scale, options):
        key = (q.device, q.dtype, layout, tuple(q.shape), tuple(k.shape), tuple(v.shape))
        if key in self._rejected:
            raise Unsupported(self._rejected[key])
        inner = self.impl.plan(q, k, v, layout=layout, mask=mask, scale=scale, options=options)
        checked, _ = self._seen.get(key, (0, 0.0))
        if checked >= self.checks:
            return inner
        reference = Backend("exact", self.exact).plan(q, k, v, layout=layout, mask=mask, scale=scale,
                                                      transformer_options=options)
        exact_label = reference.label.split(":", 1)[-1]

        def run():
            out, ref = inner.run(), reference.run()
            err = relative_error(out, ref)
            n, worst = self._seen.get(key, (0, 0.0))
            if not err <= self.max_error:  # NaN fails too
                why = (f"{self.label} measured relative error {err:.3g} > {self.max_error:g} "
                       f"against {exact_label} at this shape")
                self._rejected[key] = why
                log.warning("bigdit attention: auto: %s (q %s, k %s); running exact kernels for it",
                            why, tuple(q.shape), tuple(k.shape))
                return ref
            self._seen[key] = (n + 1, max(worst, err))
            if n + 1 == self.checks:
                log.info("bigdit attention: auto: %s within %g of %s at q %s, k %s (worst %.3g of %d calls)",
                         self.label, self.max_error, exact_label, tuple(q.shape), tuple(k.shape),
                         max(worst, err), self.checks)
            return out

        return Plan(f"{inner.label} checked against {exact_label}", run)


class Auto(Backend):
    def __init__(self):
        super().__init__("auto", [])
        self._by_cap = {}

    def impls_for(self, device: torch.device):
        cap = capability(device)
        if cap not in self._by_cap:
            names = ranking(cap)
            exact = [cls() for name in names if name in EXACT for cls in KERNELS[name]]
            self._by_cap[cap] = [Checked(cls(), exact) if name in CHECKED else cls()
                                 for name in names for cls in KERNELS[name]]
        return self._by_cap[cap]
