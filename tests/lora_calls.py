"""Script text the LoRA-fold tests put into their ComfyUI subprocesses (after importing comfy.lora and the pack's
QuantLinear): `calls["patch"]` counts ComfyUI's LoRA computations (comfy.lora.calculate_weight), `calls["per_call"]`
the forwards that patched a dequantized weight per call (QuantLinear._forward_patched)."""

COUNT_LORA_CALLS = r"""
calls = {"patch": 0, "per_call": 0}
real_calculate = comfy.lora.calculate_weight
def counted_calculate(*a, **k):
    calls["patch"] += 1
    return real_calculate(*a, **k)
comfy.lora.calculate_weight = counted_calculate
real_patched = QuantLinear._forward_patched
def counted_patched(self, *a, **k):
    calls["per_call"] += 1
    return real_patched(self, *a, **k)
QuantLinear._forward_patched = counted_patched
"""
