"""Sol through comfy-kitchen's eager reference on CPU.

tau semantics (comfy-kitchen's sol_attn): a query block attends a key block
exactly when its mean score exceeds tau standard deviations of the block's
proxy scores; other blocks contribute one pooled term each. As tau goes to
minus infinity every block is exact and the pooled terms vanish, so Sol *is*
dense attention there: at tau = -1e4 it must match SDPA to fp32 rounding.
"""
import types

import pytest
import torch
import torch.nn.functional as F

from bench.attention_inputs import psnr, random_qkv, structured_qkv
from bigdit.attention import Router, Unsupported, registry
from bigdit.attention.sol import h3_sinks
from bigdit.host.attention import call_options
from probes import snapshot

pytestmark = pytest.mark.kitchen_feature("sol_attn")

ALL_EXACT = -1e4
FP32_TOL = 1e-5  # fp32 attention outputs of magnitude O(1)


def sol(tau, **kw):
    return registry.create("sol", sol_tau=tau, sol_min_tokens=0, **kw)


def qkv(b=2, h=2, t=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, t, 128, generator=g) for _ in range(3))


@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
def test_every_block_exact_is_dense_attention(layout):
    q, k, v = qkv()
    expected = F.scaled_dot_product_attention(q, k, v)
    args = (q, k, v) if layout == "BHSD" else tuple(t.transpose(1, 2) for t in (q, k, v))
    out = sol(ALL_EXACT)(*args, layout=layout)
    if layout == "BSHD":
        out = out.transpose(1, 2)
    torch.testing.assert_close(out, expected, atol=FP32_TOL, rtol=0)
    # the same inputs at tau 2 really are sparse: far from dense on random data
    assert (sol(2.0)(q, k, v) - expected).abs().max() > 1e-2


def test_scale_is_passed_through():
    q, k, v = qkv(b=1)
    out = sol(ALL_EXACT)(q, k, v, scale=0.05)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, scale=0.05), atol=FP32_TOL, rtol=0)


def test_structure_is_what_sol_needs():
    # 1024 tokens on a 4x16x16 grid; see tests/bench/attention_inputs.py
    qs, ks, vs = structured_qkv(1, 2, (4, 16, 16), dtype=torch.float32)
    qr, kr, vr = random_qkv(1, 2, 1024, dtype=torch.float32)
    structured = psnr(sol(1.0)(qs, ks, vs), F.scaled_dot_product_attention(qs, ks, vs))
    random = psnr(sol(1.0)(qr, kr, vr), F.scaled_dot_product_attention(qr, kr, vr))
    assert structured > 40.0, structured  # measured 45.7 dB
    assert random < 25.0, random  # measured 18.4 dB


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_key_padding_mask_maps_onto_sink_blocks(kind):
    q, k, v = qkv(t=512)
    keep = torch.ones(2, 1, 1, 512, dtype=torch.bool)
    keep[0, ..., 450:] = False  # batch 0: pad the last 62 keys
    keep[1, ..., 500:] = False
    mask = keep if kind == "bool" else torch.where(keep, 0.0, float("-inf"))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(sol(ALL_EXACT)(q, k, v, mask=mask), expected, atol=FP32_TOL, rtol=0)
    # sparse: the masked keys sit in sink blocks, attended exactly with the
    # mask, so no pooled term leaks them: their values cannot matter
    sparse = sol(2.0)(q, k, v, mask=mask)
    v2 = v.clone()
    v2[0, :, 450:] = 1e3
    v2[1, :, 500:] = 1e3
    assert torch.equal(sol(2.0)(q, k, v2, mask=mask), sparse)


def test_masks_sol_cannot_express_are_declined():
    q, k, v = qkv(t=256)
    per_query = torch.ones(2, 1, 256, 256, dtype=torch.bool).tril()
    with pytest.raises(Unsupported, match="key-only"):
        sol(1.0).kernel_call(q, k, v, mask=per_query)
    router = Router("sol", dense_backend="sdpa", sol_min_tokens=0)
    out = router(q, k, v, mask=per_query)
    assert snapshot(router.stats)["calls"] == {"sdpa": 1}
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=per_query))


def h3_layout(t):
    # [text 0-100 | audio 100-164 | video 164-t], as upstream's PackedLayout
    return types.SimpleNamespace(seq_len=t, segments=[(0, 100, "text"), (100, 164, "audio"), (164, t, "video")])


def test_h3_conditioning_rows_become_sinks():
    """Upstream's H3 layout as the host reads it from transformer_options (host/attention.py's call_options)."""
    options = call_options({"minimax_h3_layout": h3_layout(512)})
    assert h3_sinks(options, 512) == ((0, 3), (1, 3))
    assert h3_sinks(options, 640) == ((0, 0), (0, 0))  # another sequence
    assert h3_sinks(call_options({}), 512) == ((0, 0), (0, 0))
    q, k, v = qkv(t=512)
    dense = F.scaled_dot_product_attention(q, k, v)
    out = sol(3.0)(q, k, v, options=options)
    # sink_q blocks 1-2 (query rows 64-191) attend everything exactly: dense rows
    torch.testing.assert_close(out[:, :, 64:192], dense[:, :, 64:192], atol=FP32_TOL, rtol=0)
    assert (out[:, :, 192:] - dense[:, :, 192:]).abs().max() > 1e-2  # video rows stay sparse
    without = sol(3.0)(q, k, v)
    assert (without[:, :, 64:192] - dense[:, :, 64:192]).abs().max() > 1e-2


@pytest.mark.parametrize("call, reason", [
    (dict(t=128), "fewer than 256 tokens"),
    (dict(d=64), "head dim 64 not in"),
    (dict(sk=128), "cross-attention"),
])
def test_sol_declines(call, reason):
    t, d = call.get("t", 256), call.get("d", 128)
    q = torch.zeros(1, 2, t, d)
    k = torch.zeros(1, 2, call.get("sk", t), d)
    with pytest.raises(Unsupported, match=reason):
        registry.create("sol", sol_min_tokens=256).kernel_call(q, k, k)


def test_default_minimum_is_12k_tokens():
    q = torch.zeros(1, 1, 12287, 128)
    with pytest.raises(Unsupported, match="fewer than 12288 tokens"):
        registry.create("sol").kernel_call(q, q, q)
