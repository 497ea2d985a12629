"""The copies between host and GPU of the weights a loader quantizes, through one reused page-locked buffer.

A weight handed over by the loader maps the file (safetensors is zero-copy), and
a quantized weight goes back into fresh host memory: both are pageable copies,
in which the driver faults the pages in one at a time on one thread (about
1 GB/s for the fresh memory of a 20 GiB model on the H200). Here each copy goes
through a pinned buffer: torch's multi-threaded CPU copy between it and the
pageable memory, and one DMA between it and the GPU. The buffer is allocated
once, for the largest weight the builder will stage, so the host memory this adds
is bounded by one layer; torch's pinned-memory cache keeps it after the load,
for the next load to reuse.
"""
from __future__ import annotations

import time

import torch


SMALL_BYTES = 1 << 20  # scales and the like: a plain copy costs less than the synchronization


class PinnedStaging:
    """`to_device(tensor)` for CPU tensors bound for a CUDA `device`, `to_host(tensor)` for the way back;
    anything else (other devices, tensors over the buffer or under SMALL_BYTES) is moved as it is."""

    def __init__(self, device: torch.device, largest_bytes: int):
        self.device = torch.device(device)
        self.largest_bytes = largest_bytes
        self.enabled = self.device.type == "cuda" and largest_bytes > 0
        self._buffer: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None  # the last DMA out of the buffer
        self.seconds = 0.0  # host time spent staging (the CPU copy; the DMA is asynchronous)
        self.staged_bytes = 0
        self.host_seconds = 0.0  # to_host: waiting for the GPU's work, the DMA and the CPU copy
        self.host_bytes = 0

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        if not self._fits(tensor, "cpu"):
            return tensor.to(self.device)
        start = time.perf_counter()
        staged = self._staging_view(tensor)
        staged.copy_(tensor)
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
        out.copy_(staged, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        self.seconds += time.perf_counter() - start
        self.staged_bytes += nbytes
        return out

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (on the GPU) in fresh pageable host memory, once the GPU's work on it is done."""
        if not self._fits(tensor, "cuda"):
            return tensor.to("cpu")
        start = time.perf_counter()
        staged = self._staging_view(tensor)
        staged.copy_(tensor, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        out = torch.empty(tensor.shape, dtype=tensor.dtype)
        out.copy_(staged)
        self.host_seconds += time.perf_counter() - start
        self.host_bytes += out.numel() * out.element_size()
        return out

    def _fits(self, tensor: torch.Tensor, side: str) -> bool:
        nbytes = tensor.numel() * tensor.element_size()
        return self.enabled and tensor.device.type == side and SMALL_BYTES <= nbytes <= self.largest_bytes

    def _staging_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """The buffer's first bytes as a tensor like `tensor`, once no copy still reads or writes them."""
        if self._buffer is None:
            self._buffer = torch.empty(self.largest_bytes, dtype=torch.uint8, pin_memory=True)
        elif self._copied is not None:
            self._copied.synchronize()  # the previous weight has left the buffer
            self._copied = None
        nbytes = tensor.numel() * tensor.element_size()
        return self._buffer[:nbytes].view(tensor.dtype).view(tensor.shape)

    def close(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()
        self._buffer = self._copied = None
