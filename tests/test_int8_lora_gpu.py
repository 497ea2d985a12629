"""A LoRA's part in the INT8 path (quant/int8_lora.py) on the GPU, in bfloat16 (the interpreter's checks in
tests/int8_triton_interpreted.py take float16): its hidden from the call's own quantized rows, its up projection in
the GEMM's epilogue, at MiniMax-H3 pruned's qkv and fc2 widths, through the layer's forward with a lone LoRA
branch, against float64 and against the GEMM followed by the addmm it replaces; an INT8 ConvRot layer and a W4A8 one
(its codes decoded for the call, quant/w4a8_int8.py)."""
import pytest
import torch

from bigdit.quant import int8_lora, int8_triton, witness
from bigdit.quant.int8_convrot import Int8ConvRotMethod
from bigdit.quant.linear import QuantLinear, quantized_layer
from bigdit.quant.low_rank import LowRank
from bigdit.quant.swiglu import activated
from bigdit.quant.w4a8_int8 import W4A8Int8Method

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class Branch:
    """A lone LoRA's part, as host/lora_branch.py's LoraBranch offers it: low_rank(), or added after the GEMM."""

    def __init__(self, part):
        self.part = part

    def low_rank(self):
        return self.part

    def __call__(self, x, out):
        self.part.add_to(x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1]))
        return out


class BranchedLinear(QuantLinear):
    branch = None

    def output_branches(self):
        return [self.branch]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.skipif(int8_triton.triton is None, reason="Triton is not installed")
@pytest.mark.parametrize("k,n,rank,input_act,up_blocks", [(5376, 21504, 384, None, 1), (5376, 21504, 384, None, 3),
                                                           (14336, 5376, 128, "swiglu", 1)],
                         ids=["qkv", "qkv_side_by_side", "fc2"])
@pytest.mark.parametrize("method", [lambda: Int8ConvRotMethod(256), lambda: W4A8Int8Method(16, 256)],
                         ids=["int8_convrot", "asym_w4a8_int8"])
def test_fused_lora_matches_the_layer_plus_the_part_on_its_input(k, n, rank, input_act, up_blocks, method):
    """up_blocks 3: q, k and v's LoRAs side by side on the fused qkv (up block-diagonal, its off-diagonal blocks
    not read by the epilogue)."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5
    layer = quantized_layer(method(), weight, k, n, None, torch.bfloat16, device, device,
                            layer_type=BranchedLinear)
    up = torch.randn(n, rank, device=device, dtype=torch.bfloat16) * 0.05
    up *= torch.block_diag(*[torch.ones(n // up_blocks, rank // up_blocks, device=device)] * up_blocks).bfloat16()
    part = LowRank((None, None, None), torch.randn(rank, k, device=device, dtype=torch.bfloat16) * k ** -0.5, None,
                   up, 0.7)
    assert part.blocks == up_blocks
    layer.branch = Branch(part)
    x = torch.randn(3, 1000, 2 * k if input_act else k, device=device, dtype=torch.bfloat16)
    before = witness.TALLY.calls[int8_triton.TALLY, "triton+lora"]
    fused = layer(x, input_act=input_act)
    assert witness.TALLY.calls[int8_triton.TALLY, "triton+lora"] == before + 1, int8_lora._failed
    assert ("int8_rows", True, 256) in part.derived  # the hidden from the INT8 rows
    layer.method.fuses_low_rank = False  # the same branch added after the GEMM, on the activated input
    unfused = layer(x, input_act=input_act)
    del layer.method.fuses_low_rank
    xa = activated(x, input_act)
    plain = layer.method.apply(layer, xa).double()
    lora = 0.7 * torch.nn.functional.linear(torch.nn.functional.linear(xa.double(), part.down.double()),
                                            part.up.double())
    assert fused.shape == unfused.shape == (3, 1000, n) and fused.dtype == torch.bfloat16
    # the layer's own product, and the part within the INT8 roundings of the input and of the down matrix (under
    # 1% each): 2^-5 of the part, 2^-7 of the output
    assert rel(fused, plain + lora) <= 2 ** -7, rel(fused, plain + lora)
    assert rel(fused.double() - plain, lora) <= 2 ** -5, rel(fused.double() - plain, lora)
    # the addmm's part on the bf16 input, for scale: the INT8 hidden is within a few of its errors
    assert rel(unfused.double() - plain, lora) <= rel(fused.double() - plain, lora)
    assert rel(lora, plain) > 1e-2  # the part is really there: far from the layer without it
