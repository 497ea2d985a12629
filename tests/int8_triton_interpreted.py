"""int8_triton's kernels in Triton's interpreter, on CPU tensors; run by tests/test_int8_triton.py.

    TRITON_INTERPRET=1 python tests/int8_triton_interpreted.py CHECK

The interpreter is chosen when a kernel is defined, so it must be on before Triton is imported: hence a
process of its own. Each CHECK asserts against a reference and prints "ok CHECK". Float16 activations
where SwiGLU is folded in: the interpreter truncates fp32 to bfloat16 where a GPU rounds to nearest, and
rounds float16 as the GPU does (the GPU tests cover bfloat16 SwiGLU).
"""
import importlib
import sys
import types
from pathlib import Path

import torch

PACK_ROOT = Path(__file__).resolve().parent.parent
_pkg = types.ModuleType("bigdit")
_pkg.__path__ = [str(PACK_ROOT)]
sys.modules["bigdit"] = _pkg

import comfy_kitchen as ck  # noqa: E402
from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout  # noqa: E402

from bigdit.quant import compiled_ops, int8_triton as it  # noqa: E402
from bigdit.quant.kitchen_api import apply_input_act, hadamard  # noqa: E402


def activations(rows, k, dtype, swiglu, seed=0):
    """Random activations with an all-zero row, an outlier and a row of tiny values; rows strided wider."""
    torch.manual_seed(seed)
    width = 2 * k if swiglu else k
    x = (torch.randn(rows, width + 32) * 2).to(dtype)[:, :width]
    x[1] = 0
    x[2, 5] = 300.0
    x[3] *= 1e-4
    return x


def reference_rows(x, convrot, group, input_act):
    """The kernels' definition in float64 then float32: activation (kitchen's, in x's dtype), exact rotation,
    scale = max(absmax / 127, 1e-30) in fp32, q = round-half-even(clamp(v * (1 / scale)))."""
    v = apply_input_act(x, input_act).double()
    if convrot:
        v = (v.reshape(v.shape[0], -1, group) @ hadamard(group, "cpu").double()).reshape(v.shape)
    v = v.float()
    scale = (v.abs().amax(1, keepdim=True) / 127.0).clamp(min=1e-30)
    exact = v.double() * (1 / scale.double())
    return exact, torch.round((v * torch.reciprocal(scale)).clamp(-128, 127)).to(torch.int8), scale


def check_rows(q, scale, x, convrot, group, input_act, label):
    exact, ref_q, ref_scale = reference_rows(x, convrot, group, input_act)
    # the scale is one fp32 division of the row's largest value, which the kernel sums in another order
    assert torch.allclose(scale, ref_scale, rtol=1e-6, atol=0), (label, (scale / ref_scale - 1).abs().max())
    diff = (q.int() - ref_q.int()).abs()
    # a code may differ by one only where the exact value sits on a rounding tie (fp32's sum order decides)
    near_tie = ((exact.abs() % 1) - 0.5).abs() < 1e-4
    assert diff.max() <= 1 and not (diff.bool() & ~near_tie).any(), (label, diff.max(), (diff.bool() & ~near_tie).sum())
    assert (q[1] == 0).all() and scale[1].item() == torch.tensor(1e-30).item(), label  # all-zero row: minimum scale


def activation():
    """Both kernel structures (the row whole, or two passes of narrower steps), each group size, SwiGLU."""
    kernel = it._rotate_quantize_kernel
    cases = [(256, None, torch.bfloat16), (256, "swiglu", torch.float16), (64, None, torch.float16),
             (64, "swiglu", torch.float16), (16, None, torch.bfloat16), (16, "swiglu", torch.float16)]
    for group, act, dtype in cases:
        k = 1024
        x = activations(11, k, dtype, act == "swiglu")
        h = it.hadamard(group, x.device)
        hg = it.KRON if group == it.KRON * it.KRON else group
        for rows, width in ((2, k), (4, 512), (16, 256)):  # 11 rows: the last program is partly past the end
            if rows * width // group < 16 and hg == group:
                continue  # (a full-matrix product needs 16 groups a tile; the autotuner prunes such configs)
            q = torch.full((11, k), 99, dtype=torch.int8)
            scale = torch.empty(11, 1)
            kernel[(triton_cdiv(11, rows),)](x, h, q, scale, 11, x.stride(0), q.stride(0), K=k, G=group, HG=hg,
                                             SWIGLU=act == "swiglu", ROTATE=True, ROWS=rows, WIDTH=width, W1=0, W2=0)
            check_rows(q, scale, x, True, group, act, (group, act, dtype, rows, width))
    # as int8_linear launches it (the rule's config on CPU), and without the rotation (plain int8_tensorwise)
    for convrot in (True, False):
        x = activations(7, 768, torch.bfloat16, False)
        q, scale = it.quantize_rows(x, convrot, 256, None)
        check_rows(q, scale, x, convrot, 256, None, ("quantize_rows", convrot))


