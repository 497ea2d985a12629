"""The INT8 GEMM with a LoRA's up projection in its epilogue (quant/int8_lora.py) on the GPU, in bfloat16 (the
interpreter's checks in tests/int8_triton_interpreted.py take float16): against the GEMM followed by the addmm
it replaces, at MiniMax-H3 pruned's qkv and fc2 widths, through the layer's forward with a lone LoRA branch; an INT8
ConvRot layer and a W4A8 one (its codes decoded for the call, quant/w4a8_int8.py)."""
import pytest
import torch

from bigdit.quant import int8_lora, int8_triton, witness
from bigdit.quant.int8_convrot import Int8ConvRotMethod
from bigdit.quant.linear import QuantLinear, quantized_layer
from bigdit.quant.w4a8_int8 import W4A8Int8Method

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class Branch:
    """A lone LoRA's part, as host/lora_branch.py's LoraBranch offers it: low_rank(x), or added after the GEMM."""

    def __init__(self, down, up, alpha):
        self.down, self.up, self.alpha = down, up, alpha

    def low_rank(self, x):
        x2d = x.reshape(-1, x.shape[-1])
        return torch.nn.functional.linear(x2d, self.down), self.up, self.alpha

    def __call__(self, x, out):
        h, up, alpha = self.low_rank(x)
        out.view(-1, out.shape[-1]).addmm_(h, up.t(), alpha=alpha)
        return out


class BranchedLinear(QuantLinear):
    branch = None

    def output_branches(self):
        return [self.branch]


@pytest.mark.skipif(int8_triton.triton is None, reason="Triton is not installed")
@pytest.mark.parametrize("k,n,rank,input_act", [(5376, 21504, 384, None), (14336, 5376, 128, "swiglu")])
@pytest.mark.parametrize("method", [lambda: Int8ConvRotMethod(256), lambda: W4A8Int8Method(16, 256)],
                         ids=["int8_convrot", "asym_w4a8_int8"])
def test_fused_lora_matches_the_gemm_and_addmm(k, n, rank, input_act, method):
    torch.manual_seed(0)
    device = torch.device("cuda")
    weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5
    layer = quantized_layer(method(), weight, k, n, None, torch.bfloat16, device, device,
                            layer_type=BranchedLinear)
    layer.branch = Branch(torch.randn(rank, k, device=device, dtype=torch.bfloat16) * k ** -0.5,
                          torch.randn(n, rank, device=device, dtype=torch.bfloat16) * 0.05, 0.7)
    x = torch.randn(3, 1000, 2 * k if input_act else k, device=device, dtype=torch.bfloat16)
    before = witness.TALLY.calls[int8_triton.TALLY, "triton+lora"]
    fused = layer(x, input_act=input_act)
    assert witness.TALLY.calls[int8_triton.TALLY, "triton+lora"] == before + 1, int8_lora._failed
    layer.method.fuses_low_rank = False  # the same branch added after the GEMM
    unfused = layer(x, input_act=input_act)
    del layer.method.fuses_low_rank
    delta = unfused.float() - layer.method.apply(layer, layer_input(x, input_act)).float()
    assert fused.shape == unfused.shape == (3, 1000, n) and fused.dtype == torch.bfloat16
    # the same sums, the fused one rounded once to bf16 instead of twice: within a bf16 rounding of the output
    rel = ((fused.float() - unfused.float()).norm() / unfused.float().norm()).item()
    assert rel <= 2 ** -8, rel
    # and the low-rank part is really there: far from the layer without it
    assert (delta.norm() / unfused.float().norm()).item() > 1e-2


def layer_input(x, input_act):
    from bigdit.quant.swiglu import activated
    return activated(x, input_act)
