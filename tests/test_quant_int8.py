"""INT8 ConvRot core on CPU (comfy-kitchen's eager backend) against bf16/fp32 references."""
import pytest
import torch
from torch import nn

from bigdit.host.layers import ComfyQuantLinear, fp8_weight_scale
from bigdit.quant.quantize_pass import stored_conversions
from bigdit.quant import QuantConfig, QuantLinear, apply_replacements, quantize_layers
from bigdit.quant.quantize_pass import QuantizationError
from bigdit.quant.int8_convrot import Int8ConvRotMethod
from bigdit.quant.kernel_select import KernelChooser
from bigdit.quant.patterns import parse_patterns


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def cosine(out, ref):
    return torch.nn.functional.cosine_similarity(out.float().flatten(), ref.float().flatten(), dim=0).item()


def make_linear(k, n, bias=True, seed=0, outliers=False, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0, k ** -0.5)
        if outliers:
            layer.weight[:, :4] *= 30  # a few hot input channels, as in real DiT weights
    return layer.to(dtype)


def quantize_one(layer, group_size=256, **method_kw):
    model = nn.Sequential(layer)
    replacements, report = quantize_layers(model, QuantConfig(method=Int8ConvRotMethod(group_size, **method_kw)),
                                           layer_type=ComfyQuantLinear)
    return replacements.get("0"), report


