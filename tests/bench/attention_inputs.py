"""Attention inputs and error measures shared by the attention benchmark and tests.

`structured_qkv` builds q and k whose scores depend on where tokens sit in a
video latent, so that attention concentrates the way it does in a video DiT:
tokens are laid out on a (frames, height, width) grid in raster order (width
fastest, as ComfyUI's video models flatten their patches), and

    q_i = k_i = alpha * phi_h(p_i) + noise,   phi_h(p) = [cos(W_h p), sin(W_h p)] / sqrt(D/2)

with W_h ~ N(0, 1/l_h^2) per head: random Fourier features of a Gaussian
kernel, so phi(p_i).phi(p_j) ~= exp(-|p_i - p_j|^2 / (2 l_h^2)). Each head
attends a neighbourhood of radius ~l_h grid cells (l_h from 1 to 4, log-spaced
over the heads); alpha sets the peak score to `peak` (in units of
softmax logits after the 1/sqrt(D) scale), and the noise (std `noise` per
component) blurs it. In the score matrix this is the block diagonal
(width neighbours) plus bands at +-width (rows) and +-height*width (frames):
the locality Sol's block routing relies on. Random N(0, 1) inputs, by
contrast, have no structure at all.
"""
import math

import torch

# token count -> (frames, height, width) of a Wan-like latent after 2x2 patches
GRIDS = {8190: (21, 15, 26), 32760: (21, 30, 52), 65520: (21, 40, 78)}


def random_qkv(batch, heads, tokens, head_dim=128, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator(device).manual_seed(seed)
    shape = (batch, heads, tokens, head_dim)
    return tuple(torch.randn(shape, generator=g, device=device).to(dtype) for _ in range(3))


def structured_qkv(batch, heads, grid, head_dim=128, dtype=torch.bfloat16, device="cpu", seed=0,
                   peak=14.0, noise=0.5):
    """(q, k, v) in BHSD with locality-structured scores (module docstring)."""
    g = torch.Generator(device).manual_seed(seed)
    frames, height, width = grid
    axes = [torch.arange(n, device=device, dtype=torch.float32) for n in grid]
    pos = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)  # (T, 3)
    feats = head_dim // 2
    scales = torch.logspace(0, math.log10(4.0), heads, device=device)  # l_h in grid cells
    w = torch.randn(heads, feats, 3, generator=g, device=device) / scales.view(-1, 1, 1)
    angle = torch.einsum("hfc,tc->htf", w, pos)
    phi = torch.cat([angle.cos(), angle.sin()], dim=-1) / math.sqrt(feats)  # (H, T, D)
    alpha = math.sqrt(peak * math.sqrt(head_dim))
    base = (alpha * phi).unsqueeze(0).expand(batch, -1, -1, -1)

    def noisy():
        return (base + noise * torch.randn(base.shape, generator=g, device=device)).to(dtype)

    q, k = noisy(), noisy()
    v = torch.randn(base.shape, generator=g, device=device).to(dtype)
    return q, k, v


def psnr(out, ref) -> float:
    """Peak signal-to-noise ratio of `out` against `ref` in dB (peak = max |ref|)."""
    out, ref = out.float(), ref.float()
    mse = (out - ref).pow(2).mean().item()
    return float("inf") if mse == 0 else 10 * math.log10(ref.abs().max().item() ** 2 / mse)


def cosine(out, ref) -> float:
    # float64: over millions of elements an fp32 cosine drifts past 1 on CPU
    return torch.nn.functional.cosine_similarity(out.double().flatten(), ref.double().flatten(), dim=0).item()


def relative_error(out, ref):
    """Relative L2 error of out against ref, in fp32."""
    ref = ref.float()
    return ((out.float() - ref).norm() / ref.norm().clamp(min=1e-30)).item()