def activation_pieces():
    """A row whose width is no power of two, held whole in the power-of-two pieces that add up to it (config WIDTH
    = K), as quantize_rows launches it: each group size, two and three pieces, SwiGLU; the same rows and scales as
    the row in one padded tile (bit for bit), both against the definition."""
    chosen = it.config_for
    cases = [(256, 1792, None, torch.bfloat16, 1), (256, 1280, "swiglu", torch.float16, 2),
             (64, 1344, None, torch.float16, 16), (16, 112, "swiglu", torch.float16, 16)]
    try:
        for group, k, act, dtype, rows in cases:
            pieces = it.row_pieces(k, group)
            assert sum(pieces) == k and len(pieces) in (2, 3), (k, pieces)
            x = activations(rows + 5, k, dtype, act == "swiglu")  # the last program partly past the end
            out = {}
            for width in (k, it.next_pow2(k)):
                config = {"ROWS": rows, "WIDTH": width, "num_warps": 4, "num_stages": 3}
                assert it.fits("activation", config, {"K": k, "G": group, "ROTATE": True}), config
                it.config_for = lambda *_args, config=config, **_kw: config
                out[width] = it.quantize_rows(x, True, group, act)
                check_rows(*out[width], x, True, group, act, (group, k, act, config))
            assert all(torch.equal(a, b) for a, b in zip(out[k], out[it.next_pow2(k)])), (group, k)
    finally:
        it.config_for = chosen
    # no more than three pieces, whole groups only, and a width of K alone
    assert it.row_pieces(256 * 15, 256) == () and it.row_pieces(1000, 256) == ()
    assert not it.fits("activation", {"ROWS": 1, "WIDTH": 1280, "num_warps": 4, "num_stages": 3},
                       {"K": 1792, "G": 256, "ROTATE": True})


