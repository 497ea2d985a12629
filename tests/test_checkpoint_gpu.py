"""Checkpoint layers on CUDA: every serialized format built on the GPU, against the fp32 reference,
and NVFP4's execution path for this GPU (native on sm100+, else re-quantized or dequantized)."""
import contextlib

import pytest
import torch

from test_checkpoint_loaders import (EXPECTED_METHOD, FOUR_BIT_LAYERS, KITCHEN_4BIT, LINEARS, MIXED, TOLERANCE,
                                     TOLERANCE_4BIT, build, layer_input, plain_state_dict, reference_output, rel_err)
from checkpoint_files import save, write_kitchen, write_markers, write_nvfp4_awq, write_quanto
from bigdit.loaders import LayerBuilder, inspect_checkpoint
from bigdit.quant import witness

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def plain_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt_gpu") / "wan_bf16.safetensors"
    save(plain_state_dict(), path)
    return path


def capability():
    return torch.cuda.get_device_capability()


@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, torch.float32])
def test_mixed_markers_on_cuda(plain_file, tmp_path, compute_dtype):
    path = write_markers(plain_file, tmp_path / "mixed.safetensors", MIXED)
    model, report, _ = build(path, compute_dtype=compute_dtype, device="cuda")
    native = capability() >= (10, 0)
    for name, expected in EXPECTED_METHOD.items():
        layer = model.get_submodule(name)
        assert layer.method.name == expected and layer.weight.is_cuda, name
        x = layer_input(name).to("cuda", compute_dtype)
        out = layer(x)
        assert out.is_cuda and out.dtype == compute_dtype
        # bf16 activations add about 0.4% to each format's error; NVFP4/MXFP8 natively quantize them too.
        tolerance = TOLERANCE[expected] + (0.01 if compute_dtype == torch.bfloat16 else 0)
        if native and expected in ("nvfp4", "mxfp8"):
            tolerance *= 1.5
        assert rel_err(out, reference_output(name, x.float().cpu()).cuda()) < tolerance, name
    path_word = "native comfy-kitchen GEMM" if native else "dequantized before each matmul"
    assert f"nvfp4 layers on cuda sm{''.join(map(str, capability()))}: {path_word} x1" in report.render()


@pytest.mark.parametrize("fmt", list(KITCHEN_4BIT))
def test_kitchen_4bit_files_on_cuda(plain_file, tmp_path, fmt):
    """kitchen's CUDA kernels (int4 tensor cores on sm75-sm89, INT8 GEMMs elsewhere) run the layer as F.linear on
    kitchen's own QuantizedTensor does: bit for bit, and near the bf16 layer. W4A8 from sm80: kitchen's decode, then
    the pack's INT8 kernels (quant/w4a8_int8.py), no further from the reference than 1.1x kitchen's own linear."""
    path, written = write_kitchen(plain_file, tmp_path / f"{fmt}.safetensors",
                                  dict.fromkeys(FOUR_BIT_LAYERS, KITCHEN_4BIT[fmt]))
    model, _, _ = build(path, compute_dtype=torch.bfloat16, device="cuda")
    bias = plain_state_dict()
    for name in FOUR_BIT_LAYERS:
        layer = model.get_submodule(name)
        assert layer.method.name == fmt and layer.weight.is_cuda, name
        x = layer_input(name).to("cuda", torch.bfloat16)
        out = layer(x)
        # kitchen's CUDA W4A8 kernel takes ConvRot group 256 only: the layer (group 64) runs its eager backend
        backend = layer.method.kitchen_backend(x.device)
        import comfy_kitchen  # here, not at import: collecting this module must not import kitchen
        assert backend == ("eager" if fmt == "asym_w4a8_int8" else None), name
        with comfy_kitchen.use_backend(backend) if backend else contextlib.nullcontext():
            host = torch.nn.functional.linear(x, written[name].to("cuda"), bias[f"{name}.bias"].cuda())
        reference = reference_output(name, x.cpu()).cuda()
        if fmt == "asym_w4a8_int8" and capability() >= (8, 0):
            before = dict(witness.TALLY.calls)
            layer(x)
            ran = {k: v - before.get(k, 0) for k, v in witness.TALLY.calls.items() if v != before.get(k, 0)}
            assert ran == {("int8", "triton"): 1, ("w4a8", "decoded to int8"): 1}, (name, ran)
            assert rel_err(out, reference) <= 1.1 * rel_err(host, reference), (name, rel_err(out, host))
        else:
            assert torch.equal(out, host), (name, rel_err(out, host))
        assert rel_err(out, reference) < TOLERANCE_4BIT[fmt] + 0.02, name


