"""ComfyUI's attention-call layouts and masks, mapped onto the backends,
against a float64 attention written out by hand."""
import pytest
import torch

from bigdit.attention import Router
from bigdit.host.attention import install
from probes import snapshot

B, H, D = 2, 3, 64
TOL = 1e-5  # fp32 SDPA against float64 reference, values O(1)


def reference(q, k, v, mask=None, scale=None):
    """softmax(q k^T * scale + mask) v in float64 on (B, H, S, D)."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return torch.softmax(scores, dim=-1) @ v


def bhsd(sq=40, sk=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, sq, D, generator=g)
    k, v = (torch.randn(B, H, sk, D, generator=g) for _ in range(2))
    return q, k, v


def to_comfy(t):
    """(B, H, S, D) -> ComfyUI's (B, S, H*D), heads split as view(b, -1, heads, d)."""
    return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)


def masks(sq, sk):
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(B, sq, sk, generator=g) > 0.3
    keep[..., 0] = True  # no fully masked row
    bias = torch.randn(B, sq, sk, generator=g)
    # (mask as ComfyUI passes it, the same mask broadcast to (B, H, Sq, Sk))
    return {
        "none": (None, None),
        "bool_2d": (keep[0], keep[0].expand(B, H, sq, sk)),
        "bool_3d": (keep, keep.unsqueeze(1).expand(B, H, sq, sk)),
        "additive_2d": (bias[0], bias[0].expand(B, H, sq, sk)),
        "additive_4d_per_head": (bias.unsqueeze(1).repeat(1, H, 1, 1) * torch.arange(1, H + 1).view(1, H, 1, 1),
                                 bias.unsqueeze(1).repeat(1, H, 1, 1) * torch.arange(1, H + 1).view(1, H, 1, 1)),
        "key_padding_4d": (keep[:, :1, :].unsqueeze(1), keep[:, :1, :].unsqueeze(1).expand(B, H, sq, sk)),
    }


@pytest.fixture
def override():
    options = {}
    hook, _ = install(options, Router("sdpa"))
    return hook


def never_called(*args, **kwargs):
    raise AssertionError("ComfyUI's own attention function must not run")


@pytest.mark.parametrize("skip_reshape", [False, True])
@pytest.mark.parametrize("skip_output_reshape", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "bool_2d", "bool_3d", "additive_2d", "additive_4d_per_head",
                                       "key_padding_4d"])
@pytest.mark.parametrize("sk", [40, 24])  # self- and cross-attention
def test_comfy_layouts_and_masks(override, skip_reshape, skip_output_reshape, mask_kind, sk):
    q, k, v = bhsd(sk=sk)
    comfy_mask, full_mask = masks(40, sk)[mask_kind]
    args = (q, k, v) if skip_reshape else tuple(to_comfy(t) for t in (q, k, v))
    out = override(never_called, *args, heads=H, mask=comfy_mask, skip_reshape=skip_reshape,
                   skip_output_reshape=skip_output_reshape, transformer_options={})
    expected = reference(q, k, v, full_mask)
    if not skip_output_reshape:
        expected = to_comfy(expected)
    assert out.shape == expected.shape
    assert out.dtype == q.dtype
    torch.testing.assert_close(out.double(), expected, atol=TOL, rtol=0)


def test_mask_passed_positionally_and_scale_keyword(override):
    # optimized_attention_masked(q, k, v, heads, mask, ...) passes the mask as 5th argument
    q, k, v = bhsd()
    comfy_mask, full_mask = masks(40, 40)["bool_3d"]
    out = override(never_called, *(to_comfy(t) for t in (q, k, v)), H, comfy_mask, scale=0.3,
                   transformer_options={}, _inside_attn_wrapper=True)
    torch.testing.assert_close(out.double(), to_comfy(reference(q, k, v, full_mask, scale=0.3)), atol=TOL, rtol=0)
    default = override(never_called, *(to_comfy(t) for t in (q, k, v)), H, comfy_mask)
    assert (out - default).abs().max() > 1e-2  # the scale really was applied


@pytest.mark.kitchen_feature("sol_attn")
def test_sol_layouts_on_cpu_eager():
    # Sol on comfy-kitchen's eager reference: (B, T, H, 128) inside, any layout outside
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 192, 128, generator=g) for _ in range(3))
    router = Router("sol", dense_backend="sdpa", sol_tau=0.5, sol_min_tokens=0)
    out_bhsd = router(q, k, v, layout="BHSD")
    out_bshd = router(*(t.transpose(1, 2) for t in (q, k, v)), layout="BSHD")
    assert snapshot(router.stats)["calls"] == {"sol": 2}
    torch.testing.assert_close(out_bshd.transpose(1, 2), out_bhsd, atol=1e-6, rtol=0)
    hook, _ = install({}, router)
    out_comfy = hook(never_called, *(to_comfy(t) for t in (q, k, v)), heads=2, transformer_options={})
    torch.testing.assert_close(out_comfy, to_comfy(out_bhsd), atol=1e-6, rtol=0)


@pytest.mark.parametrize("skip_reshape", [False, True])
@pytest.mark.parametrize("backend", ["sdpa", "sol"])
def test_grouped_query_attention(skip_reshape, backend):
    """k/v with fewer heads than q (GQA): each keeps its own head count; a backend without GQA
    (Sol here) declines it with a reason, and SDPA computes it with shared key/value heads."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, 4, 40, 128, generator=g)  # Sol's head dim, so GQA is what it declines
    k, v = (torch.randn(B, 2, 40, 128, generator=g) for _ in range(2))
    router = Router(backend, dense_backend="sdpa", sol_min_tokens=0)
    hook, _ = install({}, router)
    args = (q, k, v) if skip_reshape else tuple(to_comfy(t) for t in (q, k, v))
    out = hook(never_called, *args, heads=4, skip_reshape=skip_reshape, skip_output_reshape=True,
               transformer_options={})
    expected = reference(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1))
    torch.testing.assert_close(out.double(), expected, atol=TOL, rtol=0)
    stats = snapshot(router.stats)
    assert stats["calls"] == {"sdpa": 1}
    if backend == "sol":
        assert any("grouped-query attention" in reason for reason in stats["fallbacks"]), stats
