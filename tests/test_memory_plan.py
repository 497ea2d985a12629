"""The memory planner's arithmetic on synthetic models, against numbers worked out by hand."""
import pytest
import torch
from torch import nn

from bigdit.offload.plan import (GIB, MIB, MemoryPlan, RunShape, activation_bytes, find_blocks, infer_shape,
                                         latent_tokens, max_resident_tokens, module_bytes, plan_for_model,
                                         plan_placement, spread, tensor_bytes)
from bigdit.quant import QuantLinear
from bigdit.quant.int8_convrot import Int8ConvRotMethod
from offload_helpers import all_resident, h3_shape


def int8_linear(k, n, bias=True):
    tensors = {"weight": torch.zeros(n, k, dtype=torch.int8), "weight_scale": torch.ones(n, 1)}
    return QuantLinear(Int8ConvRotMethod(16), k, n, tensors, torch.zeros(n, dtype=torch.bfloat16) if bias else None,
                       compute_dtype=torch.bfloat16)


class Block(nn.Module):
    def __init__(self, d=32, ffn=64, dtype=torch.bfloat16):
        super().__init__()
        self.norm = nn.RMSNorm(d, dtype=dtype)
        self.fc1 = nn.Linear(d, 2 * ffn, bias=False, dtype=dtype)
        self.fc2 = nn.Linear(ffn, d, dtype=dtype)


class Model(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.embed = nn.Linear(16, 32, dtype=torch.float32)  # fp32 on purpose, like H3's patch projections
        self.blocks = nn.ModuleList(Block() for _ in range(n))
        self.register_buffer("freqs", torch.zeros(10, dtype=torch.float32))


# bf16 Block(32, 64): norm 32*2 + fc1 32*128*2 + fc2 (64*32 + 32)*2
BLOCK_BYTES = 64 + 8192 + 4160
# fp32 embed (16*32 + 32)*4, buffer 10*4
REST_BYTES = 2176 + 40


def test_module_bytes_counts_true_bytes():
    model = Model()
    assert module_bytes(model.blocks[0]) == BLOCK_BYTES == 12416
    assert module_bytes(model) == 4 * BLOCK_BYTES + REST_BYTES


def test_quantlinear_counted_by_its_int8_weight_and_scales():
    layer = int8_linear(64, 32)
    # int8 weight 32*64, fp32 scales 32*4, bf16 bias 32*2
    assert module_bytes(layer) == 2048 + 128 + 64


def test_kitchen_quantized_tensor_counted_by_packed_data():
    from comfy_kitchen.tensor import QuantizedTensor
    from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout
    weight = torch.randn(32, 256, dtype=torch.bfloat16)
    qdata, params = TensorWiseINT8Layout.quantize(weight, is_weight=True, per_channel=True, convrot=True,
                                                  convrot_groupsize=256)
    qt = QuantizedTensor(qdata, "TensorWiseINT8Layout", params)
    assert qt.numel() * qt.element_size() == 32 * 256 * 2  # what naive accounting would say
    assert tensor_bytes(qt) == 32 * 256 + 32 * 4


@pytest.mark.parametrize("layout, expected", [
    # packed e2m1 pairs + fp32 tensor scale + e4m3 block scales (rows padded to 128, one per 16 columns)
    ("TensorCoreNVFP4Layout", 32 * 128 + 4 + 128 * 16),
    ("TensorCoreMXFP8Layout", 32 * 256 + 128 * 8),  # e4m3 data + e8m0 scales (rows padded to 128, one per 32)
    ("TensorCoreFP8Layout", 32 * 256 + 4),
])
def test_kitchen_quantized_tensor_counts_every_tensor_param(layout, expected):
    from comfy_kitchen.tensor import QuantizedTensor
    qt = QuantizedTensor.from_float(torch.randn(32, 256, dtype=torch.bfloat16), layout)
    assert tensor_bytes(qt) == expected


def test_overrides_stand_in_for_replaced_modules():
    model = Model()
    # blocks.1.fc1 (bf16 32->128, 8192 bytes) becomes int8 without bias: 128*32 + 128*4
    overrides = {"blocks.1.fc1": int8_linear(32, 128, bias=False)}
    assert module_bytes(model, overrides) == 4 * BLOCK_BYTES + REST_BYTES - 8192 + 4608
    plan = plan_for_model(model, find_blocks(model), None, capacity_bytes=10 ** 9, reserve_bytes=0,
                          overrides=overrides, workspace_bytes=0)
    assert plan.block_bytes == (BLOCK_BYTES, BLOCK_BYTES - 8192 + 4608, BLOCK_BYTES, BLOCK_BYTES)
    assert plan.rest_bytes == REST_BYTES
    assert all_resident(plan) and plan.estimated_peak == sum(plan.block_bytes) + REST_BYTES


def test_h3_activation_peak_by_hand():
    # 32,700 rows, bf16; D 5376, I 56*128 = 7168, W 2*14336 = 28672
    # attention: 32700*2*(5376 + 7*7168) + 56*32700*4 = 3,633,100,800 + 7,324,800
    # MLP:       32700*2*(2*5376 + 2*28672)              = 4,453,478,400  (the peak)
    # model input held by its caller: 32700*2*5376       =   351,590,400
    assert activation_bytes(h3_shape(32700)) == 4_453_478_400 + 351_590_400
    assert activation_bytes(h3_shape(32700, batch=2)) == 2 * (4_453_478_400 + 351_590_400)
    assert activation_bytes(h3_shape(32700, dtype=torch.float32)) == 2 * (4_453_478_400 + 351_590_400)


def test_attention_phase_wins_when_the_mlp_is_narrow():
    # 10 rows, D 8, I 8 (2 heads x 4), W 16 (ungated ffn 16), bf16
    # attention 10*2*(8 + 56) + 2*10*4 = 1360; MLP 10*2*(16 + 32) = 960; held 160
    shape = RunShape(tokens=10, hidden=8, heads=2, head_dim=4, ffn=16, gated=False)
    assert activation_bytes(shape) == 1360 + 160


@pytest.mark.parametrize("adaln", [False, True], ids=["pruned", "full"])
def test_infer_shape_recovers_h3_from_its_linears(adaln):
    class H3Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv_proj = nn.Linear(5376, 21504, bias=False, device="meta")
            self.out_proj = nn.Linear(7168, 5376, device="meta")
            self.fc1 = nn.Linear(5376, 28672, device="meta")
            self.fc2 = nn.Linear(14336, 5376, device="meta")
            if adaln:  # per-sample modulation from the 2688-wide time embedding: wider, but not per token
                self.adaln_proj = nn.Linear(2688, 96768, device="meta")
    shape = infer_shape(H3Block(), 32700, torch.bfloat16)
    assert shape == h3_shape(32700)


def test_infer_shape_of_a_wan_block():
    class WanBlock(nn.Module):
        def __init__(self, d=256, ffn=512):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(d, d, device="meta") for _ in range(4))
            self.ffn = nn.Sequential(nn.Linear(d, ffn, device="meta"), nn.GELU(), nn.Linear(ffn, d, device="meta"))
    shape = infer_shape(WanBlock(), 16, torch.float16, batch=2, heads=2)
    assert (shape.hidden, shape.inner, shape.heads, shape.ffn, shape.gated) == (256, 256, 2, 512, False)
    assert (shape.batch, shape.dtype) == (2, torch.float16)


