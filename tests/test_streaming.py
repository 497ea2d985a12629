"""Layerwise streaming: exact outputs with streaming on and off, and the order of moves.

On CPU the streamer runs its hooks with host-to-host copies ("CPU-to-CPU
streaming"); the GPU tests at the end check the same on CUDA with real
side-stream copies, pinned host memory and the device-memory bound.
"""
import pytest
import torch
from torch import nn

from bigdit.host.layers import ComfyQuantLinear
from bigdit.offload.plan import plan_placement, size_text
from bigdit.offload.session import StreamSession
from bigdit.quant.kitchen_api import tensor_bytes
from bigdit.offload.streaming import HostPins, LayerwiseStreamer, away_bytes, block_tensors
from bigdit.quant import QuantConfig, quantize_layers
from bigdit.quant.quantize_pass import apply_replacements
from bigdit.quant.int8_convrot import Int8ConvRotMethod
from offload_helpers import TracingStreamer, move_blocks_to_host, pinned_bytes

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Block(nn.Module):
    def __init__(self, d=64, ffn=128):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.fc1 = nn.Linear(d, 2 * ffn)
        self.fc2 = nn.Linear(ffn, d)
        self.gain = nn.Parameter(torch.randn(d))        # a block's own parameter, like Wan's modulation
        self.register_buffer("shift", torch.randn(d))

    def forward(self, x):
        gate, up = self.fc1(self.norm(x)).chunk(2, dim=-1)
        return x + self.fc2(nn.functional.silu(gate) * up) * self.gain + self.shift


class Stack(nn.Module):
    def __init__(self, n=6, d=64):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(d, 2 * d) for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def originals(model):
    return [(m, kind, name, t) for b in model.blocks for m, kind, name, t in block_tensors(b)]


def assert_restored(model, before):
    after = originals(model)
    assert len(after) == len(before)
    assert all(a[3] is b[3] for a, b in zip(after, before)), "a streamed tensor was not put back"


@torch.no_grad()
def test_outputs_identical_and_tensors_restored():
    model = Stack()
    x = torch.randn(3, 5, 64)
    ref = model(x)
    before = originals(model)
    with LayerwiseStreamer(model.blocks, "cpu", streamed=[1, 2, 4]) as streamer:
        out = model(x)
        again = model(x)
    assert torch.equal(out, ref) and torch.equal(again, ref)
    assert_restored(model, before)
    assert streamer.stats.forwards == 2 and streamer.stats.loads == 6
    assert streamer.stats.prefetched == 6 and streamer.stats.late == 0
    assert streamer.stats.max_on_device == 2
    per_block = sum(t.numel() * t.element_size() for *_, t in block_tensors(model.blocks[1]))
    # six loads, plus block 1 issued again for a third forward that never came
    assert streamer.stats.bytes_copied == 7 * per_block


@torch.no_grad()
def test_streamed_block_computes_on_copies():
    model = Stack(n=3)
    seen = {}
    model.blocks[1].fc1.register_forward_pre_hook(lambda m, a: seen.update(ptr=m.weight.data_ptr()))
    host_ptr = model.blocks[1].fc1.weight.data_ptr()
    with LayerwiseStreamer(model.blocks, "cpu", streamed=[1]):
        model(torch.randn(2, 64))
    assert seen["ptr"] != host_ptr  # the block ran on the staged copy...
    assert model.blocks[1].fc1.weight.data_ptr() == host_ptr  # ...and the host tensor is back


@torch.no_grad()
def test_move_order_and_prefetch_pattern():
    model = Stack()
    trace = []
    with TracingStreamer(model.blocks, "cpu", streamed=[1, 2, 4], trace=trace):
        model(torch.randn(2, 64))
        first = list(trace)
        trace.clear()
        model(torch.randn(2, 64))
    # Each streamed block's copy is issued while the previous one computes (block 1's on attach), each is
    # released before the next block starts, and the last one's end issues block 1 for the next forward.
    assert first == [
        ("issue", 1),
        ("enter", 0),
        ("enter", 1), ("swap_in", 1), ("issue", 2), ("release", 1),
        ("enter", 2), ("swap_in", 2), ("issue", 4), ("release", 2),
        ("enter", 3),
        ("enter", 4), ("swap_in", 4), ("release", 4), ("issue", 1),
        ("enter", 5),
    ]
    # ...and detaching drops the copy issued for a third forward that never came.
    assert trace == first[1:] + [("release", 1)]


