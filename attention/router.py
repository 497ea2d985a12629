"""Route each attention call: the selected backend, else the dense backend,
else SDPA; plus the dense schedule and per-model statistics."""
from __future__ import annotations

from collections import Counter

import torch

from ..pack_logging import pack_logger
from . import registry
from .base import Unsupported
from .options import NO_OPTIONS, CallOptions
from .schedule import DenseSchedule, parse_layers

log = pack_logger(__name__)


def steps_text(dense_steps: int) -> str:
    """The dense steps as a person counts them: "dense steps none", "dense step 0", "dense steps 0-2"."""
    if dense_steps <= 0:
        return "dense steps none"
    return "dense step 0" if dense_steps == 1 else f"dense steps 0-{dense_steps - 1}"


class AttentionStats:
    """Calls per kernel that actually ran ("flash:fa3_fwd", "sol", "sdpa"),
    fallbacks ("sage -> sdpa: takes no attention mask") and calls sent dense
    by the schedule ("step", "layer"), since the last `take_run()`. Nothing is
    counted while torch.compile traces: a counter read there would be guarded
    on and recompile the graph at every call."""

    def __init__(self):
        self.run = {"calls": Counter(), "fallbacks": Counter(), "scheduled_dense": Counter()}

    def add(self, kind: str, key: str) -> None:
        if torch.compiler.is_compiling():
            return
        self.run[kind][key] += 1

    def take_run(self) -> dict:
        out = {kind: dict(counter) for kind, counter in self.run.items()}
        for counter in self.run.values():
            counter.clear()
        return out


def summary(counts: dict) -> str:
    def fmt(counter):
        return ", ".join(f"{k} x{n}" for k, n in sorted(counter.items(), key=lambda kv: -kv[1])) or "none"
    return (f"ran {fmt(counts['calls'])}; fallbacks {fmt(counts['fallbacks'])}; "
            f"scheduled dense {fmt(counts['scheduled_dense'])}")


class Router:
    """backend(q, k, v, layout=..., mask=..., scale=...) with fallbacks.

    A call goes to `backend` unless the schedule (dense_steps/dense_layers)
    sends it to `dense_backend`. A backend that declines the call (device,
    dtype, head dim, mask, length, missing package) or fails at run time
    passes it on to `dense_backend`, then to SDPA; each distinct reason is
    logged once as a warning, every occurrence is counted in `stats`.
    """

    def __init__(self, backend: str = "auto", dense_backend: str = "auto", *, dense_steps: int = 0,
                 dense_layers: str = "", **settings):
        """`settings`: the backends' own (registry.backend_params), each checked by the backend that declares it."""
        self.backend = registry.create(backend, **settings)
        self.dense = registry.create(registry.parse(dense_backend, dense=True), **settings)
        self.reference = registry.create("sdpa")
        for backend in (self.backend, self.dense, self.reference):
            backend.preload()
        self.schedule = DenseSchedule(dense_steps, parse_layers(dense_layers))
        self.stats = AttentionStats()
        self._warned = set()

    def describe(self) -> str:
        parts = [f"backend {self.backend.name}"]
        if self.backend.settings:
            parts.append(self.backend.settings)
        parts.append(f"dense {self.dense.name}")
        # a sparse backend's users look for its dense steps
        if self.schedule.dense_steps or not registry.is_dense(self.backend.name):
            parts.append(steps_text(self.schedule.dense_steps))
        if self.schedule.dense_layers:
            parts.append(f"dense blocks {self.schedule.dense_layers}")
        return ", ".join(parts)

    def take_choices(self) -> list[str]:
        """What `auto` (as the backend or the dense backend) chose for the calls since the last take, with
        its timings: one line per shape."""
        lines = []
        for backend in (self.backend, self.dense):
            take = getattr(backend, "take_choices", None)
            lines += [f"auto {line}" for line in (take() if take else ()) if f"auto {line}" not in lines]
        return lines

    def begin_forward(self) -> None:
        self.schedule.begin_forward()

    def __call__(self, q, k, v, *, layout="BHSD", mask=None, scale=None, options: CallOptions = NO_OPTIONS):
        chain = [self.backend, self.dense, self.reference]
        if self.schedule.active:
            why = self.schedule.dense_reason(options, (layout, tuple(q.shape), tuple(k.shape)))
            if why:
                self.stats.add("scheduled_dense", why)
                chain = chain[1:]
            elif self.schedule.dense_steps and torch.compiler.is_compiling():
                dense_step = self.schedule.dense_step(options)
                if dense_step is not None:
                    return self._by_step(dense_step, chain, q, k, v, layout, mask, scale, options)
        # SDPA takes every call, so the chain ends at the first SDPA
        names = [b.name for b in chain]
        chain = chain[:names.index("sdpa") + 1]
        seen = set()
        *optional, reference = [b for b in chain if not (b.name in seen or seen.add(b.name))]
        declined = []
        for backend in optional:
            try:
                call = backend.kernel_call(q, k, v, layout=layout, mask=mask, scale=scale, options=options)
            except Unsupported as e:
                declined.append((backend.name, e.args[0]))
                continue
            try:
                out = call.run()
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001 - an optional kernel failing must not stop sampling
                first_line = (str(e).splitlines() or [""])[0]
                declined.append((backend.name, f"{call.label} failed: {type(e).__name__}: {first_line}"))
                continue
            return self._ran(call.label, out, declined)
        call = reference.kernel_call(q, k, v, layout=layout, mask=mask, scale=scale, options=options)
        return self._ran(call.label, call.run(), declined)

    def _by_step(self, dense_step, chain, q, k, v, layout, mask, scale, options):
        """Under torch.compile, where the step is data: both routes are traced and `torch.cond` runs the one
        `dense_step` (a bool tensor) picks; where both routes end at the same kernel, that kernel alone."""
        routes = [self._route(c, q, k, v, layout, mask, scale, options) for c in (chain[1:], chain)]
        (dense, _), (sparse, _) = routes
        for call, declined in routes:
            for name, reason in declined:
                self._warn(name, reason, call.label)
        if dense.label == sparse.label:
            return sparse.run()
        # the branches must agree in strides: each output as a contiguous tensor in the call's layout
        return torch.cond(dense_step, lambda: dense.run().contiguous(), lambda: sparse.run().contiguous(), ())

    @staticmethod
    def _route(chain, q, k, v, layout, mask, scale, options):
        """(the kernel call of the first backend of `chain` that takes the call, [(declined backend, why)])."""
        declined = []
        for backend in chain:
            try:
                return backend.kernel_call(q, k, v, layout=layout, mask=mask, scale=scale,
                                    options=options), declined
            except Unsupported as e:
                declined.append((backend.name, e.args[0]))
        raise Unsupported("; ".join(f"{name}: {why}" for name, why in declined))

    def _ran(self, label, out, declined):
        for name, reason in declined:
            self.stats.add("fallbacks", f"{name} -> {label}: {reason}")
            self._warn(name, reason, label)
        self.stats.add("calls", label)
        return out

    @torch.compiler.assume_constant_result  # under torch.compile it runs once, while tracing: no graph break
    def _warn(self, name: str, reason: str, ran: str) -> bool:
        if (name, reason) not in self._warned:
            self._warned.add((name, reason))
            log.warning("attention: %s cannot take this call (%s); running %s instead. "
                        "Warned once per reason.", name, reason, ran)
        return True