def test_nvfp4_awq_on_cuda(plain_file, tmp_path):
    names = ["blocks.0.ffn.0", "blocks.0.ffn.2"]
    write_nvfp4_awq(plain_file, tmp_path / "awq.safetensors", names)
    model, _, _ = build(tmp_path / "awq.safetensors", compute_dtype=torch.bfloat16, device="cuda")
    for name in names:
        x = layer_input(name).to("cuda", torch.bfloat16)
        # NVFP4 (native activations on sm100+ add E2M1 rounding of the smoothed input) plus bf16
        tolerance = TOLERANCE["nvfp4"] + (0.1 if capability() >= (10, 0) else 0.01)
        assert rel_err(model.get_submodule(name)(x), reference_output(name, x.cpu()).cuda()) < tolerance, name


def test_quanto_on_cuda(plain_file, tmp_path):
    path = write_quanto(plain_file, tmp_path / "quanto.safetensors", ["blocks.0.ffn.0"])
    model, _, _ = build(path, compute_dtype=torch.bfloat16, device="cuda")
    x = layer_input("blocks.0.ffn.0").to("cuda", torch.bfloat16)
    out = model.get_submodule("blocks.0.ffn.0")(x)
    assert rel_err(out, reference_output("blocks.0.ffn.0", x.float().cpu()).cuda()) < TOLERANCE["quanto_qint8"] + 0.01


def test_nvfp4_requantized_for_this_gpu(plain_file, tmp_path):
    path = write_markers(plain_file, tmp_path / "nvfp4.safetensors", {"blocks.0.ffn.2": {"format": "nvfp4"}})
    model, report, _ = build(path, compute_dtype=torch.bfloat16, device="cuda", conversions={"nvfp4": "requantize"})
    layer = model.get_submodule("blocks.0.ffn.2")
    if capability() >= (10, 0):
        expected = "nvfp4"            # native NVFP4 is already the fastest
    elif capability() >= (8, 9):
        expected = "float8_e4m3fn"
    else:
        expected = "int8_convrot"
    assert layer.method.name == expected, report.render()
    x = layer_input("blocks.0.ffn.2").to("cuda", torch.bfloat16)
    bound = TOLERANCE["nvfp4"] + TOLERANCE.get(expected, 0) + 0.01
    assert rel_err(layer(x), reference_output("blocks.0.ffn.2", x.float().cpu()).cuda()) < bound


def test_every_shape_of_the_model_runs(plain_file, tmp_path):
    """All Linear shapes of the model in one format each, as a load would see them."""
    for fmt in ("nvfp4", "mxfp8", "float8_e4m3fn"):
        path = write_markers(plain_file, tmp_path / f"{fmt}.safetensors", {n: {"format": fmt} for n in LINEARS})
        model, _, _ = build(path, compute_dtype=torch.bfloat16, device="cuda")
        for name in LINEARS:
            x = layer_input(name).to("cuda", torch.bfloat16)
            out = model.get_submodule(name)(x)
            bound = TOLERANCE[fmt] * 1.5 + 0.01
            assert rel_err(out, reference_output(name, x.float().cpu()).cuda()) < bound, (fmt, name)


def test_pinned_staging_copies_each_weight_exactly():
    from bigdit.loaders.staging import SMALL_BYTES, PinnedStaging
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randn(1024, 1024, generator=gen).to(torch.bfloat16),  # 2 MiB: the buffer's size
               torch.randn(1024, 768, generator=gen).to(torch.float16),
               torch.randn(256, 1024, generator=gen).t(),       # fp32, not contiguous
               torch.randn(1024, 1024, generator=gen),          # fp32, 4 MiB: over the buffer, moved as it is
               torch.randn(64, 64, generator=gen)]              # under SMALL_BYTES, moved as it is
    staging = PinnedStaging(torch.device("cuda"), largest_bytes=1024 * 1024 * 2)
    moved = [staging.to_device(t) for t in sources]  # one buffer, reused: earlier copies must not change
    back = [staging.to_host(t * 2) for t in moved]   # the way back, after GPU work on each
    torch.cuda.synchronize()
    for source, out, host in zip(sources, moved, back):
        assert out.is_cuda and out.dtype == source.dtype and out.shape == source.shape
        assert torch.equal(out.cpu(), source)
        assert host.device.type == "cpu" and not host.is_pinned() and torch.equal(host, source * 2)
    assert SMALL_BYTES > 64 * 64 * 4
    assert staging.staged_bytes == staging.host_bytes == sum(t.numel() * t.element_size() for t in sources[:3])
    staging.close()