@pytest.mark.parametrize("streamed", [[0], [5], [0, 1, 2, 3, 4, 5], [0, 2, 3, 5], [1, 4]])
@torch.no_grad()
def test_at_most_two_blocks_staged_and_every_copy_ahead(streamed):
    model = Stack()
    x = torch.randn(2, 64)
    ref = model(x)
    trace = []
    with TracingStreamer(model.blocks, "cpu", streamed=streamed, trace=trace) as streamer:
        for _ in range(2):
            assert torch.equal(model(x), ref)
    staged = set()
    entered = set()
    for event, i in trace:
        if event == "issue":
            assert i not in entered, f"block {i} was issued only when it started"
            staged.add(i)
            assert len(staged) <= 2
        elif event == "release":
            staged.discard(i)
            entered.discard(i)
        elif event == "enter":
            entered.add(i)
    assert streamer.stats.late == 0 and streamer.stats.loads == 2 * len(streamed)


@torch.no_grad()
def test_exception_inside_a_block_restores_host_tensors():
    model = Stack(n=3)
    before = originals(model)
    model.blocks[1].fc2.register_forward_hook(lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        with LayerwiseStreamer(model.blocks, "cpu", streamed=[1, 2]):
            model(torch.randn(2, 64))
    assert_restored(model, before)
    assert not model.blocks[1]._forward_pre_hooks  # hooks removed


@torch.no_grad()
def test_quantized_blocks_stream_exactly():
    model = Stack(n=4, d=256)
    quantized, _ = quantize_layers(model, QuantConfig(method=Int8ConvRotMethod(64)))
    apply_replacements(model, quantized)
    assert type(model.blocks[2].fc1).__name__ == "QuantLinear"
    x = torch.randn(2, 7, 256)
    ref = model(x)
    trace = []
    with TracingStreamer(model.blocks, "cpu", streamed=[2, 3], trace=trace):
        out = model(x)
    assert torch.equal(out, ref)
    assert ("swap_in", 2) in trace and ("swap_in", 3) in trace


@torch.no_grad()
def test_weight_patched_quantized_blocks_stream_exactly():
    """A LoRA written into a streamed QuantLinear (set_weight, as ComfyUI and the pack's fold do) survives the
    streamer swapping its tensors for copies, and ComfyUI's restore of the weight still brings the scales back."""
    model = Stack(n=4, d=256)
    quantized, _ = quantize_layers(model, QuantConfig(method=Int8ConvRotMethod(64)), layer_type=ComfyQuantLinear)
    apply_replacements(model, quantized)
    layer = model.blocks[2].fc1
    unpatched = {k: v for k, v in layer.named_parameters()}
    weight = layer.convert_weight(layer.weight.float())
    layer.set_weight(weight + 0.3 * torch.randn_like(weight))
    x = torch.randn(2, 7, 256)
    ref = model(x)
    for _ in range(2):  # attached across forwards, as in a sampling
        with LayerwiseStreamer(model.blocks, "cpu", streamed=[2, 3]):
            assert torch.equal(model(x), ref)
    layer.weight = unpatched["weight"]  # ComfyUI's unpatch
    assert all(getattr(layer, k) is v for k, v in unpatched.items())


def test_away_bytes_counts_the_tensors_away_from_the_device():
    model = Stack(n=3)
    model.blocks[0].to("meta")
    model.blocks[2].fc2.to("meta")
    away = [away_bytes((t for *_, t in block_tensors(block)), "meta") for block in model.blocks]
    # fp32 Block(64, 128): norm 64, fc1 256x64 + 256, fc2 64x128 + 64, gain 64, shift 64 values; fc2 is on "meta"
    assert away == [0, 4 * (64 + 256 * 65 + 64 * 129 + 128), 4 * (64 + 256 * 65 + 128)]


def test_pins_do_nothing_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pins = HostPins(min_bytes=0)
    assert not pins.pin(torch.zeros(1024)) and pinned_bytes(pins) == 0


class RecordingPins:
    """Stands in for ComfyUI's pin_memory / unpin_memory, which pin nothing on a host without a GPU."""

    def __init__(self, refuse=()):
        self.pinned, self.unpinned, self.refuse = [], [], list(refuse)

    def pin(self, tensor):
        if any(tensor is t for t in self.refuse):
            return False  # as ComfyUI's does over its pin budget
        self.pinned.append(tensor)
        return True

    def unpin(self, tensor):
        self.unpinned.append(tensor)
        return True


def same(tensors, expected):
    return len(tensors) == len(expected) and all(a is b for a, b in zip(tensors, expected))


def test_host_pin_functions_get_the_tensors_as_held_and_unpin_only_what_they_pinned():
    big = nn.Parameter(torch.zeros(2 ** 18), requires_grad=False)  # 1 MiB: PIN_MIN_BYTES
    refused = nn.Parameter(torch.zeros(2 ** 18), requires_grad=False)
    small = nn.Parameter(torch.zeros(16), requires_grad=False)  # staged through a pinned buffer instead
    strided = torch.zeros(2 ** 19)[::2]  # 1 MiB, not contiguous
    host = RecordingPins(refuse=[refused])
    pins = HostPins(pin=host.pin, unpin=host.unpin)
    assert [pins.pin(t) for t in (big, refused, small, strided, big)] == [True, False, False, False, True]
    assert same(host.pinned, [big]) and pinned_bytes(pins) == 2 ** 20  # asked once for `big`
    pins.release()
    assert same(host.unpinned, [big])
    pins.release()
    assert same(host.unpinned, [big])  # nothing is unpinned twice


def test_host_pin_functions_get_a_quantized_tensor_itself_sized_by_its_packed_data():
    from comfy_kitchen.tensor import QuantizedTensor
    from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout

    def quantized(rows):  # int8: rows x 1024 bytes packed, twice that as the bf16 it stands for
        qdata, params = TensorWiseINT8Layout.quantize(torch.randn(rows, 1024, dtype=torch.bfloat16), is_weight=True,
                                                      per_channel=True)
        return QuantizedTensor(qdata, "TensorWiseINT8Layout", params)
    large, half = quantized(1024), quantized(512)  # 1 MiB and 0.5 MiB packed
    host = RecordingPins()
    pins = HostPins(pin=host.pin, unpin=host.unpin)
    assert pins.pin(large) and not pins.pin(half)
    assert same(host.pinned, [large])
    pins.release()
    assert same(host.unpinned, [large])


def test_pins_need_both_functions_or_neither():
    with pytest.raises(ValueError, match="both pin and unpin"):
        HostPins(pin=lambda t: True)


def test_session_pins_streamed_blocks_through_the_host_functions_and_unpins_at_close():
    # "meta" stands for the GPU: blocks 0 and 2 are on it, 1 and 3 stay in host memory and stream
    model = Stack(n=4, d=512)  # fc1 weight 4 MiB, fc2 weight 2 MiB; the rest below PIN_MIN_BYTES
    for i in (0, 2):
        model.blocks[i].to("meta")
    before = originals(model)
    host = RecordingPins()
    plan = plan_placement([1] * 4, 0, 0, capacity_bytes=10, reserve_bytes=0, workspace_bytes=0)
    session = StreamSession(plan, torch.device("meta"), streams=True, pin=host.pin, unpin=host.unpin)
    session.start(model)
    session.start(model)  # the run's later forwards attach nothing again
    big = [model.blocks[i].fc1.weight for i in (1, 3)] + [model.blocks[i].fc2.weight for i in (1, 3)]
    assert sorted(map(id, host.pinned)) == sorted(map(id, big)) and not host.unpinned
    closed = session.close()
    assert closed.startswith("streamed 2 of 4 blocks (1, 3); ")
    # everything fits the plan's budget: what streams is what the host left off the device, and the line says so
    assert plan.streamed == () and session.placed.streamed == (1, 3), closed
    streamed = sum(tensor_bytes(t) for i in (1, 3) for *_, t in block_tensors(model.blocks[i]))
    assert f"as placed by the host: {size_text(streamed)} of the blocks on the device, {size_text(streamed)} of 2/4 " \
           "blocks streamed per forward" in closed, closed
    assert sorted(map(id, host.unpinned)) == sorted(map(id, big))
    assert_restored(model, before)


@torch.no_grad()
def test_session_redraws_the_plan_on_the_hosts_placement_and_measures_it():
    # "meta" stands for the GPU. A host that loads the largest layers first leaves the small ones of every
    # block in host memory: each block streams that part, not whole blocks as the pack's plan has it.
    model = Stack(n=4, d=512)
    model.register_buffer("table", torch.zeros(1000))  # outside the blocks, left in host memory
    for block in model.blocks:
        block.fc1.to("meta")
    each = [sum(tensor_bytes(t) for *_, t in block_tensors(block)) for block in model.blocks]
    away = [tensor_bytes(b.norm.weight) + sum(map(tensor_bytes, b.fc2.parameters())) + 2 * 512 * 4
            for b in model.blocks]
    plan = plan_placement(each, 4000, activation=100, capacity_bytes=3 * each[0] + 4110, reserve_bytes=0,
                          workspace_bytes=10)
    assert plan.streamed == (1, 2, 3)  # the pack's plan: three whole blocks
    session = StreamSession(plan, torch.device("meta"), streams=True, pin=RecordingPins().pin,
                            unpin=RecordingPins().unpin)
    for _ in range(3):  # a run's forwards
        session.start(model)
        model(torch.zeros(2, 512, device="meta"))
    placed = session.placed
    assert placed.streamed == (0, 1, 2, 3) and placed.streamed_bytes == sum(away)
    assert placed.resident_bytes == sum(each) - sum(away) and placed.staging_bytes == 2 * away[0]
    assert placed.estimated_peak == placed.resident_bytes + 2 * away[0] + 100 + 10  # the rest is cast per layer
    closed = session.close(allocator_peak=placed.estimated_peak * 2)
    # 3 forwards of 4 streamed parts, and block 0's part issued again for a forward that never came
    copied = 3 * sum(away) + away[0]
    assert f"({copied / 3 / sum(away):.3f}x the estimate)" in closed and "(2.000x the estimate)" in closed
    assert "of 4/4 blocks streamed per forward" in closed, closed


def test_a_placement_that_does_not_add_up_is_refused():
    plan = plan_placement([100, 100], 10, 0, capacity_bytes=1000, reserve_bytes=0, workspace_bytes=0)
    with pytest.raises(ValueError, match="0 <= away <= bytes"):
        plan.placed([100, 100], [0, 101], 10, 0)
    with pytest.raises(ValueError, match="0 <= away <= bytes"):
        plan.placed([100], [0], 10, 0)


def test_session_that_streams_nothing_pins_nothing():
    model = Stack(n=2, d=512)
    host = RecordingPins()
    plan = plan_placement([1] * 2, 0, 0, capacity_bytes=10, reserve_bytes=0, workspace_bytes=0)
    session = StreamSession(plan, torch.device("meta"), streams=False, pin=host.pin, unpin=host.unpin)
    session.start(model)
    assert session.close() == "nothing streamed" and host.pinned == host.unpinned == []


# ---- CUDA ------------------------------------------------------------------

def cuda_stack(n, d, dtype=torch.bfloat16):
    model = Stack(n=n, d=d).to("cuda", dtype)
    return model


@pytest.mark.gpu
@gpu
@torch.no_grad()
def test_cuda_streaming_exact_with_pinned_host_copies():
    model = cuda_stack(6, 1024)
    x = torch.randn(4, 256, 1024, device="cuda", dtype=torch.bfloat16)
    ref = model(x)
    pins = HostPins()
    moved = move_blocks_to_host(model.blocks, [1, 3, 4], pins)
    assert moved > 0 and pinned_bytes(pins) > 0
    assert model.blocks[1].fc1.weight.device.type == "cpu" and model.blocks[1].fc1.weight.is_pinned()
    host_ptr = model.blocks[1].fc1.weight.data_ptr()
    with LayerwiseStreamer(model.blocks, "cuda", streamed=[1, 3, 4], pins=pins) as streamer:
        out = model(x)
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    assert model.blocks[1].fc1.weight.data_ptr() == host_ptr  # one host copy, pinned in place
    assert streamer.stats.late == 0 and streamer.stats.max_on_device == 2
    pins.release()
    assert not model.blocks[1].fc1.weight.is_pinned()


@pytest.mark.gpu
@gpu
@torch.no_grad()
def test_cuda_device_memory_holds_at_most_two_streamed_blocks():
    n, d = 8, 2048
    model = cuda_stack(n, d)
    block = sum(t.numel() * t.element_size() for *_, t in block_tensors(model.blocks[0]))
    x = torch.randn(1, 64, d, device="cuda", dtype=torch.bfloat16)
    model(x)  # cuBLAS workspace and kernel setup, outside the measurement
    move_blocks_to_host(model.blocks, range(1, n))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with LayerwiseStreamer(model.blocks, "cuda", streamed=range(1, n)):
        model(x)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert 2 * block <= extra < 2 * block + 32 * 2 ** 20  # two staged blocks plus small activations
    assert torch.cuda.memory_allocated() == base


@pytest.mark.gpu
@gpu
@torch.no_grad()
def test_cuda_session_on_a_partial_placement_estimates_what_it_copies_and_its_peak():
    # ComfyUI's partial load: the largest layers (fc1) of every block on the GPU, the rest of each in RAM
    n, d = 6, 2048
    model = cuda_stack(n, d)
    x = torch.randn(1, 64, d, device="cuda", dtype=torch.bfloat16)
    ref = model(x)
    for block in model.blocks:
        for module in (block.norm, block.fc2):
            module.to("cpu")
        block.gain = nn.Parameter(block.gain.detach().cpu(), requires_grad=False)
        block.shift = block.shift.cpu()  # a registered buffer: assigning keeps it one
    each = [sum(tensor_bytes(t) for *_, t in block_tensors(block)) for block in model.blocks]
    plan = plan_placement(each, 0, activation=0, capacity_bytes=80 * 2 ** 30, reserve_bytes=0, workspace_bytes=0)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated() - sum(tensor_bytes(t) for b in model.blocks for *_, t in block_tensors(b)
                                               if t.is_cuda)  # the inputs, reference and allocator state
    torch.cuda.reset_peak_memory_stats()
    session = StreamSession(plan, torch.device("cuda", torch.cuda.current_device()), streams=True)
    for _ in range(2):
        session.start(model)
        out = model(x)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    placed = session.placed
    closed = session.close(peak)
    assert torch.equal(out, ref)
    assert placed.streamed == tuple(range(n))
    part = each[0] - tensor_bytes(model.blocks[0].fc1.weight) - tensor_bytes(model.blocks[0].fc1.bias)
    assert placed.streamed_bytes == n * part and placed.staging_bytes == 2 * part
    assert f"({(2 * n * part + part) / 2 / (n * part):.3f}x the estimate)" in closed, closed
    # the weights' part of the peak as estimated, plus the small activations of 64 rows
    assert placed.estimated_peak <= peak < placed.estimated_peak + 32 * 2 ** 20, (peak, placed.estimated_peak)
