"""Layerwise weight streaming with one-block lookahead. Pure torch, no ComfyUI.

Streamed blocks keep their tensors in host memory, page-locked where they are
(`HostPins`: the host's pin functions, or cudaHostRegister, on the existing
buffers, so host memory holds one copy, quantized tensors included). Forward pre-/post-hooks on every block
drive a small state machine:

- while streamed block s(k) computes, s(k+1)'s tensors are copied on a side
  CUDA stream into freshly allocated device tensors;
- the copy waits on an event recorded on the compute stream when it was
  issued, so it never overwrites memory the compute stream still reads, and
  the compute stream waits on the copy's event before s(k+1) runs: no host
  synchronisation, no copy on the compute stream;
- at the pre-hook the block's parameter (and buffer) entries are swapped for
  the device copies; at the post-hook the host tensors are put back and the
  device copies dropped, so the caching allocator reuses their memory for the
  next prefetch. At most two streamed blocks are on the device at once.

The streamer stays attached across forwards: when the last streamed block
finishes, the first one is issued for the next forward (it is also issued on
attach), so it overlaps the blocks after the last streamed one and the next
forward's start; the planner keeps block 0 resident so there are some.

On a CPU device the same hooks run and "copies" are real host-to-host copies
("CPU-to-CPU streaming"), so tests can check the order of moves and that
outputs match exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from ..pack_logging import pack_logger
from ..quant.kitchen_api import is_quantized_tensor, storage, tensor_bytes

log = pack_logger(__name__)

MAX_ON_DEVICE = 2  # the streamed block computing and the next one being copied
# Tensors below this are not page-locked in place (they could share a page
# with an unrelated allocation); each copy stages them through a pinned buffer.
PIN_MIN_BYTES = 1 << 20

_COPY_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def normalize_device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _copy_stream(device: torch.device) -> "torch.cuda.Stream":
    stream = _COPY_STREAMS.get(device)
    if stream is None:
        stream = _COPY_STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


def block_tensors(block: nn.Module) -> Iterator[tuple[nn.Module, str, str, torch.Tensor]]:
    """(owner module, "_parameters" | "_buffers", name, tensor) for every tensor of a block."""
    for module in block.modules():
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(module, kind).items():
                if tensor is not None:
                    yield module, kind, name, tensor


def away_bytes(tensors: Iterable[torch.Tensor], device) -> int:
    """True bytes of the tensors away from `device` (e.g. left in RAM by a partial load): what streaming copies."""
    device = normalize_device(device)
    return sum(tensor_bytes(t) for t in tensors if t.device != device)


PinFunction = Callable[[torch.Tensor], bool]


def register_in_place(tensor: torch.Tensor) -> bool:
    """Page-locks a host tensor's buffer with cudaHostRegister; True on success."""
    if not torch.cuda.is_available():
        return False
    data = storage(tensor)
    status = torch.cuda.cudart().cudaHostRegister(data.data_ptr(), data.numel() * data.element_size(), 0)
    if int(status) != 0:
        log.debug("cudaHostRegister of %d bytes failed (%s); copying from pageable memory", data.nbytes, status)
        return False
    return True


def unregister_in_place(tensor: torch.Tensor) -> bool:
    return int(torch.cuda.cudart().cudaHostUnregister(storage(tensor).data_ptr())) == 0


class HostPins:
    """Page-locks host tensors in place; `release()` unpins what it pinned.

    `pin(tensor) -> bool` and `unpin(tensor)` are the host's where it has them
    (ComfyUI's keep its pins within a budget of host memory). A host without them
    gets the pack's own cudaHostRegister, which has no budget. The functions get
    the block's tensor as it is held (a Parameter, or a QuantizedTensor, whose
    storage is its packed data), as ComfyUI pins its own weights. Release before
    anything may free or move the tensors: memory freed while registered stays
    registered.
    """

    def __init__(self, min_bytes: int = PIN_MIN_BYTES, pin: PinFunction | None = None,
                 unpin: PinFunction | None = None):
        if (pin is None) != (unpin is None):
            raise ValueError("HostPins needs both pin and unpin, or neither")
        self.min_bytes = min_bytes
        self._pin = pin or register_in_place
        self._unpin = unpin or unregister_in_place
        self._pinned: dict[int, torch.Tensor] = {}  # storage data_ptr -> the tensor pinned here

    def pin(self, tensor: torch.Tensor) -> bool:
        """True if `tensor` is page-locked now (by us or earlier by someone else)."""
        if tensor.device.type != "cpu":
            return False
        # A comfy-kitchen QuantizedTensor reports its dequantized shape; its packed data is the buffer.
        data = storage(tensor)
        if data.data_ptr() in self._pinned or data.is_pinned():
            return True
        if data.numel() * data.element_size() < self.min_bytes or not data.is_contiguous():
            return False
        if not self._pin(tensor):
            return False
        self._pinned[data.data_ptr()] = tensor
        return True

    def release(self) -> None:
        for tensor in self._pinned.values():
            self._unpin(tensor)
        self._pinned.clear()


def _async_source(src: torch.Tensor) -> torch.Tensor:
    """A source the side stream can copy from without blocking the host.

    A copy from pageable memory first waits, on the host, for the copy stream
    to drain; small tensors (norm scales, biases) are staged through a pinned
    buffer instead. Large ones are pinned in place by HostPins; if that failed
    they are copied as they are.
    """
    if is_quantized_tensor(src) or src.is_pinned():
        return src
    if src.numel() * src.element_size() < PIN_MIN_BYTES:
        return torch.empty_like(src, pin_memory=True).copy_(src)
    return src


