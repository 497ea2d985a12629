"""Offload: the memory plan per run and layerwise weight streaming. Pure torch, no ComfyUI.

- `plan.py`: weight, activation and staging bytes per block, and which blocks stream;
- `streaming.py`: the streamer (one block ahead on a side CUDA stream) and `HostPins`,
  which page-locks host tensors through the pin functions it is given;
- `session.py`: one sampling run: attach the streamer, detach and unpin after;
- `budget.py`: modes, capacity, the estimate ComfyUI's memory budget asks for, and the
  report's text, from plain numbers.

host/offload.py adapts them to ComfyUI (sampler wrappers, its memory_required patched to answer at least
the plan's estimate, its pin functions).
"""