def test_latent_tokens():
    assert latent_tokens((1, 16, 21, 60, 104), (1, 2, 2)) == 21 * 30 * 52 == 32760
    assert latent_tokens((2, 4, 128, 128), 2) == 64 * 64
    assert latent_tokens((1, 16, 1, 9, 9), (1, 2, 2)) == 25  # patchify pads up
    assert latent_tokens((1, 16, 1, 8, 8)) == 64


@pytest.mark.parametrize("n,k", [(50, 16), (50, 28), (10, 7), (4, 2), (5, 1), (6, 6), (7, 0)])
def test_spread_is_even_and_keeps_block_zero(n, k):
    picked = spread(n, k)
    assert len(set(picked)) == k and all(0 <= i < n for i in picked) and list(picked) == sorted(picked)
    assert (0 in picked) == (k == n)
    if k > 1:
        gaps = [b - a for a, b in zip(picked, picked[1:])]
        assert max(gaps) - min(gaps) <= 1


def test_spread_by_hand():
    # the last block of each of 7 runs of 10/7 blocks: ceil(10 (j+1) / 7) - 1
    assert spread(10, 7) == (1, 2, 4, 5, 7, 8, 9)
    assert spread(4, 2) == (1, 3)
    assert spread(5, 1) == (4,)


def test_fewest_streamed_blocks_that_fit():
    # budget 600 = 700 - 100; fixed 50 rest + 30 activations; blocks 100 each.
    # s streamed: (10 - s)*100 + min(s, 2)*100 + 80 <= 600 -> s >= 7 (peak 580); s = 6 would need 680.
    plan = plan_placement([100] * 10, rest_bytes=50, activation=30, capacity_bytes=700, reserve_bytes=100,
                          workspace_bytes=0)
    assert plan.streamed == (1, 2, 4, 5, 7, 8, 9) and plan.resident == (0, 3, 6)
    assert plan.staging_bytes == 200 and plan.estimated_peak == 580 and plan.fits
    assert plan.budget_bytes == 600
    assert "streamed from host memory: 0.00 MiB, blocks 1-2, 4-5, 7-9" in plan.render()