def triton_cdiv(a, b):
    return -(-a // b)


def gemm_int32():
    """The int32 accumulation equals the integer product exactly (unit scales, fp32 output holds it exactly),
    through both kernels, with rows and columns ending mid-tile."""
    torch.manual_seed(1)
    m, n, k = 37, 48, 512
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    a[0] = 127
    w[0] = -127  # the largest sums: 127 * 127 * 512 < 2^24, exact in fp32
    exact = a.long() @ w.long().T
    for tma in (False, True):
        out = it.gemm(a, torch.ones(m, 1), w, torch.ones(n, 1), None, torch.float32, tma=tma)
        assert torch.equal(out.long(), exact), tma


def gemm_epilogue():
    """Scales (per channel, per tensor), bias and output dtype against float64: one rounding to the output."""
    torch.manual_seed(2)
    m, n, k = 37, 48, 256
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    a_scale = torch.rand(m, 1) * 1e-2
    acc = (a.double() @ w.double().T)
    # relative to the terms' size: the bias may cancel the product; fp32's products, then one output rounding
    tolerance = {torch.float32: 2 ** -22, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}
    for per_channel in (True, False):
        w_scale = torch.rand(n, 1) * 1e-2 if per_channel else torch.tensor(3e-3)
        for bias in (None, torch.randn(n, dtype=torch.bfloat16)):
            ref = acc * (a_scale.double() * w_scale.double().reshape(1, -1))
            size = ref.abs()
            if bias is not None:
                ref = ref + bias.double()
                size = size + bias.double().abs()
            for dtype, tol in tolerance.items():
                for tma in (False, True):
                    out = it.gemm(a, a_scale, w, w_scale, bias, dtype, tma=tma)
                    assert out.dtype == dtype
                    rel = ((out.double() - ref).abs() / size).max().item()
                    assert rel <= tol, (per_channel, bias is not None, dtype, tma, rel)


def quantized_weight(n, k, convrot, group, per_channel, seed=3):
    torch.manual_seed(seed)
    weight = torch.randn(n, k) * k ** -0.5
    if convrot and not per_channel:  # kitchen quantizes a rotated weight per channel only: rotate, then per tensor
        weight = (weight.reshape(n, -1, group) @ hadamard(group, "cpu").T).reshape(n, k)
    qdata, params = TensorWiseINT8Layout.quantize(weight, is_weight=True, per_channel=per_channel,
                                                  convrot=convrot and per_channel, convrot_groupsize=group)
    return weight, qdata, params.scale.float()


def int8_linear_vs_kitchen():
    """The whole path against kitchen's eager int8_linear on the same weights: errors from the float reference
    no worse than 1.1x kitchen's, and the two outputs within INT8's error of each other."""
    cases = [(True, 256, True, None, torch.bfloat16, True), (True, 64, True, "swiglu", torch.float16, False),
             (True, 16, True, None, torch.float16, True), (True, 256, False, None, torch.bfloat16, False),
             (False, 256, True, None, torch.bfloat16, True), (False, 256, False, "swiglu", torch.float16, True)]
    for convrot, group, per_channel, act, dtype, with_bias in cases:
        n, k = 96, 512
        weight, qdata, w_scale = quantized_weight(n, k, convrot, group, per_channel)
        if convrot and not per_channel:
            weight = (weight.reshape(n, -1, group) @ hadamard(group, "cpu")).reshape(n, k)  # back to the original
        bias = torch.randn(n, dtype=dtype) * 0.1 if with_bias else None
        x = activations(37, k, dtype, act == "swiglu", seed=4)
        x[2, 5] = 30.0
        ref = torch.nn.functional.linear(apply_input_act(x, act).double(), weight.double(),
                                         None if bias is None else bias.double())
        ours = it.int8_linear(x, qdata, w_scale, bias, dtype, convrot, group, act)
        theirs = ck.int8_linear(x, qdata, w_scale, bias, dtype, convrot=convrot, convrot_groupsize=group,
                                input_act=act)
        assert ours.shape == theirs.shape and ours.dtype == dtype
        ours_err, theirs_err = rel(ours, ref), rel(theirs, ref)
        label = (convrot, group, per_channel, act, dtype, with_bias, ours_err, theirs_err)
        assert ours_err <= 1.1 * theirs_err and ours_err < 0.03, label
        assert rel(ours, theirs) < 0.03, label


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def unavailable():
    """What the kernels do not take is named, and linear_or_kitchen hands it to kitchen (no failure recorded)."""
    n, k = 96, 512
    _, qdata, w_scale = quantized_weight(n, k, True, 256, True)
    x = activations(5, k, torch.bfloat16, False)
    assert it.unavailable_reason(x, qdata, w_scale, None, torch.bfloat16, True, 256, None) is None
    reasons = {
        "input dtype": (x.float(), qdata, w_scale, None, torch.float32, True, 256, None),
        "input activation": (x, qdata, w_scale, None, torch.bfloat16, True, 256, "gelu_tanh"),
        "rotation group": (x, qdata, w_scale, None, torch.bfloat16, True, 1024, None),
        "16-byte": (x[:, :504], qdata[:, :504].contiguous(), w_scale, None, torch.bfloat16, False, 256, None),
        "weight scale": (x, qdata, w_scale[:5], None, torch.bfloat16, True, 256, None),
    }
    for words, args in reasons.items():
        reason = it.unavailable_reason(*args)
        assert reason is not None and words in reason, (words, reason)
    # a weight off 16-byte alignment (a view into a file) is computed by kitchen, per call
    storage = torch.empty(n * k + 8, dtype=torch.int8)
    shifted = storage[8:].view(n, k)
    shifted.copy_(qdata)
    out = it.linear_or_kitchen(x, shifted, w_scale, None, torch.bfloat16, True, 256, None,
                               kitchen=compiled_ops._kitchen_int8_linear)
    assert torch.equal(out, ck.int8_linear(x, qdata, w_scale, None, torch.bfloat16, convrot=True,
                                           convrot_groupsize=256, input_act=None))
    assert it._failure is None


def method_and_compile():
    """Int8ConvRotMethod runs the kernels when BIGDIT_INT8_KERNEL=triton (on CPU its measured default is
    kitchen), as one opaque op under torch.compile: no graph break, the eager numbers."""
    import os
    from torch import nn
    from bigdit.quant import QuantConfig, quantize_layers
    from bigdit.quant.int8_convrot import Int8ConvRotMethod
    torch.manual_seed(5)
    layer = nn.Linear(512, 96).to(torch.float16)
    qlayer = quantize_layers(nn.Sequential(layer), QuantConfig(method=Int8ConvRotMethod(64)))[0]["0"]
    x = torch.randn(3, 13, 1024, dtype=torch.float16)
    t = qlayer.tensors_for(x)
    direct = it.int8_linear(x, t["weight"], t["weight_scale"], t["bias"], torch.float16, True, 64, "swiglu")
    kitchen = ck.int8_linear(x, t["weight"], t["weight_scale"], t["bias"], torch.float16, convrot=True,
                             convrot_groupsize=64, input_act="swiglu")
    assert torch.equal(qlayer(x, input_act="swiglu"), kitchen)  # not forced: kitchen, the CPU default
    os.environ["BIGDIT_INT8_KERNEL"] = "triton"
    eager = qlayer(x, input_act="swiglu")
    assert torch.equal(eager, direct) and not torch.equal(eager, kitchen)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda v: qlayer(v, input_act="swiglu"))(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    compiled = torch.compile(lambda v: qlayer(v, input_act="swiglu"), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), eager)
    torch.library.opcheck(torch.ops.bigdit.int8_linear_triton.default,
                          (x, t["weight"], t["weight_scale"], t["bias"], torch.float16, True, 64, "swiglu"),
                          test_utils=("test_schema", "test_faketensor"))