@pytest.mark.parametrize("group_size", [16, 64, 256])
def test_each_group_size_close_to_fp32_reference(group_size):
    layer = make_linear(512, 384)
    qlayer, _ = quantize_one(layer, group_size)
    x = torch.randn(33, 512, dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
    out = qlayer(x)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    # W8A8 with per-channel weights and per-token activations: about 1% on Gaussian data.
    assert rel_err(out, ref) < 0.02
    assert cosine(out, ref) > 0.999


def test_convrot_tames_outlier_channels():
    """Rotation spreads outlier input channels; plain per-token INT8 activations suffer from them."""
    from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout
    layer = make_linear(1024, 256, outliers=True)
    x = torch.randn(64, 1024, dtype=torch.bfloat16)
    x[:, :4] *= 50
    ref = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
    qlayer, _ = quantize_one(layer, 256)
    convrot_err = rel_err(qlayer(x), ref)
    # The same weights without rotation: per-channel weights, per-token activations.
    qw, wp = TensorWiseINT8Layout.quantize(layer.weight, is_weight=True, per_channel=True)
    qx, xp = TensorWiseINT8Layout.quantize(x, is_weight=False)
    plain = (qx.float() * xp.scale.float()) @ (qw.float() * wp.scale.float()).T + layer.bias.float()
    plain_err = rel_err(plain, ref)
    assert convrot_err < 0.5 * plain_err, (convrot_err, plain_err)
    assert convrot_err < 0.05


def count_kitchen_calls(monkeypatch):
    """Counts comfy-kitchen int8_linear calls (each still runs the real kernel)."""
    import comfy_kitchen as ck
    real, calls = ck.int8_linear, []

    def counted(x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(ck, "int8_linear", counted)
    return calls


def test_row_split_is_bit_exact(monkeypatch):
    layer = make_linear(256, 512)
    qlayer, _ = quantize_one(layer)
    x = torch.randn(2, 50, 256, dtype=torch.bfloat16)
    calls = count_kitchen_calls(monkeypatch)
    whole = qlayer(x)
    assert calls == [100]
    monkeypatch.setenv("BIGDIT_INT8_MAX_ROWS", "16")
    monkeypatch.setenv("BIGDIT_INT8_MIN_SPLIT_N", "512")
    calls.clear()
    split = qlayer(x)
    assert calls == [16] * 6 + [4]
    assert torch.equal(whole, split)
    monkeypatch.setenv("BIGDIT_INT8_MIN_SPLIT_N", "513")  # too narrow to split: same path as whole
    calls.clear()
    assert torch.equal(whole, qlayer(x))
    assert calls == [100]


def test_max_rows_zero_never_splits(monkeypatch):
    layer = make_linear(256, 512)
    qlayer, _ = quantize_one(layer)
    calls = count_kitchen_calls(monkeypatch)
    monkeypatch.setenv("BIGDIT_INT8_MAX_ROWS", "0")
    qlayer(torch.randn(40, 256, dtype=torch.bfloat16))
    assert calls == [40]


def test_forced_kernel_env_is_validated(monkeypatch):
    layer = make_linear(256, 256)
    qlayer, _ = quantize_one(layer)
    monkeypatch.setenv("BIGDIT_INT8_KERNEL", "nonsense")
    with pytest.raises(ValueError, match="BIGDIT_INT8_KERNEL"):
        qlayer(torch.randn(3, 256, dtype=torch.bfloat16))


def test_chooser_uses_default_candidate_on_cpu():
    chooser = KernelChooser("t", force_env="BIGDIT_TEST_UNSET", known=("a", "b"), version="v1")
    calls = []
    choice = chooser.choose(torch.device("cpu"), ("k",), {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")})
    assert choice == "a" and calls == []  # nothing timed off-GPU


def test_swiglu_input_activation_matches_unfused():
    layer = make_linear(256, 128)
    qlayer, _ = quantize_one(layer)
    x = torch.randn(10, 512, dtype=torch.bfloat16)
    gate, up = x.chunk(2, dim=-1)
    unfused = qlayer(torch.nn.functional.silu(gate) * up)
    fused = qlayer(x, input_act="swiglu")
    assert rel_err(fused, unfused) < 0.01


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(256, 512)
        self.odd = nn.Linear(100, 256)            # in_features not divisible by any group size
        self.head = nn.Linear(512, 64)
        self.conv = nn.Conv2d(4, 8, 3)            # weight-bearing, not Linear-like
        self.norm = nn.LayerNorm(256)
        self.to(torch.bfloat16)
        self.head.float()                         # kept in fp32 on purpose


def test_report_and_skips():
    model = Tiny()
    replacements, report = quantize_layers(model, QuantConfig(method=Int8ConvRotMethod(256)))
    assert set(replacements) == {"proj"}
    text = report.render()
    assert text.splitlines()[0] == "quantized 1/3 linear layers"
    reasons = {r.name: r.reason for r in report.kept}
    assert "not divisible by group size 256" in reasons["odd"]
    assert reasons["head"] == "stored in fp32 on purpose"
    assert reasons["conv"].startswith("not Linear-like")
    assert "norm" not in reasons  # 1-D weights are not layers to report
    assert report.bytes_before() - report.bytes_after() == 256 * 512 * 2 - (256 * 512 + 512 * 4)
    assert "GiB" in text.splitlines()[1]


def test_include_fp32_and_smaller_group():
    model = Tiny()
    cfg = QuantConfig(method=Int8ConvRotMethod(256), include_fp32=True)
    replacements, _ = quantize_layers(model, cfg)
    assert set(replacements) == {"proj", "head"}
    assert replacements["head"].compute_dtype == torch.float32


def test_ignored_patterns():
    assert parse_patterns(" a.*, b\n\nc ,") == ("a.*", "b", "c")
    model = Tiny()
    replacements, report = quantize_layers(model, QuantConfig(method=Int8ConvRotMethod(256), ignored=("pro*",)))
    assert replacements == {}
    assert {r.name: r.reason for r in report.kept}["proj"] == "ignored (matches 'pro*')"
    replacements, report = quantize_layers(model, QuantConfig(method=Int8ConvRotMethod(256), ignored=("*",)))
    assert replacements == {} and report.summary_line() == "quantized 0/3 linear layers"


def test_quantization_does_not_touch_the_model_and_is_idempotent():
    model = Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    replacements, _ = quantize_layers(model, QuantConfig(method=Int8ConvRotMethod(256)))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    apply_replacements(model, replacements)
    assert isinstance(model.proj, QuantLinear)
    weight = model.proj.weight
    again, report = quantize_layers(model, QuantConfig(method=Int8ConvRotMethod(256)))
    assert again == {}
    assert model.proj.weight is weight
    # The report counts what this pass did; the layer quantized before is listed by format.
    assert report.summary_line() == "quantized 0/3 linear layers"
    assert {r.name: r.reason for r in report.records}["proj"] == "already quantized"
    assert "already quantized, left alone: int8_convrot x1" in report.render().splitlines()


def test_failure_names_the_layer_and_installs_nothing():
    class Exploding(Int8ConvRotMethod):
        def quantize_weight(self, weight):
            if weight.shape == (64, 512):
                raise RuntimeError("boom")
            return super().quantize_weight(weight)

    model = Tiny()
    model.head.to(torch.bfloat16)
    with pytest.raises(QuantizationError, match="'head'.*boom"):
        quantize_layers(model, QuantConfig(method=Exploding(256)))
    assert isinstance(model.proj, nn.Linear) and model.proj.weight.dtype == torch.bfloat16


def test_quantized_layer_moves_with_module_and_reports_true_bytes():
    layer = make_linear(256, 256, bias=False)
    qlayer, _ = quantize_one(layer)
    sd = qlayer.state_dict()
    assert sd["weight"].dtype == torch.int8 and sd["weight_scale"].dtype == torch.float32
    assert sum(t.numel() * t.element_size() for t in sd.values()) == 256 * 256 + 256 * 4
    qlayer.to(torch.device("meta"))
    assert qlayer.weight.device.type == "meta"


def test_dequantize_roundtrip():
    layer = make_linear(512, 128, bias=False)
    qlayer, _ = quantize_one(layer, 64)
    w = qlayer.method.dequantize(qlayer)
    assert w.shape == layer.weight.shape
    assert rel_err(w, layer.weight) < 0.01


def test_bad_options():
    with pytest.raises(ValueError, match="group_size"):
        Int8ConvRotMethod(128)
    with pytest.raises(ValueError, match="row_split"):
        Int8ConvRotMethod(256, row_split="sometimes")


def test_kitchen_weights_of_upstream_are_already_quantized():
    """Upstream ComfyUI loads marker files as its own layers with a QuantizedTensor weight: kept, counted packed."""
    from comfy_kitchen.tensor import QuantizedTensor
    from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout
    model = Tiny()
    qdata, params = TensorWiseINT8Layout.quantize(model.proj.weight.detach(), is_weight=True, per_channel=True,
                                                  convrot=True, convrot_groupsize=256, stochastic_rounding=0)
    model.proj.weight = nn.Parameter(QuantizedTensor(qdata, "TensorWiseINT8Layout", params), requires_grad=False)
    replacements, report = quantize_layers(model, QuantConfig(method=Int8ConvRotMethod(256)))
    assert "proj" not in replacements and report.summary_line() == "quantized 0/3 linear layers"
    assert [(r.name, r.format, r.reason) for r in report.earlier] == [("proj", "int8_convrot", "already quantized")]
    assert report.earlier[0].bytes_after == 256 * 512 + params.scale.nbytes + 512 * 2  # packed, not 256 * 512 * 2


@pytest.mark.parametrize("method_name", ["int8_convrot", "float8_e4m3fn"])
def test_weight_patch_protocol_applies_lora(method_name):
    """What ComfyUI's ModelPatcher does for a LoRA: convert_weight, add the delta, set_weight."""
    from bigdit.quant import get_method
    layer = make_linear(256, 128)
    q, _ = quantize_one_with(layer, get_method(method_name))
    delta = 0.02 * torch.randn(128, 256)
    original_weight = q.weight.detach().clone()
    patched = q.convert_weight(q.weight.float(), inplace=True) + 10 * delta  # wider than the original rows
    q.set_weight(patched)
    x = torch.randn(9, 256, dtype=torch.bfloat16)
    ref = nn.functional.linear(x.float(), layer.weight.float() + 10 * delta, layer.bias.float())
    assert rel_err(q(x), ref) < 0.05
    # ComfyUI restores only `weight` on unpatch (as a new Parameter); the layer
    # must notice and take its original scales back.
    q.weight = nn.Parameter(original_weight, requires_grad=False)
    plain = nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
    assert rel_err(q(x), plain) < 0.05
    # An in-place restore could not be noticed, so in-place patching is refused.
    with pytest.raises(RuntimeError, match="in-place"):
        q.set_weight(patched, inplace_update=True)


@pytest.mark.parametrize("method_name", ["int8_convrot", "float8_e4m3fn"])
def test_restored_weight_is_read_with_its_own_scales(method_name):
    """Patch, restore `weight` only (as ComfyUI's unpatch does), patch again: the second patch starts from the
    original weight, and the layer holds no extra parameter (its size is what ComfyUI counts)."""
    from bigdit.quant import get_method
    layer = make_linear(256, 128)
    q, _ = quantize_one_with(layer, get_method(method_name))
    names = list(q.state_dict())  # what ComfyUI's module_size counts
    original_weight, original = q.weight, q.method.dequantize(q).float()
    delta = 0.5 * torch.randn(128, 256)
    q.set_weight(q.convert_weight(q.weight.float()) + delta)
    assert list(q.state_dict()) == names
    q.weight = original_weight  # ComfyUI's restore, the scales untouched
    assert torch.equal(q.convert_weight(q.weight.float()), original)
    q.set_weight(q.convert_weight(q.weight.float()) + delta)
    assert rel_err(q.method.dequantize(q), layer.weight.float() + delta) < 0.05


@pytest.mark.parametrize("method_name", ["int8_convrot", "float8_e4m3fn"])
def test_patched_layer_computes_without_per_call_work_and_restores_bit_exactly(method_name, monkeypatch):
    """A LoRA folded in once (what host/lora_fold.py has ComfyUI do for an offloaded layer): forwards run the
    method's own kernel on the patched tensors, with no dequantize or requantize per call; convert_weight still
    gives the unpatched weight (the base ComfyUI patches from, were it to patch the layer again); ComfyUI's
    restore of `weight` brings back every original tensor, bit for bit."""
    from bigdit.quant import get_method
    layer = make_linear(256, 128)
    q, _ = quantize_one_with(layer, get_method(method_name))
    original = {k: (v, v.detach().clone()) for k, v in q.named_parameters()}
    unpatched_weight = q.method.dequantize(q).float()
    delta = 0.3 * torch.randn(128, 256)
    q.set_weight(q.convert_weight(q.weight.float()) + delta)
    assert torch.equal(q.convert_weight(q.weight.float()), unpatched_weight)
    with pytest.raises(RuntimeError, match="weight patch"):
        q.stored_tensors()

    work = []
    for name in ("dequantize", "quantize_weight"):
        real = getattr(q.method, name)
        monkeypatch.setattr(q.method, name, lambda *a, real=real, name=name, **k: work.append(name) or real(*a, **k))
    x = torch.randn(9, 256, dtype=torch.bfloat16)
    outs = [q(x) for _ in range(3)]
    assert work == [] and all(torch.equal(o, outs[0]) for o in outs)
    ref = nn.functional.linear(x.float(), layer.weight.float() + delta, layer.bias.float())
    assert rel_err(outs[0], ref) < 0.05
    monkeypatch.undo()

    q.weight = nn.Parameter(original["weight"][0], requires_grad=False)  # ComfyUI's set_attr_param restore
    for key, (param, saved) in original.items():
        now = getattr(q, key)
        assert now.dtype == saved.dtype and torch.equal(now.view(torch.uint8), saved.view(torch.uint8)), key
        if key != "weight":
            assert now is param  # the very tensors, not copies
    assert set(q.stored_tensors()) == set(original) - {"bias"}  # nothing patched is left (it would raise)


def test_a_patch_written_in_is_not_converted():
    """requantized_layer converts a layer without the patch written into it (a LoRA its host applies to the new
    layer itself): from the tensors the patch replaced, bit for bit as before the patch; where the layer does not
    hold its unpatched weight (the host's backup does), it refuses."""
    from bigdit.quant import get_method
    from bigdit.quant.linear import requantized_layer
    cpu, fp8 = torch.device("cpu"), get_method("float8_e4m3fn")
    q, _ = quantize_one_with(make_linear(256, 128), get_method("int8_convrot"))
    before = requantized_layer(q, fp8, cpu, cpu).stored_tensors()
    q.write_patched(q.dequantized(dtype=torch.float32) + 0.3 * torch.randn(128, 256))
    after = requantized_layer(q, fp8, cpu, cpu).stored_tensors()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    q.restore_unpatched()
    q.write_patched(q.dequantized(dtype=torch.float32) * 2, keep_weight=False)
    with pytest.raises(RuntimeError, match="a weight patch"):
        requantized_layer(q, fp8, cpu, cpu)


@pytest.mark.parametrize("method_name", ["int8_convrot", "float8_e4m3fn"])
def test_patch_quantized_once_is_written_back_without_quantizing(method_name, monkeypatch):
    """A patch quantized once (QuantLinear.quantized_patch, what host/lora_fold.py keeps per LoRA) is written in,
    taken out and written in again without quantizing anything: the very tensors each time, the originals back
    bit for bit; its error is the relative L2 of its dequantized weight against the patched weight."""
    from bigdit.quant import get_method
    layer = make_linear(256, 128)
    q, _ = quantize_one_with(layer, get_method(method_name))
    original = {k: (v, v.detach().clone()) for k, v in q.named_parameters()}
    unpatched = q.dequantized(dtype=torch.float32)
    patched = unpatched + 0.3 * torch.randn(128, 256)
    fresh, error = q.quantized_patch(patched)
    assert all(torch.equal(v, original[k][1]) for k, v in q.named_parameters())  # nothing written yet
    stand_in = QuantLinear(q.method, 256, 128, {**q.stored_tensors(), **fresh}, None, q.compute_dtype)
    assert error == pytest.approx(rel_err(q.method.dequantize(stand_in), patched), rel=1e-5)
    assert 0 < error < (0.012 if method_name == "int8_convrot" else 0.04)  # measured 0.0081 and 0.026

    kept = {k: nn.Parameter(v, requires_grad=False) for k, v in fresh.items()}
    work = []
    real = q.method.quantize_weight
    monkeypatch.setattr(q.method, "quantize_weight", lambda *a, **k: work.append(1) or real(*a, **k))
    for _ in range(2):
        q.write_patched_tensors(kept, error=error)
        assert all(q._parameters[k] is v for k, v in kept.items()) and q.patch_error == error
        assert torch.equal(q.dequantized(dtype=torch.float32), q.method.dequantize(stand_in).float())
        assert torch.equal(q.dequantized(dtype=torch.float32, unpatched=True), unpatched)
        q.restore_unpatched()
        assert q.patch_error is None and q._unpatched is None
        for key, (param, saved) in original.items():
            assert q._parameters[key] is param and torch.equal(param.view(torch.uint8), saved.view(torch.uint8))
    assert work == []


@pytest.mark.parametrize("method_name", ["int8_convrot", "float8_e4m3fn"])
def test_set_weight_can_return_instead_of_storing(method_name):
    """return_weight (0.3.75's partial loading calls set_weight so): the weight the layer would compute with."""
    from bigdit.quant import get_method
    layer = make_linear(256, 128)
    q, _ = quantize_one_with(layer, get_method(method_name))
    stored = {k: v.detach().clone() for k, v in q.named_parameters()}
    patched = layer.weight.float() + 0.2 * torch.randn(128, 256)
    returned = q.set_weight(patched, seed=0, return_weight=True)
    assert all(torch.equal(stored[k], v) for k, v in q.named_parameters())  # nothing stored
    assert returned.dtype == torch.float32 and rel_err(returned, patched) < 0.05
    q.set_weight(patched)
    assert torch.equal(returned, q.method.dequantize(q).float())  # what set_weight stores, exactly


@pytest.mark.parametrize("method_name", ["int8_convrot", "float8_e4m3fn"])
def test_dynamic_vram_lora_applies(method_name):
    """Upstream's dynamic VRAM attaches a LoRA as weight_lowvram_function, beside weight_function."""
    from bigdit.quant import get_method
    layer = make_linear(256, 128)
    q, _ = quantize_one_with(layer, get_method(method_name))
    delta = 0.05 * torch.randn(128, 256)
    q.weight_lowvram_function = lambda w: w + delta.to(w.dtype)
    q.weight_function = [lambda w: 2 * w]
    x = torch.randn(5, 256)
    ref = nn.functional.linear(x, 2 * (q.method.dequantize(q).float() + delta), layer.bias.float())
    assert rel_err(q(x), ref) < 1e-5
    q.weight_lowvram_function, q.weight_function = None, []
    assert rel_err(q(x), nn.functional.linear(x, layer.weight.float(), layer.bias.float())) < 0.05


@pytest.mark.parametrize("method_name", ["int8_convrot", "float8_e4m3fn"])
def test_convert_weight_of_the_stored_tensor_gives_a_float(method_name):
    """Upstream's dynamic VRAM force-loads small layers through convert_weight on a copy of the stored
    tensor (int8, fp8): the dequantized weight must come back as a float, not in the storage dtype."""
    from bigdit.quant import get_method
    layer = make_linear(256, 128)
    q, _ = quantize_one_with(layer, get_method(method_name))
    assert not q.weight.dtype.is_floating_point or q.weight.element_size() == 1
    converted = q.convert_weight(q.weight.detach().clone(), inplace=True)
    assert converted.dtype == q.compute_dtype
    assert torch.equal(converted, q.method.dequantize(q).to(q.compute_dtype))


def test_per_call_weight_functions_apply_on_dequantized_weight():
    layer = make_linear(256, 128)
    q, _ = quantize_one(layer)
    q.weight_function = [lambda w: w * 0]
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    assert torch.allclose(q(x).float(), layer.bias.float().expand(3, -1), atol=1e-2)


def quantize_one_with(layer, method):
    replacements, report = quantize_layers(nn.Sequential(layer), QuantConfig(method=method),
                                           layer_type=ComfyQuantLinear)
    return replacements["0"], report


def test_progress_reports_every_layer_in_order():
    model = nn.Sequential(*[make_linear(256, 256) for _ in range(3)], nn.Linear(100, 256).to(torch.bfloat16))
    seen = []
    quantize_layers(model, QuantConfig(method=Int8ConvRotMethod(256)),
                    progress=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 3), (2, 3), (3, 3)]  # the indivisible layer is not quantized, so not counted


class ModuleLinear(nn.Module):
    """Upstream's mixed-precision Linear: a Module, no nn.Linear, with a Linear's attributes."""

    def __init__(self, weight, bias):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight, self.bias = nn.Parameter(weight, requires_grad=False), nn.Parameter(bias, requires_grad=False)


class Fp8Layers(nn.Module):
    """An FP8 layer of each kind QuantizeModelINT8 meets, and one bf16 Linear."""

    def __init__(self):
        super().__init__()
        from comfy_kitchen.tensor import QuantizedTensor
        from comfy_kitchen.tensor.fp8 import TensorCoreFP8Layout
        from bigdit.quant import get_method
        self.reference = {}
        for name in ("plain", "scaled", "kitchen", "pack", "bf16"):
            layer = make_linear(256, 128, seed=len(self.reference))
            self.reference[name] = layer.weight.detach().float().clone()
            scale = self.reference[name].abs().amax() / 448
            if name == "plain":     # UNETLoader weight_dtype fp8_e4m3fn: a cast, unit scale
                layer = layer.to(torch.float8_e4m3fn)
            elif name == "scaled":  # ComfyUI 0.3.75's scaled_fp8 Linear
                layer.weight = nn.Parameter((layer.weight.float() / scale).to(torch.float8_e4m3fn), requires_grad=False)
                layer.scale_weight = nn.Parameter(scale, requires_grad=False)
            elif name == "kitchen":  # upstream's FP8 marker layer
                qdata, params = TensorCoreFP8Layout.quantize(layer.weight.detach().float())
                layer = ModuleLinear(QuantizedTensor(qdata, "TensorCoreFP8Layout", params), layer.bias.detach())
            elif name == "pack":    # the pack's loaders
                method = get_method("float8_e4m3fn")
                layer = QuantLinear(method, 256, 128, method.quantize_weight(layer.weight.detach().float()),
                                    layer.bias.detach(), torch.bfloat16)
            self.add_module(name, layer)


def requantize_fp8(on: bool) -> dict:
    """QuantizeModelINT8's requantize_fp8 switch as the config's conversion of FP8 layers."""
    return stored_conversions((("requantize_fp8", "requantize" if on else "keep"),))


@pytest.mark.parametrize("requantize", [False, True])
def test_fp8_layers_kept_or_requantized(requantize):
    model = Fp8Layers()
    replacements, report = quantize_layers(model, QuantConfig(method=Int8ConvRotMethod(256),
                                                              conversions=requantize_fp8(requantize)),
                                           weight_scale=fp8_weight_scale)
    lines = report.render().splitlines()
    if not requantize:
        assert set(replacements) == {"bf16"}
        assert "kept 4 fp8 layers as they were (requantize_fp8 is off)" in lines
        assert not any(line.startswith("re-quantized") for line in lines)
        return
    assert set(replacements) == {"plain", "scaled", "kitchen", "pack", "bf16"}
    assert report.summary_line() == "quantized 5/5 linear layers"
    assert "re-quantized 4 fp8 layers to int8_convrot" in lines and not any("kept" in line for line in lines)
    x = torch.randn(3, 256)
    for name, layer in replacements.items():
        assert layer.method.name == "int8_convrot" and layer.compute_dtype == torch.bfloat16
        reference = x @ model.reference[name].t()
        if name == "plain":     # the cast weight is the reference of what the model ran
            reference = x @ model.plain.weight.float().t()
        bias = model.get_submodule(name).bias.float()
        # INT8's rounding on top of FP8's, against the weights before FP8 (measured 0.0097 to 0.029)
        assert rel_err(layer(x) - bias, reference) < 0.05, (name, rel_err(layer(x) - bias, reference))


def test_ignored_fp8_layers_stay_fp8_under_requantize():
    model = Fp8Layers()
    replacements, report = quantize_layers(model, QuantConfig(method=Int8ConvRotMethod(256),
                                                              conversions=requantize_fp8(True), ignored=("scaled",)),
                                           weight_scale=fp8_weight_scale)
    assert "scaled" not in replacements
    assert "re-quantized 3 fp8 layers to int8_convrot" in report.render()
    assert "kept 1 fp8 layers as they were" in report.render().splitlines()
    assert [(r.name, r.format) for r in report.earlier] == [("scaled", "float8_e4m3fn")]