@dataclass
class StreamStats:
    forwards: int = 0
    loads: int = 0          # streamed block executions
    prefetched: int = 0     # ... whose copy was issued before the block started
    bytes_copied: int = 0
    max_on_device: int = 0  # most streamed blocks on the device at once

    @property
    def late(self) -> int:
        return self.loads - self.prefetched

    def render(self) -> str:
        return (f"{self.loads} streamed block loads in {self.forwards} forwards, {self.prefetched} prefetched "
                f"ahead, {self.late} late; {self.bytes_copied / 1024 ** 2:.1f} MiB copied; "
                f"at most {self.max_on_device} streamed blocks on the device")


@dataclass
class _Staged:
    tensors: list[torch.Tensor]
    done: "torch.cuda.Event | None"
    prefetched: bool
    in_use: bool = False


@dataclass
class LayerwiseStreamer:
    """Streams `streamed` blocks of `blocks` onto `device` around each block's forward.

    Use as a context manager (or attach()/detach()) around one or more forwards;
    a copy issued for a forward that never comes is dropped on detach.
    Tensors of a streamed block that are already on `device` stay put (a block
    ComfyUI loaded partially streams only its offloaded part); on a CPU device
    every tensor of a streamed block is copied.
    """
    blocks: Sequence[nn.Module]
    device: torch.device
    streamed: Iterable[int]
    pins: HostPins | None = None
    stats: StreamStats = field(default_factory=StreamStats)

    def __post_init__(self):
        self.blocks = list(self.blocks)
        self.device = normalize_device(self.device)
        self.order = sorted(set(self.streamed))
        self._next_streamed = {}
        streamed, upcoming = set(self.order), None
        for j in reversed(range(len(self.blocks))):
            self._next_streamed[j] = upcoming
            if j in streamed:
                upcoming = j
        self._entries: dict[int, list[tuple[nn.Module, str, str, torch.Tensor]]] = {}
        self._staged: dict[int, _Staged] = {}
        self._handles = []

    # -- lifecycle -----------------------------------------------------------
    def __enter__(self) -> "LayerwiseStreamer":
        self.attach()
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def attach(self) -> None:
        for i in self.order:
            cpu = self.device.type == "cpu"
            self._entries[i] = [e for e in block_tensors(self.blocks[i]) if cpu or e[3].device != self.device]
            if self.pins is not None and not cpu:
                for *_, tensor in self._entries[i]:
                    self.pins.pin(tensor)
        for j, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(lambda m, a, j=j: self._enter(j)))
            self._handles.append(block.register_forward_hook(lambda m, a, o, j=j: self._exit(j), always_call=True))
        if self.order:
            self._issue(self.order[0], prefetched=True)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for i in list(self._staged):
            self._release(i)
        self._entries.clear()

    # -- the state machine -----------------------------------------------------
    def _issue(self, i: int, prefetched: bool) -> _Staged:
        sources = [tensor for *_, tensor in self._entries[i]]
        done = None
        if self.device.type == "cuda":
            # Allocated on the compute stream: the copy may only start once the
            # compute stream has passed this point (the memory may be a block's
            # that work queued before now still reads).
            targets = [torch.empty_like(src, device=self.device) for src in sources]
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            stream = _copy_stream(self.device)
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                for target, src in zip(targets, sources):
                    target.copy_(_async_source(src), non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
        else:
            targets = [torch.empty_like(src, device=self.device).copy_(src) for src in sources]
        staged = self._staged[i] = _Staged(targets, done, prefetched)
        self.stats.bytes_copied += sum(map(tensor_bytes, sources))
        self.stats.max_on_device = max(self.stats.max_on_device, len(self._staged))
        return staged

    @torch.compiler.disable  # side-stream copies and parameter swaps run eagerly; the block compiles
    def _enter(self, j: int) -> None:
        if j == 0:
            self.stats.forwards += 1
        if j in self._entries:
            staged = self._staged.get(j) or self._issue(j, prefetched=False)
            if staged.done is not None:
                torch.cuda.current_stream(self.device).wait_event(staged.done)
            for (module, kind, name, _), target in zip(self._entries[j], staged.tensors):
                if kind == "_parameters":
                    target = nn.Parameter(target, requires_grad=False)  # inference only
                getattr(module, kind)[name] = target
            staged.in_use = True
            self.stats.loads += 1
            self.stats.prefetched += staged.prefetched
        self._prefetch(self._next_streamed[j])

    @torch.compiler.disable
    def _exit(self, j: int) -> None:
        staged = self._staged.get(j)
        if staged is not None and staged.in_use:
            self._release(j)
        if self.order and j == self.order[-1]:
            self._prefetch(self.order[0])  # for the next forward

    def _prefetch(self, i: int | None) -> None:
        if i is not None and i not in self._staged and len(self._staged) < MAX_ON_DEVICE:
            self._issue(i, prefetched=True)

    def _release(self, i: int) -> None:
        staged = self._staged.pop(i)
        if staged.in_use:
            for module, kind, name, host in self._entries[i]:
                getattr(module, kind)[name] = host
