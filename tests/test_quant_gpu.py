"""INT8 ConvRot on CUDA: comfy-kitchen's compiled kernels against its eager reference."""

import pytest
import torch
from torch import nn

from bigdit.host.layers import ComfyQuantLinear
from bigdit.quant import QuantConfig, quantize_layers
from bigdit.quant.int8_convrot import DEFAULT_SPLIT_ROWS, Int8ConvRotMethod

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def quantized(k, n, device="cuda"):
    torch.manual_seed(0)
    layer = nn.Linear(k, n, device=device, dtype=torch.bfloat16)
    nn.init.normal_(layer.weight, std=k ** -0.5)
    replacements, _ = quantize_layers(nn.Sequential(layer), QuantConfig(method=Int8ConvRotMethod(256)),
                                      layer_type=ComfyQuantLinear)
    return layer, replacements["0"]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("kernel", ["kitchen", "dequant"])
def test_each_kernel_matches_fp32(kernel, monkeypatch):
    layer, q = quantized(1024, 2048)
    x = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)
    ref = nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
    monkeypatch.setenv("BIGDIT_INT8_KERNEL", kernel)
    assert rel(q(x), ref) < 0.02


def test_row_split_bit_exact_on_cuda(monkeypatch):
    _, q = quantized(512, 1024)
    x = torch.randn(DEFAULT_SPLIT_ROWS + 100, 512, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setenv("BIGDIT_INT8_KERNEL", "kitchen")
    whole = q(x)
    monkeypatch.setenv("BIGDIT_INT8_KERNEL", "kitchen_split")
    assert torch.equal(whole, q(x))


def test_layerwise_quantization_peak_is_about_one_layer():
    """A CPU-resident model quantized on the GPU never holds more than ~one layer there."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(8)]).to(torch.bfloat16)
    layer_bytes = 4096 * 4096 * 2
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    replacements, report = quantize_layers(model, QuantConfig(method=Int8ConvRotMethod(256),
                                                              compute_device=torch.device("cuda")))
    peak = torch.cuda.max_memory_allocated() - base
    assert len(replacements) == 8
    assert all(r.weight.device.type == "cpu" for r in replacements.values())
    # bf16 copy + fp32 work buffers of one layer; 8 layers would be 8x that.
    assert peak < 4 * layer_bytes, peak


def test_kitchen_cuda_backend_is_available():
    """The other tests here would pass on the eager backend too; this one says which ran."""
    import comfy_kitchen as ck
    assert ck.registry.is_available("cuda")


def test_the_choice_is_measured_only_where_tuning_is_asked(monkeypatch, tmp_path):
    """By default the Triton kernels run (sm80+), nothing timed; with BIGDIT_INT8_TUNE=1 the first call of a shape
    times kitchen, its row split and Triton once, and the choice is kept in the tuning store."""
    from probes import chooser
    from bigdit.quant import int8_convrot, tuning
    monkeypatch.delenv("BIGDIT_INT8_KERNEL", raising=False)
    monkeypatch.delenv("BIGDIT_INT8_MAX_ROWS", raising=False)
    monkeypatch.setattr(tuning, "_current", tuning.current())
    tuning.use(str(tmp_path / tuning.FILE_NAME))
    monkeypatch.setattr(chooser(), "choices", {})
    _, q = quantized(1024, 1024)
    x = torch.randn(DEFAULT_SPLIT_ROWS + 100, 1024, device="cuda", dtype=torch.bfloat16)
    before = dict(chooser().timings)
    q(x)
    assert chooser().timings == before
    assert set(chooser().choices.values()) == {"triton" if torch.cuda.get_device_capability() >= (8, 0) else "kitchen"}
    monkeypatch.setattr(chooser(), "choices", {})
    monkeypatch.setenv(tuning.TUNE_ENV, "1")
    q(x)
    new = {k: v for k, v in chooser().timings.items() if k not in before}
    assert len(new) == 1 and set(next(iter(new.values()))) == {"kitchen", "kitchen_split", "triton"}
    q(x)
    assert len(chooser().timings) == len(before) + 1
    (device, shape), = new
    kept = tuning.TuningStore(str(tmp_path / tuning.FILE_NAME)).get(
        tuning.device_key(x.device), f"{int8_convrot.CONVROT}.kernel", int8_convrot.KERNEL_VERSION,
        "|".join(map(str, shape)))
    assert kept["choice"] == chooser().choices[device, shape], kept


def test_row_split_off_is_its_own_choice(monkeypatch):
    """A row_split="off" layer never runs the split, and its choice is kept apart from an "auto" layer's."""
    from probes import chooser
    from bigdit.quant.kernel_select import rows_bucket
    monkeypatch.delenv("BIGDIT_INT8_KERNEL", raising=False)
    monkeypatch.delenv("BIGDIT_INT8_MAX_ROWS", raising=False)
    layer, auto = quantized(2048, 1024)
    off, = quantize_layers(nn.Sequential(layer), QuantConfig(method=Int8ConvRotMethod(256, "off")))[0].values()
    x = torch.randn(DEFAULT_SPLIT_ROWS + 100, 2048, device="cuda", dtype=torch.bfloat16)
    auto(x)
    off(x)
    keys = {shape[-1]: choice for (_, shape), choice in chooser().choices.items()
            if shape[:3] == (rows_bucket(x.shape[0]), 2048, 1024)}
    assert set(keys) == {("kitchen", "kitchen_split", "triton", "dequant"), ("kitchen", "triton", "dequant")}
    assert keys[("kitchen", "triton", "dequant")] in ("kitchen", "triton")


def test_lora_patch_math_on_the_gpu_keeps_an_offloaded_layer_in_ram(device="cuda"):
    """host/lora_fold.py has ComfyUI patch a layer left in RAM with device_to = the GPU: convert_weight and
    set_weight compute there, the patched tensors stay in host memory, the layer computes from them per call,
    convert_weight still gives the unpatched base, and ComfyUI's restore brings back the very originals."""
    layer, q = quantized(1024, 2048, device="cpu")
    original = dict(q.named_parameters())
    delta = 0.02 * torch.randn(2048, 1024, device=device)
    temp = torch.empty(2048, 1024, device=device)  # what patch_weight_to_device hands convert_weight
    base = q.convert_weight(temp, inplace=True)
    assert base.device.type == device and base.dtype == torch.float32
    q.set_weight(base + delta)
    assert all(p.device.type == "cpu" for p in q.parameters())
    x = torch.randn(300, 1024, device=device, dtype=torch.bfloat16)
    ref = nn.functional.linear(x.float(), layer.weight.to(device).float() + delta, layer.bias.to(device).float())
    assert rel(q(x), ref) < 0.02
    assert torch.equal(q.convert_weight(temp), base)
    q.weight = original["weight"]
    assert all(getattr(q, k) is v for k, v in original.items())
