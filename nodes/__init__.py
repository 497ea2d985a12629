"""ComfyUI adapters; `mappings.py` holds the node tables. The package itself imports nothing, so its
plain-data modules (`options.py`) import without ComfyUI."""
