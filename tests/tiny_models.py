"""Tiny random Wan 2.1 T2V models that ComfyUI (0.3.75 and 0.33.0) detects and runs on CPU.

The files are built from ComfyUI's own classes (`comfy.ldm.wan.model.WanModel`,
`comfy.ldm.wan.vae.WanVAE`) in a subprocess run by the host's own venv python:
importing comfy is slow and changes global state, so the pytest process never does. Weights come from a seeded
generator and are saved in bf16, so the same arguments give the same bytes.

Key names are the module's state_dict names without prefix, which is what
ComfyUI's detection reads: a diffusion model with `head.modulation` is Wan 2.1,
and without `img_emb.*` it is T2V; a VAE with `decoder.middle.0.residual.0.gamma`
and no Wan 2.2 keys is the Wan 2.1 VAE, its width read from `decoder.head.0.gamma`.
ComfyUI 0.3.75 derives num_heads = dim // 128 (head dim 128), so dim must equal
128 * num_heads.

Under --cpu, UNETLoader ("default") loads these bf16 files as fp32 and builds
the model from comfy.ops.disable_weight_init (Linear.comfy_cast_weights False);
weight_dtype "fp8_e4m3fn" keeps fp8 weights under comfy.ops.manual_cast
(comfy_cast_weights True, compute in fp32).
"""
import json
import subprocess
import sys
from pathlib import Path

from comfy_harness import host_of


def make_tiny_wan(path, num_layers=1, num_heads=1, dim=128, ffn_dim=256, seed=0, host=None) -> Path:
    """Write a random Wan 2.1 T2V diffusion model (16 latent channels, text_dim 4096).

    host: the comfy_harness.Host whose classes build it (or its ComfyUI folder; default DEFAULT_HOST).
    """
    if dim != 128 * num_heads:
        raise ValueError(f"ComfyUI detects num_heads as dim // 128: dim={dim} needs num_heads={dim // 128}")
    if dim % 16 or ffn_dim % 16:
        raise ValueError("dim and ffn_dim must be multiples of 16")
    return _generate("wan", path, host, num_layers=num_layers, num_heads=num_heads,
                     dim=dim, ffn_dim=ffn_dim, seed=seed)


def make_tiny_wan_vae(path, dim=8, seed=0, host=None) -> Path:
    """Write a random Wan 2.1 VAE (z_dim 16, 8x spatial and 4x temporal compression)."""
    return _generate("wan_vae", path, host, dim=dim, seed=seed)


def _generate(kind, path, host, **params) -> Path:
    host = host_of(host)
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    job = {"kind": kind, "path": str(path), "comfyui": str(host.comfyui), **params}
    result = subprocess.run([str(host.python), __file__, json.dumps(job)], cwd=host.comfyui,
                            capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"generating {path.name} failed:\n{result.stdout}{result.stderr}")
    return path


# ---- run in the subprocess, with ComfyUI importable ------------------------

def _random_state_dict(module, seed):
    """fp32 weights in registration order: Linear/Conv uniform(+-1/sqrt(fan_in)),
    norm scales 1, norm shifts 0, Wan modulation N(0, 1/dim), biases N(0, 0.02)."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, ref in module.state_dict().items():
        shape, leaf = ref.shape, name.rsplit(".", 1)[-1]
        if leaf == "modulation":
            value = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
        elif leaf == "gamma" or (".norm" in name and leaf == "weight"):
            value = torch.ones(shape)
        elif ".norm" in name and leaf == "bias":
            value = torch.zeros(shape)
        elif len(shape) >= 2:
            bound = (ref[0].numel()) ** -0.5
            value = (torch.rand(shape, generator=gen) * 2 - 1) * bound
        else:
            value = torch.randn(shape, generator=gen) * 0.02
        out[name] = value
    return out


def _main(job):
    sys.path.insert(0, job["comfyui"])
    from comfy.cli_args import args
    args.cpu = True
    import torch
    import safetensors.torch
    import comfy.ops

    if job["kind"] == "wan":
        from comfy.ldm.wan.model import WanModel
        module = WanModel(model_type="t2v", dim=job["dim"], ffn_dim=job["ffn_dim"],
                          num_heads=job["num_heads"], num_layers=job["num_layers"],
                          in_dim=16, out_dim=16, text_dim=4096, freq_dim=256,
                          operations=comfy.ops.disable_weight_init)
    else:
        from comfy.ldm.wan.vae import WanVAE
        module = WanVAE(dim=job["dim"], z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                        attn_scales=[], temperal_downsample=[False, True, True])
    sd = {k: v.to(torch.bfloat16) for k, v in _random_state_dict(module, job["seed"]).items()}

    tmp = Path(job["path"] + ".tmp")
    safetensors.torch.save_file(sd, str(tmp))
    tmp.replace(job["path"])


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
