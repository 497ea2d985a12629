"""Tiny random Wan 2.1 T2V models that ComfyUI (0.3.75 and 0.33.0) detects and runs on CPU, and
tiny MiniMax-H3 audio-video models and video VAEs for a ComfyUI with native H3 (upstream 0.33.0).

The files are built from ComfyUI's own classes (`comfy.ldm.wan.model.WanModel`,
`comfy.ldm.wan.vae.WanVAE`, `comfy.ldm.minimax.model.MiniMaxH3Model`) in a subprocess run by the
host's own venv python: importing comfy is slow and changes global state, so the pytest process
never does. Weights come from a seeded generator and are saved in bf16 (H3's fp32 layers in fp32),
so the same arguments give the same bytes.

Key names are the module's state_dict names without prefix, which is what
ComfyUI's detection reads: a diffusion model with `head.modulation` is Wan 2.1,
and without `img_emb.*` it is T2V; a VAE with `decoder.middle.0.residual.0.gamma`
and no Wan 2.2 keys is the Wan 2.1 VAE, its width read from `decoder.head.0.gamma`.
ComfyUI 0.3.75 derives num_heads = dim // 128 (head dim 128), so dim must equal
128 * num_heads. Upstream detects H3 by `video_patch_proj.weight` and `audio_patch_proj.weight`
and reads every size from the tensors (comfy/model_detection.py), so any small config loads.

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


H3_TEXT_DIM = 512  # the tiny H3's text-encoder width (the real one: Qwen3-VL-32B's 5120)


def make_tiny_h3(path, num_layers=2, token_refiner_num_layers=1, hidden_size=256, num_attention_heads=2,
                 ffn_hidden_size=512, text_dim=H3_TEXT_DIM, time_embed_dim=192, seed=0, host=None) -> Path:
    """Write a random MiniMax-H3 audio-video DiT built by upstream's `MiniMaxH3Model`.

    Head dim stays 128 (the rope rotates 96 of its channels); the time
    embedding width (192, like the real 2688) is no multiple of 256, so ConvRot
    group 256 leaves the AdaLN projections alone. text_dim must differ from
    hidden_size: H3 takes text states of hidden width as already refined and
    skips its condition projection and token refiner. The layers upstream builds in
    fp32 (patch projections, time embedder, output heads) are saved in fp32,
    the rest in bf16, as in the published checkpoints. host must have MiniMax-H3.
    """
    return _generate("minimax_h3", path, host, num_layers=num_layers,
                     token_refiner_num_layers=token_refiner_num_layers, hidden_size=hidden_size,
                     num_attention_heads=num_attention_heads, ffn_hidden_size=ffn_hidden_size, text_dim=text_dim,
                     time_embed_dim=time_embed_dim, seed=seed)


# tests/bench/e2e_models.py's generate_component, run by the host's python (it generates in that interpreter)
_H3_VAE = """
import dataclasses, json, sys
bench, path, comfyui, decoder, seed, cpu = sys.argv[1:]
sys.path.insert(0, bench)
import e2e_models
component = e2e_models.COMPONENTS["tiny_video_vae"]
if decoder != "null":
    component = dataclasses.replace(component, tiny={**component.tiny, "video_decoder": json.loads(decoder)})