def test_streaming_pays_off_from_the_third_block():
    # 4 blocks of 100, fixed 10, budget 400: all resident needs 410. One or two streamed blocks save nothing
    # (their staging slots hold as much): 300 + 100 + 10 and 200 + 200 + 10. Three: 100 + 200 + 10 = 310.
    plan = plan_placement([100] * 4, 10, 0, capacity_bytes=400, reserve_bytes=0, workspace_bytes=0)
    assert plan.streamed == (1, 2, 3) and plan.estimated_peak == 310
    # budget 410: all resident fits exactly
    assert all_resident(plan_placement([100] * 4, 10, 0, 410, 0, workspace_bytes=0))


def test_one_streamed_block_needs_one_staging_slot():
    plan = MemoryPlan(block_bytes=(50, 50, 300), rest_bytes=0, activation_bytes=0, workspace_bytes=0,
                      capacity_bytes=0, reserve_bytes=0, streamed=(2,))
    assert plan.staging_bytes == 300 and plan.estimated_peak == 400


def test_staging_uses_the_two_largest_streamed_blocks():
    plan = MemoryPlan(block_bytes=(10, 40, 30, 20), rest_bytes=0, activation_bytes=0, workspace_bytes=0,
                      capacity_bytes=0, reserve_bytes=0, streamed=(1, 2, 3))
    assert plan.staging_bytes == 70 and plan.resident_bytes == 10 and plan.streamed_bytes == 90


def test_nothing_fits():
    plan = plan_placement([100] * 3, rest_bytes=500, activation=0, capacity_bytes=400, reserve_bytes=0,
                          workspace_bytes=0)
    assert not plan.fits and plan.streamed == (0, 1, 2)
    assert "does not fit" in plan.render()


def test_render_h3_bf16_on_a_24_gib_card():
    block = 770_724_864  # 385,351,680 bf16 linear weights + two 5376-wide bf16 norm scales
    act = activation_bytes(h3_shape(32700))
    plan = plan_placement([block] * 50, 0, act, capacity_bytes=24 * GIB, reserve_bytes=2 * GIB,
                          workspace_bytes=64 * MIB, shape=h3_shape(32700))
    # 22 GiB budget - 4.48 GiB activations - 64 MiB - 2 staging blocks (1.44 GiB) leaves 16.03 GiB: 22 blocks;
    # peak 22*770,724,864 + 4,805,068,800 + 67,108,864 + 1,541,449,728 = 23,369,574,400 bytes = 21.76 GiB
    assert len(plan.resident) == 22 and 0 in plan.resident
    lines = plan.render().splitlines()
    assert lines[0] == "resident 22/50 blocks, streaming 28; estimated peak 21.8 GiB of 22.0 GiB"
    assert "32,700 tokens x batch 1 (bfloat16)" in plan.render()


def test_max_resident_tokens():
    # per token bf16 H3: 2*(2*5376 + 2*28672) + 2*5376 = 146,944 bytes
    plan = plan_placement([1000] * 2, 0, 0, capacity_bytes=1000 * 2 + 146_944 * 7 + 5, reserve_bytes=0,
                          workspace_bytes=0)
    assert max_resident_tokens(plan, h3_shape(1)) == 7


def test_run_shape_adds_the_streams_of_an_audio_video_latent():
    from bigdit.offload.budget import ModelView
    model = Model()
    model.patch_size = (1, 2, 2)
    view = ModelView(model, {}, torch.bfloat16)
    video, audio = (1, 24, 32, 48, 84), (1, 32, 2, 178)
    assert view.run_shape(video).tokens == 32 * 24 * 42
    assert view.run_shape(video, audio).tokens == 32 * 24 * 42 + 178  # audio: one token a latent frame
    assert view.run_shape((2, *video[1:]), audio).batch == 2
    required = view.memory_required(0, parts=lambda shape: [video, audio])
    assert required((1, 1, 24 * 32 * 48 * 84 + 32 * 2 * 178)) == activation_bytes(view.run_shape(video, audio))


def test_paged_run_line_reports_what_the_host_copied_per_model_call():
    from bigdit.offload.budget import paged_run_line
    plan = plan_placement([100] * 4, 10, 0, capacity_bytes=400, reserve_bytes=0, workspace_bytes=0)
    # 6 model calls; 30 of 40 layer calls copied 3 GiB in all: 0.5 GiB per model call
    line = paged_run_line(plan, model_calls=6, paged_calls=40, copied_calls=30, copied_bytes=3 * GIB,
                          device_weight_bytes=12 * GIB, allocator_peak=5 * GIB)
    assert line.startswith("ComfyUI's dynamic VRAM paged the weights (mechanism: the host's cast path")
    assert "copied in: 0.50 GiB per model call (30 of 40 layer calls, 6 model calls)" in line, line
    assert "weights on the device at the end 12.00 GiB; allocator peak 5.00 GiB" in line, line
    assert line.endswith(f"the pack's plan, not applied: {plan.summary_line()}")
    bare = paged_run_line(plan, 0, 0, 0, 0, None, None)  # no model call, no CUDA (a CPU run)
    assert "0.00 MiB per model call" in bare and "allocator" not in bare and "at the end" not in bare