def shipped_configs():
    """Every config the pack ships (quant/int8_triton_tuned.json), run as the kernels run it: each GEMM config at
    a shape crossing its tile edges in M, N and K (the int32 sums exactly; per-channel scales and a bias to one
    output rounding), each activation config at the shape it is shipped for (rows against the definition)."""
    version, families = it.SHIPPED
    assert version == it.KERNEL_VERSION and set(families) >= {"sm80", "sm86", "sm89", "sm90"}, (version, families)
    chosen = it.config_for
    ran = set()
    for kernels in families.values():
        for kernel, shapes in kernels.items():
            for text, config in shapes.items():
                shape = {key: int(value) for key, value in (part.split("=") for part in text.split(","))}
                assert it.fits(kernel, config, shape), (kernel, text, config)
                what = (kernel, tuple(sorted(config.items())),
                        *((shape["K"], shape["G"], shape["SWIGLU"]) if kernel == "activation" else ()))
                if what in ran:
                    continue
                ran.add(what)

                def shipped(name, _shape, _device, _launch=None, kernel=kernel, config=config):
                    assert name == kernel, (name, kernel)
                    return config
                it.config_for = shipped
                try:
                    if kernel == "activation":
                        shipped_activation(config, shape)
                    else:
                        shipped_gemm(config, kernel == "gemm_tma")
                finally:
                    it.config_for = chosen
    assert len(ran) >= 5, ran


def shipped_activation(config, shape):
    """As `check_rows`; with SwiGLU, whose exp differs from torch's by an ulp at times (a value of x's dtype then
    moves by one), codes within one apart from at most 1e-4 of them, scales to x's dtype's rounding."""
    swiglu = bool(shape["SWIGLU"])
    act = "swiglu" if swiglu else None
    x = activations(2 * config["ROWS"] + 3, shape["K"], torch.float16 if swiglu else torch.bfloat16, swiglu)
    q, scale = it.quantize_rows(x, bool(shape["ROTATE"]), shape["G"], act)
    if not swiglu:
        check_rows(q, scale, x, bool(shape["ROTATE"]), shape["G"], act, config)
        return
    exact, ref_q, ref_scale = reference_rows(x, bool(shape["ROTATE"]), shape["G"], act)
    assert torch.allclose(scale, ref_scale, rtol=2 ** -10, atol=0), (config, (scale / ref_scale - 1).abs().max())
    diff = (q.int() - ref_q.int()).abs()
    assert diff.max() <= 1 and diff.float().mean() < 1e-4, (config, diff.max(), diff.float().mean())


def shipped_gemm(config, tma):
    torch.manual_seed(6)
    m, n, k = config["BLOCK_M"] + 5, config["BLOCK_N"] + 16, 2 * config["BLOCK_K"] + 16
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    a[0], w[0] = 127, -127
    exact = a.long() @ w.long().T  # |sums| < 2^24: exact in fp32
    out = it.gemm(a, torch.ones(m, 1), w, torch.ones(n, 1), None, torch.float32, tma=tma)
    assert torch.equal(out.long(), exact), config
    a_scale, w_scale = torch.rand(m, 1) * 1e-2, torch.rand(n, 1) * 1e-2
    bias = torch.randn(n, dtype=torch.bfloat16)
    ref = exact.double() * (a_scale.double() * w_scale.double().reshape(1, -1)) + bias.double()
    size = (exact.double() * (a_scale.double() * w_scale.double().reshape(1, -1))).abs() + bias.double().abs()
    out = it.gemm(a, a_scale, w, w_scale, bias, torch.bfloat16, tma=tma)
    assert ((out.double() - ref).abs() / size).max().item() <= 2 ** -7, config


@it.triton.jit
def _count_to(out_ptr, n):
    total = 0.0
    for _ in range(0, n, 1):
        total += 1.0
    it.tl.store(out_ptr, total)


@it.triton.jit
def _calls_count_to(out_ptr, n):
    _count_to(out_ptr, n)


def runtime_loop_bounds() -> str | None:
    """Why this Triton's interpreter cannot run a loop bounded by a runtime argument (int8_lora's epilogue, in a jit
    function another one calls; the bench's persistent GEMM: Triton 3.6's interpreter hands a kernel a 1-element
    array where a scalar was passed, which a GPU's compiler never sees), or None where it can."""
    out = torch.zeros(1)
    try:
        _calls_count_to[(1,)](out, 3)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if out.item() == 3 else f"counted {out.item()} for 3"