e2e_models.generate_component(component, path, comfyui, seed=int(seed), cpu=cpu == "1")
"""


def make_tiny_h3_vae(path, decoder: dict | None = None, seed=0, cpu=True, host=None) -> Path:
    """Write upstream's MiniMax-H3 video VAE at tests/bench/e2e_models.py's tiny size (a 1-block ViT decoder of 4
    heads of 64; `decoder`: other {num_layers, heads, dim_head}), its decoder blocks' linears INT8 ConvRot as in
    Comfy-Org's file, random (generated on the GPU unless `cpu`). tests/fixtures/bigdit_testnodes'
    BigditTinyVAELoader loads it through comfy.sd.VAE. host must have MiniMax-H3."""
    host = host_of(host)
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    bench = Path(__file__).resolve().parent / "bench"
    result = subprocess.run([str(host.python), "-c", _H3_VAE, str(bench), str(path), str(host.comfyui),
                             json.dumps(decoder), str(seed), "1" if cpu else "0"],
                            cwd=host.comfyui, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"generating {path.name} failed:\n{result.stdout}{result.stderr}")
    return path


def linear_layers(model, host=None, **config) -> dict:
    """{module name: weight dtype ("bfloat16", "float32")} of every nn.Linear of a host's own model class
    at its default (full) size unless `config` says otherwise, built in bf16 on the meta device (no
    memory, no weights): the dtypes show which layers the class pins to fp32.

    model: "minimax_h3" (comfy.ldm.minimax.model.MiniMaxH3Model) or "wan" (comfy.ldm.wan.model.WanModel).
    """
    host = host_of(host)
    job = {"kind": "linear_layers", "model": model, "config": config, "comfyui": str(host.comfyui)}
    result = subprocess.run([str(host.python), __file__, json.dumps(job)], cwd=host.comfyui,
                            capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"listing {model}'s layers failed:\n{result.stdout}{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


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


def _variance_preserving_state_dict(module, seed):
    """Weights N(0, 1/fan_in) so every layer keeps its input's scale, biases
    N(0, 0.02), norm scales 1; the rope's inverse frequencies are 10000^(-i/n)."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, ref in module.state_dict().items():
        shape = ref.shape
        if name.endswith("inv_freq"):
            value = 10000.0 ** (-torch.arange(shape[0], dtype=torch.float32) / shape[0])
        elif len(shape) >= 2:
            value = torch.randn(shape, generator=gen) * ref[0].numel() ** -0.5
        elif name.endswith(("norm.weight", "norm1.weight", "norm2.weight")):
            value = torch.ones(shape)
        else:
            value = torch.randn(shape, generator=gen) * 0.02
        out[name] = value.to(ref.dtype)
    return out


def _tiny_h3(job):
    import torch
    import comfy.ops
    from comfy.ldm.minimax.model import MiniMaxH3Model
    shape = {k: job[k] for k in ("num_layers", "token_refiner_num_layers", "hidden_size", "num_attention_heads",
                                 "ffn_hidden_size", "text_dim", "time_embed_dim")}
    # built in bf16: the modules upstream pins to fp32 come out fp32
    module = MiniMaxH3Model(attention_head_dim=128, time_embed_hidden_size=job["hidden_size"],
                            dtype=torch.bfloat16, operations=comfy.ops.disable_weight_init, **shape)
    return _variance_preserving_state_dict(module, job["seed"])


def _tiny_wan(job):
    import torch
    import comfy.ops
    from comfy.ldm.wan.model import WanModel
    module = WanModel(model_type="t2v", dim=job["dim"], ffn_dim=job["ffn_dim"],
                      num_heads=job["num_heads"], num_layers=job["num_layers"],
                      in_dim=16, out_dim=16, text_dim=4096, freq_dim=256,
                      operations=comfy.ops.disable_weight_init)
    return {k: v.to(torch.bfloat16) for k, v in _random_state_dict(module, job["seed"]).items()}


def _tiny_wan_vae(job):
    import torch
    from comfy.ldm.wan.vae import WanVAE
    module = WanVAE(dim=job["dim"], z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                    attn_scales=[], temperal_downsample=[False, True, True])
    return {k: v.to(torch.bfloat16) for k, v in _random_state_dict(module, job["seed"]).items()}


def _linear_layers(job):
    import torch
    import comfy.ops
    if job["model"] == "minimax_h3":
        from comfy.ldm.minimax.model import MiniMaxH3Model as cls
    else:
        from comfy.ldm.wan.model import WanModel as cls
    module = cls(**job["config"], dtype=torch.bfloat16, device="meta", operations=comfy.ops.disable_weight_init)
    return {name: str(m.weight.dtype).replace("torch.", "") for name, m in module.named_modules()
            if isinstance(m, torch.nn.Linear)}


def _main(job):
    sys.path.insert(0, job["comfyui"])
    from comfy.cli_args import args
    args.cpu = True
    import safetensors.torch

    if job["kind"] == "linear_layers":
        print(json.dumps(_linear_layers(job)))
        return

    builders = {"wan": _tiny_wan, "wan_vae": _tiny_wan_vae, "minimax_h3": _tiny_h3}
    sd = builders[job["kind"]](job)
    tmp = Path(job["path"] + ".tmp")
    safetensors.torch.save_file(sd, str(tmp))
    tmp.replace(job["path"])


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
