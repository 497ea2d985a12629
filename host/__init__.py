"""ComfyUI's protocols, in one room below the nodes: the attention override, the cast and patch protocols of the
pack's quantized layer, dynamic VRAM, file-backed paging, the LoRA fold, the offload session, the loaders' host
and what a node shows. The core (quant/, attention/, loaders/, offload/) never imports it; nodes/ holds only the
node classes. The package itself imports nothing: its plain-data modules (`options.py`, `layers.py`) import
without ComfyUI."""
