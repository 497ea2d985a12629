"""Building blocks shared by every attention kernel: what a kernel declares it
can run (`Constraints`), one kernel (`Impl`), and a user-facing backend that
tries its kernels in order (`Backend`).

Tensors are 4-D in one of two layouts, "BHSD" (batch, heads, sequence, head
dim) or "BSHD"; a kernel returns its output in the layout it was given. Masks
are SDPA-style whatever the layout: boolean (True = attend) or additive float,
broadcastable to (batch, heads, queries, keys).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from ..dtypes import FLOAT_DTYPES, HALF_DTYPES
from ..hardware import cuda_capability as capability
from ..pack_logging import pack_logger
from . import compiled_ops
from .options import NO_OPTIONS, CallOptions

log = pack_logger(__name__)

LAYOUTS = ("BHSD", "BSHD")


@dataclass(frozen=True)
class BackendParam:
    """A setting a backend takes beyond the router's (Sol's tau): declared with its backend
    (`register_backend(params=...)`), offered by SetAttentionBackend as an input, checked here."""
    name: str
    default: float
    low: float
    high: float
    step: float
    tooltip: str

    def problem(self, value) -> str | None:
        """Why `value` cannot be this setting, or None (NaN is outside every range)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not self.low <= value <= self.high:
            return f"{self.name} must be a number from {self.low:g} to {self.high:g}, got {value!r}"
        return None


class Unsupported(Exception):
    """A kernel or backend cannot take this call; the message says why."""


class Unavailable(Unsupported):
    """The kernel would take the call but cannot run here at all (package or compiled kernel missing)."""


