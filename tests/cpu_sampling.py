"""Code the integration tests' host probes share (run with `exec` in a subprocess of the host's Python, after
it defined `torch`, `comfy.model_patcher`, `nodes`, `kind` ("wan" or "h3") and `text_dim`): a patcher of
upstream's dynamic VRAM retargeted to the CPU, and 3 euler steps through ComfyUI's own KSampler path."""

CPU_SAMPLING = r'''
cpu = torch.device("cpu")


def on_cpu_dynamic(model):
    # a patcher made for a GPU, retargeted as upstream's device selector nodes retarget one
    patcher = comfy.model_patcher.ModelPatcherDynamic(model, load_device=torch.device("cuda", 0), offload_device=cpu)
    patcher.load_device = cpu
    patcher.register_load_device(cpu)
    return patcher


def latent():
    if kind == "h3":
        from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV
        return EmptyMiniMaxH3LatentAV.execute(width=64, height=64, length=5)[0]
    return {"samples": torch.zeros(1, 16, 1, 8, 8)}


def sample(patcher):
    """The latents (an H3 latent's streams each) of 3 euler steps; load_models_gpu loads the patcher as it is."""
    gen = torch.Generator().manual_seed(0)
    cond = [[torch.randn(1, 8, text_dim, generator=gen), {}]]
    out = nodes.common_ksampler(patcher, 0, 3, 1.0, "euler", "simple", cond, cond, latent())[0]["samples"]
    return out.unbind() if out.is_nested else [out]
'''
