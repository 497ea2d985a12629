"""Headless demo: a real ComfyUI with this pack, a tiny Wan model, QuantizeModelINT8, one sampled image.

    bash .ci/demo            (sets up what it needs first)

Prints each step, the quantization report, the wall time of the workflow, and where the image was saved.
"""
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from comfy_harness import DEFAULT_HOST, ComfyServer  # noqa: E402
from graphs import add_preview, chain_id, wan_t2v_graph  # noqa: E402
from tiny_models import make_tiny_wan, make_tiny_wan_vae  # noqa: E402


def main():
    host = DEFAULT_HOST
    host.ensure()
    base = Path(tempfile.mkdtemp(prefix="bigdit-demo-"))
    start = time.perf_counter()
    with ComfyServer(base, host) as comfy:
        print(f"started ComfyUI {host.version} on CPU with the pack in {time.perf_counter() - start:.1f} s "
              f"({comfy.url}, folder {base})")
        unet = make_tiny_wan(comfy.models_dir / "diffusion_models" / "tiny_wan.safetensors", num_layers=2,
                             num_heads=2, dim=256, ffn_dim=512, host=host)
        vae = make_tiny_wan_vae(comfy.models_dir / "vae" / "tiny_wan_vae.safetensors", host=host)
        print(f"wrote a tiny random Wan 2.1 model ({unet.name}, 2 blocks, dim 256) and its VAE ({vae.name})")
        graph = wan_t2v_graph(unet.name, vae.name, model_chain=[
            ("QuantizeModelINT8", {"group_size": "256", "ignored_layers": "", "row_split": "auto"})])
        preview = add_preview(graph, chain_id(0), 1)
        print("ran UNETLoader -> QuantizeModelINT8 -> KSampler (2 steps) -> VAEDecode -> SaveImage:")
        start = time.perf_counter()
        history = comfy.run(graph)
        elapsed = time.perf_counter() - start
        print(history["outputs"][preview]["text"][0])
        print(f"workflow time: {elapsed:.2f} s")
        for image in comfy.output_files(history, "save_image"):
            print(f"saved image: {image}")
        print("The image is noise: the model's weights are random (a tiny test model), so it shows that the "
              "workflow runs, not what a real model draws.")


if __name__ == "__main__":
    main()
