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
    # ComfyUI compiles its own source at its first start: minutes on a busy two-core machine.
    with ComfyServer(base, host, startup_timeout=600) as comfy:
        print(f"started ComfyUI {host.version} on the CPU with the pack in {time.perf_counter() - start:.1f} s")
        unet = make_tiny_wan(comfy.models_dir / "diffusion_models" / "tiny_wan.safetensors", num_layers=2,
                             num_heads=2, dim=256, ffn_dim=512, host=host)
        vae = make_tiny_wan_vae(comfy.models_dir / "vae" / "tiny_wan_vae.safetensors", host=host)
        graph = wan_t2v_graph(unet.name, vae.name, model_chain=[
            ("QuantizeModelINT8", {"group_size": "256", "ignored_layers": "", "row_split": "auto"})])
        preview = add_preview(graph, chain_id(0), 1)
        start = time.perf_counter()
        history = comfy.run(graph)
        elapsed = time.perf_counter() - start
        print("wrote a tiny random Wan 2.1 model; ran UNETLoader -> QuantizeModelINT8 -> KSampler -> VAEDecode "
              "-> SaveImage over HTTP. QuantizeModelINT8's report:")
        print(history["outputs"][preview]["text"][0])
        print(f"workflow time: {elapsed:.2f} s")
        for image in comfy.output_files(history, "save_image"):
            print(f"saved image: {image}")
        print("The image is noise: the model's weights are random (a tiny test model), so it shows that the "
              "workflow runs, not what a real model draws.")


if __name__ == "__main__":
    main()
