"""`auto`: the fastest dense kernel for this GPU and this shape, measured here.

The first call of a shape (device, dtype, layout, q/k/v shapes with the
sequence lengths to the next power of two, mask) on a GPU times every dense
kernel that takes it, on the call's own tensors, and
runs the fastest from then on. A kernel that is not exact (it declares a
`max_error`: Sage, comfy-kitchen INT8, FA3 FP8) competes only when a probe of
that call, up to PROBE_HEADS heads and PROBE_QUERIES queries against all keys,
is within its declared relative L2 error (and MAX_ERROR) of exact attention
computed in fp32. Each decision is kept for the process per GPU and shape,
shared by every `auto` (backend and dense backend alike), and reported with
its timings (`take_choices`). Where the host hands over a store (`use_store`:
host/tuning.py, the tuning store on disk), a measured decision is kept there too,
keyed by the GPU, torch's version, the call's shape and its candidates'
labels, and a later process runs it without measuring (a prompt of another
length in the same power of two runs it too, in the process or later): an exact kernel
as kept, an approximate one after the probe of that call is within its bound
(else all are measured again). Where nothing is kept, the decisions the pack ships
for the GPU's family (`auto_shipped.json`: timings measured on such a GPU at
MiniMax-H3's shapes, batch and lengths to the next power of two) decide in the same
way, where they timed every kernel that takes the call: a first run then compiles
and times no kernel it will not use (SageAttention's and comfy-kitchen's Triton
kernels compile at their first call; an H100's first VAE decode, which measured
its two shapes, took 9.9 s on a first run and 4.6 s restarted).

Nothing is measured where there is one candidate (a CPU: SDPA) or while a
CUDA graph is captured: there the cached decision runs, else the first exact
kernel that takes the call. Under torch.compile the measurement runs eagerly
(a graph break at the first call of a shape only).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from ..dtypes import dtype_name
from ..hardware import gpu_family, time_ms
from ..pack_logging import pack_logger
from . import registry
from ..units import next_pow2
from .base import Backend, KernelCall, Unsupported, dims
from .kernels import Sdpa, SdpaCudnn, SdpaFlash, _sdpa
from .options import NO_OPTIONS, CallOptions
from .registry import register_backend

log = pack_logger(__name__)

STORE_KERNEL = "attention.auto"  # the decisions' name in the host's store
STORE_VERSION = "2"  # what a kept entry holds: {"label": ..., "timings": {label: ms}}; 2: lengths bucketed
MAX_ERROR = 0.05
PROBE_HEADS = 4
PROBE_QUERIES = 1024
TARGET_MS = 60.0  # timed calls per kernel and round: about this long, between 1 and 10 calls
SHIPPED_FILE = Path(__file__).with_name("auto_shipped.json")


@dataclass
class Decision:
    label: str
    shape: str
    timings: dict = field(default_factory=dict)   # label -> ms per call
    errors: dict = field(default_factory=dict)    # label -> probe's relative L2 error (approximate kernels)
    rejected: dict = field(default_factory=dict)  # label -> why it did not compete
    unmeasured: str = ""                          # why nothing was measured
    kept: bool = False                            # from the store: measured by an earlier process
    shipped: str = ""                             # from the pack's table for this GPU family ("sm90")

    def text(self) -> str:
        if self.unmeasured:
            return f"{self.shape}: {self.label} (not measured: {self.unmeasured})"
        ranked = sorted(self.timings, key=self.timings.get)
        parts = [f"{name} {self.timings[name]:.2f} ms" + (f" (err {self.errors[name]:.3f})"
                                                            if name in self.errors else "") for name in ranked]
        source = (" (kept from an earlier measurement)" if self.kept else
                  f" (shipped for {self.shipped}, not measured here)" if self.shipped else "")
        text = f"{self.shape}: {self.label}{source}; " + ", ".join(parts)
        if self.rejected:
            text += "; not used: " + ", ".join(f"{name} ({why})" for name, why in self.rejected.items())
        return text


# (device, shape key) -> Decision, for the process
_DECISIONS: dict[tuple, Decision] = {}


class DecisionStore(Protocol):
    """Decisions kept beyond the process, by a torch device (the host's: quant/tuning.py's KernelEntries)."""

    def get(self, device: torch.device, version: str, shape: str): ...

    def put(self, device: torch.device, version: str, shape: str, value) -> None: ...


_STORE: DecisionStore | None = None


def use_store(store: DecisionStore | None) -> None:
    """Keep measured decisions in `store` and run those it holds (None: for the process only)."""
    global _STORE
    _STORE = store


seq_bucket = next_pow2  # each new prompt length would otherwise be measured again, in the first step of its job


def _dims_key(t: torch.Tensor, layout: str, exact: bool) -> tuple[int, int, int, int]:
    b, h, s, d = dims(t, layout)
    return b, h, s if exact or not isinstance(s, int) else seq_bucket(s), d  # a symbolic length (traced) as it is


def stored_shape(q, k, v, layout, mask, candidates) -> str:
    """A call's key in the store: its dims (batch, heads, sequence bucket, head size), dtype and mask, and the
    kernels that took it (a kept decision holds for the same candidates)."""
    exact = mask is not None
    mask_text = "none" if mask is None else f"{dtype_name(mask.dtype)} {list(mask.shape)}"
    tensors = " ".join(f"{name}{list(_dims_key(t, layout, exact))}" for name, t in zip("qkv", (q, k, v)))
    return f"{layout} {tensors} {dtype_name(q.dtype)}, mask {mask_text}; {','.join(sorted(candidates))}"


def store_version() -> str:
    """The kept decisions' version: what an entry holds, and torch's (its SDPA kernels)."""
    return hashlib.sha256(f"{STORE_VERSION}\0{torch.__version__}".encode()).hexdigest()[:16]


def _load_shipped() -> dict[str, dict[str, dict[str, float]]]:
    """{family: {shipped_shape: {label: ms}}}: the decisions' timings the pack ships (none where unreadable)."""
    try:
        families = json.loads(SHIPPED_FILE.read_text())["families"]
        return {family: {shape: {label: float(ms) for label, ms in timings.items()} for shape, timings in shapes.items()}
                for family, shapes in families.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("attention auto: the shipped decisions (%s) do not read (%s); it measures", SHIPPED_FILE, e)
        return {}


SHIPPED = _load_shipped()


def shipped_shape(q, k, layout, mask) -> str | None:
    """A call's key in the shipped table: batch and lengths to the next power of two, heads, head size, dtype
    ("1x32x2048x64 float16"); None for a masked call or a traced length."""
    b, h, s, d = dims(q, layout)
    hk, sk = dims(k, layout)[1:3]
    if mask is not None or not all(isinstance(n, int) for n in (b, s, sk)):
        return None
    text = f"{next_pow2(b)}x{h}x{seq_bucket(s)}x{d} {dtype_name(q.dtype)}"
    return text if (hk, sk) == (h, s) else f"{text}, keys {hk}x{seq_bucket(sk)}"


def shape_key(q, k, v, layout, mask) -> tuple:
    """The process's key of a call's decision: sequence lengths bucketed (seq_bucket), exact where a mask is given
    (its shape follows them)."""
    exact = mask is not None
    mask_key = None if mask is None else (mask.dtype, tuple(mask.shape))
    return (str(q.device), q.dtype, layout, *(_dims_key(t, layout, exact) for t in (q, k, v)), mask_key)


def shape_text(q, k, layout, mask) -> str:
    b, h, s, d = dims(q, layout)
    hk, sk = dims(k, layout)[1:3]
    text = f"{b}x{h}x{s}x{d} {dtype_name(q.dtype)}"
    if (hk, sk) != (h, s):
        text += f", keys {hk}x{sk}"
    return text + (", masked" if mask is not None else "")


def measure_times(runs: dict, device: torch.device) -> tuple[dict, dict]:
    """({label: ms}, {label: why it failed}): each run warmed up (Triton compiles, workspaces), then
    two interleaved rounds, the best of each, so drift hits every kernel alike."""
    times, failed = {}, {}
    for label, run in runs.items():
        try:
            run()
            times[label] = time_ms(run, device, 1)
        except torch.cuda.OutOfMemoryError:
            failed[label] = "out of memory"
        except Exception as e:  # noqa: BLE001 - an optional kernel failing must not stop sampling
            failed[label] = f"failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    calls = {label: max(1, min(10, round(TARGET_MS / max(ms, 1e-3)))) for label, ms in times.items()}
    for _ in range(2):
        for label in times:
            times[label] = min(times[label], time_ms(runs[label], device, calls[label]))
    return times, failed


def _probe_index(t: torch.Tensor, dim: int, keep: torch.Tensor) -> torch.Tensor:
    return t if t.shape[dim] == 1 else t.index_select(dim, keep.to(t.device))


def probe(q, k, v, layout, mask):
    """A slice of the call: batch 0, up to PROBE_HEADS heads spread over all, the first PROBE_QUERIES
    queries, every key (a query row's attention depends on all keys, and on no other row)."""
    b, h, s, _ = dims(q, layout)
    head_dim, seq_dim = (1, 2) if layout == "BHSD" else (2, 1)
    heads = torch.linspace(0, h - 1, min(h, PROBE_HEADS)).round().long().unique()
    first = torch.zeros(1, dtype=torch.long)
    rows = torch.arange(min(s, PROBE_QUERIES))
    pq = _probe_index(_probe_index(_probe_index(q, 0, first), head_dim, heads), seq_dim, rows).contiguous()
    pk, pv = (_probe_index(_probe_index(t, 0, first), head_dim, heads).contiguous() for t in (k, v))
    if mask is not None:  # SDPA-style (B|1, H|1, Sq|1, Sk)
        mask = _probe_index(_probe_index(_probe_index(mask, 0, first), 1, heads), 2, rows)
    return pq, pk, pv, mask


def _within_bound(impl, q, k, v, layout, mask, scale, options) -> dict | None:
    """{label: error} for an approximate kernel whose probe of this call is within its bound ({} for an exact
    one); None where it is not, or fails (then every kernel is measured)."""
    if impl.max_error is None:
        return {}
    try:
        error = probe_error(impl, q, k, v, layout, mask, scale, options)
    except Exception:  # noqa: BLE001 - see measure_times: measure them all
        return None
    return {impl.label: error} if error <= min(impl.max_error, MAX_ERROR) else None


def probe_error(impl, q, k, v, layout, mask, scale, options) -> float:
    """Relative L2 error of `impl` on a probe of the call, against SDPA in fp32."""
    pq, pk, pv, pmask = probe(q, k, v, layout, mask)
    out = impl.kernel_call(pq, pk, pv, layout=layout, mask=pmask, scale=scale, options=options).run().float()
    fmask = pmask if pmask is None or pmask.dtype == torch.bool else pmask.float()
    ref = _sdpa(pq.float(), pk.float(), pv.float(), layout, fmask, scale)
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@register_backend("auto", selector=True)
class Auto(Backend):
    def __init__(self, **_):
        kernels = {}
        for impl in (*registry.dense_kernels(), SdpaCudnn(), SdpaFlash()):
            kernels.setdefault(impl.label, impl)
        exact = [i for i in kernels.values() if i.max_error is None and i.label != "sdpa"]
        approximate = [i for i in kernels.values() if i.max_error is not None]
        # the order an unmeasured call tries them: exact first, plain SDPA last of those
        super().__init__("auto", [*exact, kernels.get("sdpa", Sdpa()), *approximate])
        self._by_label = {impl.label: impl for impl in self.kernels}
        self._used: dict[tuple, Decision] = {}

    def take_choices(self) -> list[str]:
        """The decisions the calls since the last take ran by, one line each."""
        lines = [d.text() for d in self._used.values()]
        self._used.clear()
        return lines

    def kernel_call(self, q, k, v, *, layout="BHSD", mask=None, scale=None,
                    options: CallOptions = NO_OPTIONS) -> KernelCall:
        dims(q, layout)
        key = shape_key(q, k, v, layout, mask)
        decision = _DECISIONS.get(key)
        if decision is not None:
            try:
                call = self._by_label[decision.label].kernel_call(q, k, v, layout=layout, mask=mask, scale=scale,
                                                           options=options)
                return self._ran(key, decision, call)
            except Unsupported:
                pass
        accepted, reasons = {}, []
        for impl in self.kernels:
            try:
                accepted[impl.label] = (impl, impl.kernel_call(q, k, v, layout=layout, mask=mask, scale=scale,
                                                        options=options))
            except Unsupported as e:
                reasons.append((impl.label, e.args[0]))
        if not accepted:
            unique = list(dict.fromkeys(r for _, r in reasons))
            raise Unsupported(unique[0] if len(unique) == 1 else "; ".join(f"{l}: {r}" for l, r in reasons))
        shape = shape_text(q, k, layout, mask)
        if len(accepted) == 1 or (q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            exact = [label for label, (impl, _) in accepted.items() if impl.max_error is None]
            label = exact[0] if exact else next(iter(accepted))
            why = "one candidate" if len(accepted) == 1 else "a CUDA graph is being captured"
            return self._ran(key, Decision(label, shape, unmeasured=why), accepted[label][1])
        # under torch.compile this runs eagerly on the real tensors (one graph break, the first call of a
        # shape only: the traced lookup above finds the decision from then on)
        decision = self._measure(key, accepted, shape, q, k, v, layout, mask, scale, options)
        return self._ran(key, decision, accepted[decision.label][1])

    def _ran(self, key, decision: Decision, call: KernelCall) -> KernelCall:
        if not torch.compiler.is_compiling():
            self._used[key] = decision
        return KernelCall(f"auto:{call.label}", call.run)

    @torch.compiler.disable
    def _measure(self, key, accepted, shape, q, k, v, layout, mask, scale, options) -> Decision:
        where = (q.device, store_version(), stored_shape(q, k, v, layout, mask, accepted))
        decision = (self._kept(where, accepted, shape, q, k, v, layout, mask, scale, options)
                    or self._shipped(accepted, shape, q, k, v, layout, mask, scale, options))
        if decision is None:
            decision = self._decide(accepted, shape, q, k, v, layout, mask, scale, options)
            if _STORE is not None and decision.timings:
                try:
                    _STORE.put(*where, {"label": decision.label, "timings": decision.timings})
                except Exception as e:  # noqa: BLE001 - a store that cannot keep it: the process still does
                    log.warning("attention auto: the decision for %s was not kept (%s: %s)", shape,
                                type(e).__name__, e)
        _DECISIONS[key] = decision
        log.info("attention auto %s", decision.text())
        return decision

    def _kept(self, where, accepted, shape, q, k, v, layout, mask, scale, options) -> Decision | None:
        """The store's decision for this call, where it names a candidate of this call and, for an approximate
        kernel, the probe of this call is within its bound; else None (measure)."""
        if _STORE is None:
            return None
        try:
            entry = _STORE.get(*where)
        except Exception as e:  # noqa: BLE001 - an unreadable store: measure
            log.warning("attention auto: the kept decisions could not be read (%s: %s)", type(e).__name__, e)
            return None
        if not isinstance(entry, dict) or entry.get("label") not in accepted:
            return None
        label, timings = entry["label"], entry.get("timings")
        timings = {name: float(ms) for name, ms in timings.items() if isinstance(ms, (int, float))} \
            if isinstance(timings, dict) else {}
        errors = _within_bound(accepted[label][0], q, k, v, layout, mask, scale, options)
        return None if errors is None else Decision(label, shape, timings=timings, errors=errors, kept=True)

    def _shipped(self, accepted, shape, q, k, v, layout, mask, scale, options) -> Decision | None:
        """The shipped table's decision for this GPU family and call, where it timed every kernel that took the
        call: the fastest of those (an approximate one where the probe of this call is within its bound); else
        None (measure)."""
        family = gpu_family(q.device)
        timings = SHIPPED.get(family, {}).get(shipped_shape(q, k, layout, mask)) if family else None
        if not timings or not set(accepted) <= set(timings):
            return None
        timings = {label: timings[label] for label in accepted}
        label = min(timings, key=timings.get)
        errors = _within_bound(accepted[label][0], q, k, v, layout, mask, scale, options)
        return None if errors is None else Decision(label, shape, timings=timings, errors=errors, shipped=family)

    def _decide(self, accepted, shape, q, k, v, layout, mask, scale, options) -> Decision:
        rejected, errors = {}, {}
        for label, (impl, _) in accepted.items():
            if impl.max_error is None:
                continue
            bound = min(impl.max_error, MAX_ERROR)
            try:
                errors[label] = probe_error(impl, q, k, v, layout, mask, scale, options)
            except torch.cuda.OutOfMemoryError:
                rejected[label] = "out of memory on the probe"
                continue
            except Exception as e:  # noqa: BLE001 - see measure_times
                rejected[label] = f"failed on the probe: {type(e).__name__}"
                continue
            if not errors[label] <= bound:  # NaN fails too
                rejected[label] = f"error {errors[label]:.3f} > {bound:g}"
        runs = {label: call.run for label, (_, call) in accepted.items() if label not in rejected}
        times, failed = measure_times(runs, q.device)
        rejected.update(failed)
        if not times:  # every kernel failed: plain SDPA, which takes any call
            return Decision("sdpa", shape, errors=errors, rejected=rejected)
        best = min(times, key=times.get)
        return Decision(best, shape, timings=times, errors=errors, rejected=rejected)