def gemm_low_rank():
    """int8_lora's GEMM: the scaled INT8 product, plus alpha * h @ up^T accumulated in fp32 (ranks under one
    BLOCK_R step, a multiple of it and past one, masked; alpha 0: the product alone), plus the bias, against float64 with one rounding to the output dtype; both kernels.
    A block-diagonal up: its off-diagonal blocks unread where each tile lies in one block, all read where not.
    The operands in float16: the interpreter's dot reads bfloat16 operands as raw bits (the GPU test takes those)."""
    from bigdit.quant import int8_lora
    torch.manual_seed(4)
    m, n, k = 37, 48, 256
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    a_scale, w_scale = torch.rand(m, 1) * 1e-2, torch.rand(n, 1) * 1e-2
    bias = torch.randn(n, dtype=torch.bfloat16)
    product = (a.double() @ w.double().T) * (a_scale.double() * w_scale.double().reshape(1, -1))
    for rank in (5, 64, 130):
        for dtype in (torch.bfloat16, torch.float16):  # the output's
            h, up = torch.randn(m, rank).half(), (torch.randn(n, rank) * 0.1).half()
            low = 0.7 * (h.double() @ up.double().T)
            ref = product + low + bias.double()
            size = product.abs() + low.abs() + bias.double().abs()
            for tma in (False, True):
                out = int8_lora.gemm_low_rank(a, a_scale, w, w_scale, bias, h, up, 0.7, dtype, tma=tma)
                rel = ((out.double() - ref).abs() / size).max().item()
                assert out.dtype == dtype and rel <= (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10), (
                    rank, dtype, tma, rel)
                zero = int8_lora.gemm_low_rank(a, a_scale, w, w_scale, bias, h, up, 0.0, dtype, tma=tma)
                assert torch.equal(zero, it.gemm(a, a_scale, w, w_scale, bias, dtype, tma=tma)), (rank, dtype, tma)
    # a block-diagonal up (q, k and v's LoRAs side by side), the rule's tiles 128 columns wide: 3 blocks of 128
    # columns, each tile in one block, the off-diagonal blocks never read (garbage there, which a read would add); 6
    # blocks of 64, merged into 3 of 128 (garbage off those 3, zeros off the 6); 3 blocks of 16: tiles across
    # blocks, every rank read (a true block-diagonal up, zeros off it)
    def diagonal_of(n_out, blocks, rank):
        return torch.block_diag(*[torch.ones(n_out // blocks, rank // blocks)] * blocks).bool()

    for n_out, blocks, unread in ((384, 3, 3), (384, 6, 3), (48, 3, None)):
        w = torch.randint(-127, 128, (n_out, k), dtype=torch.int8)
        w_scale = torch.rand(n_out, 1) * 1e-2
        bias = torch.randn(n_out, dtype=torch.bfloat16)
        product = (a.double() @ w.double().T) * (a_scale.double() * w_scale.double().reshape(1, -1))
        h = torch.randn(m, 48).half()
        diagonal = (torch.randn(n_out, 48) * 0.1 * diagonal_of(n_out, blocks, 48)).half()
        garbage = 7.0 * ~diagonal_of(n_out, unread, 48) if unread else 0.0
        up = (diagonal + garbage).half()
        ref = product + 0.7 * (h.double() @ diagonal.double().T) + bias.double()
        size = product.abs() + (0.7 * h.double()).abs() @ diagonal.double().abs().T + bias.double().abs()
        for tma in (False, True):
            out = int8_lora.gemm_low_rank(a, a_scale, w, w_scale, bias, h, up, 0.7, torch.float16, tma=tma,
                                          blocks=blocks)
            rel = ((out.double() - ref).abs() / size).max().item()
            assert rel <= 2 ** -10, (n_out, blocks, tma, rel)


def method_low_rank():
    """Int8ConvRotMethod.apply with a LoRA's part (quant.low_rank.LowRank), the fused path forced (Triton, the
    interpreter standing in for CUDA): its hidden the INT8 GEMM of the call's own quantized rows with the down matrix
    rotated and quantized per row (`down_rows`, which dequantized and rotated back is the down matrix within 2^-7),
    against float64's layer output plus the part on the activated input: within 2^-7 of the output, the part itself
    within 2^-5 (the INT8 roundings of the input and of the down matrix, under 1% each); SwiGLU's input (never
    activated for the branch); a part with a mid matrix (its hidden in the activations' dtype)."""
    import os
    from bigdit.quant import int8_lora, witness
    from bigdit.quant.int8_convrot import Int8ConvRotMethod
    from bigdit.quant.kitchen_api import apply_input_act, hadamard
    from bigdit.quant.linear import quantized_layer
    from bigdit.quant.low_rank import LowRank
    int8_lora.fusable = lambda x, part: True  # the interpreter's CPU tensors in place of CUDA ones
    os.environ["BIGDIT_INT8_KERNEL"] = "triton"  # on CPU the measured default is kitchen
    torch.manual_seed(5)
    dtype = torch.float16  # see gemm_low_rank
    for k, n, rank, act, with_mid in ((512, 96, 16, None, False), (256, 48, 70, "swiglu", False),
                                      (512, 96, 24, None, True)):
        method = Int8ConvRotMethod(256)
        layer = quantized_layer(method, torch.randn(n, k) * k ** -0.5, k, n, torch.randn(n).to(dtype), dtype,
                                torch.device("cpu"), torch.device("cpu"))
        x = torch.randn(2, 9, 2 * k if act else k).to(dtype)
        down, up = (torch.randn(rank, k) * k ** -0.5).to(dtype), (torch.randn(n, rank) * 0.05).to(dtype)
        mid = (torch.randn(rank, rank) * rank ** -0.5).to(dtype) if with_mid else None
        part = LowRank((None, None, None), down, mid, up, 0.5)
        plain = compiled_ops.int8_linear_triton(x.reshape(18, -1), layer.weight, layer.weight_scale, layer.bias,
                                                dtype, convrot=True, convrot_groupsize=256, input_act=act).double()
        before = witness.TALLY.calls[it.TALLY, "triton+lora"]
        fused = method.apply(layer, x, act, low_rank=part)
        assert witness.TALLY.calls[it.TALLY, "triton+lora"] == before + 1, (k, n, int8_lora._failed, witness.TALLY.calls)
        assert fused.shape == (2, 9, n) and fused.dtype == dtype
        hidden = apply_input_act(x, act).reshape(18, k).double() @ down.double().T
        if mid is not None:
            hidden = hidden @ mid.double().T
        lora = 0.5 * hidden @ up.double().T
        label = (k, n, rank, act, with_mid)
        assert rel(fused.reshape(18, n), plain + lora) <= 2 ** -7, (label, rel(fused.reshape(18, n), plain + lora))
        assert rel(fused.reshape(18, n).double() - plain, lora) <= 2 ** -5, (
            label, rel(fused.reshape(18, n).double() - plain, lora))
        assert (("int8_rows", True, 256) in part.derived) == (mid is None), label
        if mid is None:
            q, scale = part.derived["int8_rows", True, 256]
            back = (q.double() * scale.double()[:, None]).reshape(rank, -1, 256) @ hadamard(256, q.device).double()
            assert q.dtype == torch.int8 and rel(back.reshape(rank, k), down) <= 2 ** -7, label


def w4a8_method():
    """W4A8Int8Method.apply on the kernels (the interpreter standing in for CUDA): the codes decoded by kitchen,
    then the INT8 path, against kitchen's own W4A8 linear on the same tensors: errors from the float reference (the
    layer's dequantized weight) no worse than 1.1x kitchen's, for ConvRot groups 256 and 64 (kitchen's CUDA W4A8
    takes 256 only), SwiGLU and a bias; pinned to kitchen, a layer with zero points, under torch.compile; a LoRA's
    part in the GEMM's epilogue (as Int8ConvRotMethod's, method_low_rank) and, where not fusable, by the addmm."""
    import os
    from bigdit.quant import witness
    from bigdit.quant.kitchen_layout import KitchenLayoutMethod
    from bigdit.quant.linear import quantized_layer
    from bigdit.quant.w4a8_int8 import W4A8Int8Method
    torch.manual_seed(6)
    for rotation, act, dtype in ((256, None, torch.bfloat16), (64, "swiglu", torch.float16)):
        k, n = 512, 96
        method = W4A8Int8Method(16, rotation)
        layer = quantized_layer(method, torch.randn(n, k) * k ** -0.5, k, n, (torch.randn(n) * 0.1).to(dtype), dtype,
                                torch.device("cpu"), torch.device("cpu"))
        x = activations(37, k, dtype, act == "swiglu", seed=4).reshape(1, 37, -1)
        ref = torch.nn.functional.linear(apply_input_act(x, act).double(), method.dequantize(layer).double(),
                                         layer.bias.double())
        before = witness.TALLY.calls[it.TALLY, "triton"]
        decoded = witness.TALLY.calls[compiled_ops.W4A8_TALLY, "decoded to int8"]
        ours = method.apply(layer, x, act)
        assert witness.TALLY.calls[it.TALLY, "triton"] == before + 1, witness.TALLY.calls
        assert witness.TALLY.calls[compiled_ops.W4A8_TALLY, "decoded to int8"] == decoded + 1, witness.TALLY.calls
        theirs = KitchenLayoutMethod.apply(method, layer, x, act)
        assert ours.shape == theirs.shape == (1, 37, n) and ours.dtype == theirs.dtype == dtype
        label = (rotation, act, dtype, rel(ours, ref), rel(theirs, ref))
        assert rel(ours, ref) <= 1.1 * rel(theirs, ref) and rel(ours, ref) < 0.05, label
        os.environ["BIGDIT_INT8_KERNEL"] = "kitchen"
        assert torch.equal(method.apply(layer, x, act), theirs), label
        del os.environ["BIGDIT_INT8_KERNEL"]
        # zero points: kitchen's eager linear computes them
        layer.weight_correction = torch.nn.Parameter(torch.zeros(k // 16, n), requires_grad=False)
        assert torch.equal(method.apply(layer, x, act), KitchenLayoutMethod.apply(method, layer, x, act)), label
        del layer.weight_correction
        assert witness.TALLY.calls[it.TALLY, "triton"] == before + 1, witness.TALLY.calls
    if runtime_loop_bounds() is None:  # the LoRA's part: in the GEMM's epilogue, else the addmm
        from bigdit.quant import int8_lora
        from bigdit.quant.low_rank import LowRank
        xa = apply_input_act(x, act)
        down, up = (torch.randn(24, k) * k ** -0.5).to(dtype), (torch.randn(n, 24) * 0.05).to(dtype)
        part = LowRank((None, None, None), down, None, up, 0.5)
        plain = method.apply(layer, xa)
        h = torch.nn.functional.linear(xa.reshape(37, k), down)
        unfused = plain.reshape(37, n).float() + 0.5 * (h.float() @ up.float().T)
        fusable, int8_lora.fusable = int8_lora.fusable, lambda *_: True  # CPU tensors in place of CUDA ones
        fused = method.apply(layer, x, act, low_rank=part)  # the hidden from the INT8 rows: see method_low_rank
        int8_lora.fusable = fusable
        assert witness.TALLY.calls[it.TALLY, "triton+lora"] == 1, witness.TALLY.calls
        assert fused.shape == (1, 37, n) and rel(fused.reshape(37, n), unfused) <= 2 ** -7
        assert torch.equal(method.apply(layer, x, act, low_rank=part),
                           plain.reshape(37, n).addmm(h, up.t(), alpha=0.5).reshape(1, 37, n))
    torch._dynamo.reset()
    compiled = torch.compile(lambda v: method.apply(layer, v, act), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), ours)
    t = layer.tensors_for(x)
    torch.library.opcheck(torch.ops.bigdit.w4a8_linear_triton.default,
                          (x.reshape(37, -1), t["weight"], t["weight_s_rel"].float(),  # fp8 has no CPU compare
                           t["weight_s_channel"],
                           t.get("weight_codebook"), t["bias"], dtype, 16, 64, act),
                          test_utils=("test_schema", "test_faketensor"))


def _bench_module(name: str):
    """A module of tests/bench/ (an experiment the bench times), imported."""
    sys.path.insert(0, str(PACK_ROOT / "tests" / "bench"))
    return importlib.import_module(name)


def w4a8_decode():
    """The pack's W4A8 decode (quant/w4a8_triton.py) bit-equal to comfy-kitchen's: with a codebook and without,
    fp8 group scales over their whole range (subnormals, negatives) and fp32 ones, groups of 4, 16 and 48, rows and
    columns ending mid-tile; counted as the INT8 path's decode."""
    from bigdit.quant import w4a8_triton, witness
    torch.manual_seed(10)
    n, k = 70, 672
    qdata = torch.randint(-128, 128, (n, k // 2), dtype=torch.int8)
    kitchen = compiled_ops.w4a8_decoder(torch.device("cpu"))
    for group in (4, 16, 48):
        s_bytes = torch.randint(0, 256, (n, k // group), dtype=torch.uint8)
        s_bytes[(s_bytes & 0x7F) == 0x7F] = 0x38  # no NaN codes (e4m3fn's 0x7f, 0xff): 1.0 in their place
        for s_rel in (s_bytes.view(torch.float8_e4m3fn), torch.rand(n, k // group) * 40 - 20):
            for codebook in (torch.linspace(-1.2, 1.0, 16), None):
                assert w4a8_triton.decodes(qdata, s_rel, group)
                got, want = w4a8_triton.decode(qdata, s_rel, codebook, group), kitchen(qdata, s_rel, codebook, group)
                label = (group, s_rel.dtype, codebook is None, (got.int() - want.int()).abs().max())
                assert got.dtype == torch.int8 and got.shape == (n, k) and torch.equal(got, want), label
    assert not w4a8_triton.decodes(qdata, torch.rand(n, k // 16, dtype=torch.float16), 16)  # a scale dtype it lacks
    assert not w4a8_triton.decodes(qdata[:, :-1], torch.rand(n, k // 16), 16)  # codes and scales disagree
    before = witness.TALLY.calls[compiled_ops.W4A8_TALLY, "decoded to int8"]
    assert torch.equal(compiled_ops.w4a8_decoded(qdata, s_rel, None, 48), want)
    assert witness.TALLY.calls[compiled_ops.W4A8_TALLY, "decoded to int8"] == before + 1


def w4a8_fused_gemm():
    """The bench's fused-decode W4A8 GEMM (tests/bench/w4a8_fused.py) against kitchen's decode then the INT8 GEMM:
    the decoded operand is bit-equal, so the outputs are equal; with a codebook and without (uniform levels), fp8
    group scales over their whole range (subnormals, negatives), per-channel scales and a bias."""
    w4a8_fused = _bench_module("w4a8_fused")
    torch.manual_seed(8)
    m, n, k, group = 37, 96, 512, 16
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    a_scale = torch.rand(m, 1) * 1e-2
    qdata = torch.randint(-128, 128, (n, k // 2), dtype=torch.int8)
    s_bytes = torch.randint(0, 256, (n, k // group), dtype=torch.uint8)
    s_bytes[(s_bytes & 0x7F) == 0x7F] = 0x38  # no NaN codes (e4m3fn's 0x7f, 0xff): 1.0 in their place
    s_rel = s_bytes.view(torch.float8_e4m3fn)
    s_channel = torch.rand(n) * 1e-2
    bias = torch.randn(n, dtype=torch.bfloat16)
    decoder = compiled_ops.w4a8_decoder(torch.device("cpu"))
    for codebook in (torch.linspace(-1.2, 1.0, 16), None):
        decoded = decoder(qdata, s_rel, codebook, group)
        want = it.gemm(a, a_scale, decoded, s_channel, bias, torch.bfloat16, tma=False)
        for config in w4a8_fused.configs()[:2]:
            config = dict(config, BLOCK_M=32, BLOCK_N=32)  # small tiles: the interpreter's speed
            got = w4a8_fused.gemm_w4(a, a_scale, qdata, s_rel, codebook, s_channel, bias, group, torch.bfloat16,
                                     config)
            assert torch.equal(got, want), (codebook is None, config, (got.float() - want.float()).abs().max())


def persistent_gemm():
    """The bench's persistent INT8 GEMM (tests/bench/int8_gemm_persistent.py) bit-equal to the pack's TMA GEMM, with
    fewer programs than tiles (each walks several), rows and columns ending mid-tile, each of its configs' options."""
    int8_gemm_persistent = _bench_module("int8_gemm_persistent")
    torch.manual_seed(9)
    m, n, k = 70, 96, 256
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    a_scale, w_scale, bias = torch.rand(m, 1) * 1e-2, torch.rand(n, 1) * 1e-2, torch.randn(n, dtype=torch.bfloat16)
    want = it.gemm(a, a_scale, w, w_scale, bias, torch.bfloat16, tma=True)
    seen = set()
    for config in int8_gemm_persistent.configs():
        options = (config["FLATTEN"], config["WARP_SPECIALIZE"])
        if options in seen:
            continue
        seen.add(options)
        config = dict(config, BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, GROUP_M=2)  # small tiles: 3 x 3 of them
        got = int8_gemm_persistent.gemm(a, a_scale, w, w_scale, bias, torch.bfloat16, config, programs=4)
        assert torch.equal(got, want), (options, (got.float() - want.float()).abs().max())


CHECKS = {f.__name__: f for f in (activation, activation_pieces, gemm_int32, gemm_epilogue, int8_linear_vs_kitchen, unavailable,
                                  method_and_compile, shipped_configs, gemm_low_rank, method_low_rank, w4a8_method,
                                  w4a8_decode, w4a8_fused_gemm, persistent_gemm)}

NEEDS_RUNTIME_LOOP_BOUNDS = {"gemm_low_rank", "method_low_rank", "persistent_gemm"}

if __name__ == "__main__":
    assert it._INTERPRETED, "run with TRITON_INTERPRET=1"
    why = runtime_loop_bounds() if sys.argv[1] in NEEDS_RUNTIME_LOOP_BOUNDS else None
    if why is not None:  # the GPU runs the kernel (tests/test_int8_lora_gpu.py, the bench), another Triton's interpreter this
        print(f"skip {sys.argv[1]}: this Triton's interpreter cannot run a loop bounded by a runtime argument ({why})")
        sys.exit(0)
    CHECKS[sys.argv[1]]()
    print("ok", sys.argv[1])