def dims(t: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """(batch, heads, seq, head_dim) of a tensor in `layout`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if t.dim() != 4:
        raise ValueError(f"attention tensors must be 4-D, got shape {tuple(t.shape)}")
    b, x, y, d = t.shape
    return (b, x, y, d) if layout == "BHSD" else (b, y, x, d)


def convert(t: torch.Tensor, src: str, dst: str) -> torch.Tensor:
    """Same tensor viewed in another layout (a transpose, never a copy)."""
    return t if src == dst else t.transpose(1, 2)


# (module, attr, package) -> what `load` returned. A plain dict, not lru_cache: torch.compile reads a
# dict entry as a constant, where it would trace through lru_cache into importlib (a graph break).
LOADED: dict[tuple, tuple] = {}


def load(module: str, attr: str | None, package: str) -> tuple[Callable | None, str | None]:
    """Import `module.attr` (the module itself when attr is None) once:
    (object, None) or (None, why it is missing)."""
    key = (module, attr, package)
    if key not in LOADED:
        LOADED[key] = _import(module, attr, package)
    return LOADED[key]


@torch.compiler.disable  # importlib cannot be traced; runs once per name
def _import(module: str, attr: str | None, package: str) -> tuple[Callable | None, str | None]:
    # Optional kernels may fail in many ways on import (no module, no GPU
    # driver, a Triton or CUDA mismatch), so any exception counts as missing.
    try:
        mod = importlib.import_module(module)
        return (mod if attr is None else getattr(mod, attr)), None
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            return None, f"{package} is not installed"
        return None, f"{package} failed to import ({type(e).__name__}: {e})"
    except Exception as e:  # noqa: BLE001 - see above
        return None, f"{package} failed to import ({type(e).__name__}: {e})"


@dataclass(frozen=True)
class Constraints:
    """What a kernel can run. Checked before a call, so a kernel that cannot
    take it is skipped with a reason instead of failing inside."""

    devices: frozenset | None = frozenset({"cuda"})  # None: any device
    min_capability: tuple[int, int] | None = None  # CUDA only
    max_capability: tuple[int, int] | None = None  # inclusive
    capabilities: frozenset | None = None  # exact set, for a kernel built per architecture
    dtypes: frozenset | None = FLOAT_DTYPES  # None: any
    max_head_dim: int | None = None
    head_dims: frozenset | None = None  # exact set, when the kernel has one
    masks: bool = True
    cross: bool = True  # query and key lengths may differ
    grouped_kv: bool = False  # fewer key/value heads than query heads (GQA/MQA)

    def check(self, q, k, v, layout, mask) -> None:
        dev = q.device
        if self.devices is not None and dev.type not in self.devices:
            raise Unsupported(f"needs {' or '.join(sorted(self.devices))}, got a {dev.type} tensor")
        if self.min_capability or self.max_capability or self.capabilities:
            cap = capability(dev)
            if cap is None:
                raise Unsupported(f"needs a CUDA GPU, got a {dev.type} tensor")
            if self.capabilities and cap not in self.capabilities:
                raise Unsupported(f"built for compute capability {', '.join(map(_cc, sorted(self.capabilities)))}, "
                                  f"GPU is {_cc(cap)}")
            if self.min_capability and cap < self.min_capability:
                raise Unsupported(f"needs compute capability >= {_cc(self.min_capability)}, GPU is {_cc(cap)}")
            if self.max_capability and cap > self.max_capability:
                raise Unsupported(f"built for compute capability <= {_cc(self.max_capability)}, GPU is {_cc(cap)}")
        if self.dtypes is not None and q.dtype not in self.dtypes:
            raise Unsupported(f"dtype {q.dtype} not in {sorted(str(d) for d in self.dtypes)}")
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise Unsupported(f"mixed dtypes {q.dtype}/{k.dtype}/{v.dtype}")
        d = dims(q, layout)[3]
        if self.head_dims is not None and d not in self.head_dims:
            raise Unsupported(f"head dim {d} not in {sorted(self.head_dims)}")
        if self.max_head_dim is not None and d > self.max_head_dim:
            raise Unsupported(f"head dim {d} > {self.max_head_dim}")
        if mask is not None and not self.masks:
            raise Unsupported("takes no attention mask")
        if not self.grouped_kv and dims(k, layout)[1] != dims(q, layout)[1]:
            raise Unsupported("fewer key/value heads than query heads (grouped-query attention)")
        if not self.cross and dims(k, layout)[2] != dims(q, layout)[2]:
            raise Unsupported("query and key lengths differ (cross-attention)")


def _cc(cap) -> str:
    return "none" if cap is None else f"{cap[0]}.{cap[1]}"


@dataclass(frozen=True)
class KernelCall:
    """A kernel that accepted a call: `run()` computes it."""

    label: str
    run: Callable[[], torch.Tensor]


class Impl:
    """One kernel. Subclasses set `label`, `constraints`, and implement `_run`
    (or override `kernel_call` when acceptance depends on more than the constraints)."""

    label = "?"
    constraints = Constraints()
    # relative L2 error from exact attention the kernel is held to; None: exact up to rounding
    max_error: float | None = None
    # dynamo traces `_run` itself (torch ops only); else it runs as one opaque op under torch.compile
    traceable = False

    def unavailable(self) -> str | None:
        """Why the kernel cannot be used at all (missing package), or None."""
        return None

    def preload(self) -> None:
        """Import now what deciding a call imports (its package, its build's constraints)."""
        self.unavailable()
        self.constraints  # noqa: B018 - a property that may read the package's build config

    def kernel_call(self, q, k, v, *, layout, mask, scale, options: CallOptions) -> KernelCall:
        self.constraints.check(q, k, v, layout, mask)
        why = self.unavailable()
        if why:
            raise Unavailable(why)
        return KernelCall(self.label, lambda: self.run(q, k, v, layout, mask, scale))

    def run(self, q, k, v, layout, mask, scale) -> torch.Tensor:
        """`_run`; while torch.compile traces, through one opaque op (compiled_ops.py) unless `traceable`."""
        if self.traceable or not torch.compiler.is_compiling():
            return self._run(q, k, v, layout, mask, scale)
        return compiled_ops.attention(self.label, q, k, v, layout, mask, scale)

    def _run(self, q, k, v, layout, mask, scale) -> torch.Tensor:
        raise NotImplementedError


class Backend:
    """A named backend: the first of its kernels that accepts a call runs it.

    Calling it runs the attention or raises `Unsupported` with every kernel's
    reason; `kernel_call` is the same decision without running. With
    `note_substitutes`, a kernel that would have taken the call but is not
    installed or built here is said once, with the kernel that runs instead.
    """

    def __init__(self, name: str, impls: list[Impl], *, note_substitutes: bool = False, settings: str = ""):
        self.name = name
        self.settings = settings  # its own parameters as the router describes them ("tau 1")
        self._impls = impls
        compiled_ops.register(impls)
        self._note_substitutes = note_substitutes
        self._noted = set()

    @property
    def kernels(self) -> list[Impl]:
        return list(self._impls)

    def impls_for(self, device: torch.device) -> list[Impl]:
        return self._impls

    def kernel_call(self, q, k, v, *, layout="BHSD", mask=None, scale=None,
                    options: CallOptions = NO_OPTIONS) -> KernelCall:
        dims(q, layout)  # validates the layout
        reasons, missing = [], []
        for impl in self.impls_for(q.device):
            try:
                call = impl.kernel_call(q, k, v, layout=layout, mask=mask, scale=scale, options=options)
            except Unsupported as e:
                reasons.append((impl.label, e.args[0]))
                if isinstance(e, Unavailable):
                    missing.append((impl.label, e.args[0]))
                continue
            if missing and self._note_substitutes and (call.label, tuple(missing)) not in self._noted:
                self._note(call.label, tuple(missing))
            label = self.name if call.label == self.name else f"{self.name}:{call.label}"
            return KernelCall(label, call.run)
        unique = list(dict.fromkeys(r for _, r in reasons))
        raise Unsupported(unique[0] if len(unique) == 1 else "; ".join(f"{l}: {r}" for l, r in reasons))

    def preload(self) -> None:
        """Look for each kernel's package now, eagerly: an import while torch.compile traces the first call
        would break its graph (and have dynamo compile that call's frames again)."""
        for impl in self._impls:
            impl.preload()

    @torch.compiler.assume_constant_result  # under torch.compile it runs once, while tracing: no graph break
    def _note(self, ran: str, missing: tuple) -> bool:
        if (ran, missing) not in self._noted:
            self._noted.add((ran, missing))
            log.warning("attention: %s runs %s: %s. Said once.", self.name, ran,
                        "; ".join(f"{label} is unavailable ({why})" for label, why in missing))
        return True

    def __call__(self, q, k, v, *, layout="BHSD", mask=None, scale=None,
                 options: CallOptions = NO_OPTIONS) -> torch.Tensor:
        return self.kernel_call(q, k, v, layout=layout, mask=mask, scale=scale, options=options).run()

    def __repr__(self):
        return f"<attention backend {self.name}: {[i.label for i in self._impls]}>"