def test_online_quantization_stages_through_pinned_memory_bit_exactly(tmp_path):
    """The loader's weights go to the GPU and back to RAM through the pinned buffer: each layer's tensors
    equal those quantized from the same weight moved directly."""
    import safetensors.torch
    from bigdit.quant import QuantConfig, get_method
    from bigdit.quant.linear import quantized_layer
    gen = torch.Generator().manual_seed(1)
    shapes = {"blocks.0.ffn.0": (2048, 1024), "blocks.0.ffn.2": (1024, 2048), "blocks.0.q": (256, 256)}
    sd = {f"{name}.weight": (torch.randn(shape, generator=gen) / shape[1] ** 0.5).to(torch.bfloat16)
          for name, shape in shapes.items()}
    path = tmp_path / "wide.safetensors"
    safetensors.torch.save_file(sd, str(path))
    method = get_method("int8_convrot", group_size=64)
    contents = inspect_checkpoint(path)
    with contents.open() as source:
        builder = LayerBuilder(contents, source, torch.device("cuda"), online=QuantConfig(method=method))
        tensors = contents.state_dict(source)
        built = {name: builder.build(name, tensors[f"{name}.weight"], n_in, n_out, None, torch.bfloat16,
                                     torch.device("cpu")) for name, (n_out, n_in) in shapes.items()}
        report = builder.finish()
    text = report.render()
    assert "reading 0.01 GiB of weights into pinned memory" in text and "moving 0.00 GiB back to RAM" in text, text
    assert builder.staging.staged_bytes == 2 * 2048 * 1024 * 2  # the small layer went the plain way
    for name, (n_out, n_in) in shapes.items():
        direct = quantized_layer(method, sd[f"{name}.weight"].to("cuda"), n_in, n_out, None, torch.bfloat16,
                                 torch.device("cuda"), torch.device("cpu"))
        for key, tensor in direct.named_parameters():
            got = getattr(built[name], key)
            assert got.device.type == "cpu" and torch.equal(got, tensor), (name, key)


def test_int8_auto_on_this_gpu(plain_file, tmp_path, monkeypatch):
    """`int8` auto on CUDA: with no kept measurement every INT8 layer stays INT8, nothing timed; with
    BIGDIT_INT8_TUNE=1 each is measured against this GPU's fastest native format (FP8 on sm89+) and the numbers
    kept in the tuning store, which the next load follows without timing; a converted layer stays within INT8's
    error plus the target's of the reference."""
    from bigdit.quant import auto, tuning
    monkeypatch.setattr(tuning, "_current", tuning.current())
    store = str(tmp_path / tuning.FILE_NAME)
    tuning.use(store)
    path = write_markers(plain_file, tmp_path / "int8.safetensors",
                         {"blocks.0.ffn.2": {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}})

    def load():
        model, report, _ = build(path, compute_dtype=torch.bfloat16, device="cuda",
                                 conversions={"int8_tensorwise": "auto"})
        (record,) = [r for r in report.records if r.name == "blocks.0.ffn.2"]
        return model.get_submodule("blocks.0.ffn.2"), record

    layer, record = load()
    assert layer.method.name == "int8_convrot" and record.action == "load", record.reason
    if capability() < (8, 9):  # INT8 is this GPU's fastest native format: nothing to measure
        assert record.path == "kept as INT8: no faster native format on this device", record.path
        return
    assert record.path == "kept as INT8: no stored measurement says float8_e4m3fn pays on this GPU", record.path
    monkeypatch.setenv(tuning.TUNE_ENV, "1")
    layer, record = load()
    assert " ms a call, error " in record.reason, record.reason  # both timings and the error, whichever won
    assert layer.method.name == ("float8_e4m3fn" if record.action == "convert" else "int8_convrot"), record.reason
    monkeypatch.delenv(tuning.TUNE_ENV)
    monkeypatch.setattr(auto, "_measure_conversion", lambda *args: pytest.fail("measured again"))
    tuning.use(store)  # as the next load reads it
    again, kept = load()
    assert (kept.action, kept.path, again.method.name) == (record.action, record.path, layer.method.name)
    x = layer_input("blocks.0.ffn.2").to("cuda", torch.bfloat16)
    err = rel_err(layer(x), reference_output("blocks.0.ffn.2", x.float().cpu()).cuda())
    assert err < TOLERANCE["int8_convrot"] + TOLERANCE["float8_e4m3fn"], err
