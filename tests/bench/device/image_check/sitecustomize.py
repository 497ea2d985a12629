"""Checking the device path here: hide the packages the GPU machine's image lacks (tests/bench/device/README.md).

With this folder on PYTHONPATH, importing one of HIDDEN finds nothing unless it comes from a folder
in $E2E_ALLOW (colon separated: the unpacked bundle's site/ and the stubs).
"""
import os
import sys

# what ComfyUI 0.3.75's and 0.33.0's test venvs hold and the image lacks (KINDS.md's package list); not hidden:
# httpx2, httpcore2 and truststore, which only the venv's newer huggingface_hub imports (the image's uses httpx)
HIDDEN = {"comfyui_frontend_package", "comfyui_embedded_docs", "alembic", "sqlalchemy", "mako", "av", "kornia",
          "kornia_rs", "spandrel", "pydantic", "pydantic_core", "pydantic_settings", "annotated_types",
          "typing_inspection", "dotenv", "torchsde", "trampoline", "comfy_kitchen", "comfy_aimdo", "fa3_fwd_interface",
          "fa3_fwd", "fa3_fwd_config", "sageattention", "blake3", "simpleeval", "OpenGL", "comfy_angle", "torchao", "mmgp", "optimum", "convert_to_quant", "prodigyplus"}
HIDDEN_PREFIXES = ("comfyui_workflow_templates",)  # the templates package and its parts
ALLOW = tuple(p for p in os.environ.get("E2E_ALLOW", "").split(":") if p)


class _Hiding:
    def __init__(self, finder):
        self.finder = finder

    def __getattr__(self, name):
        return getattr(self.finder, name)

    def find_spec(self, name, path=None, target=None):
        spec = self.finder.find_spec(name, path, target)
        top = name.split(".")[0]
        if spec is not None and (top in HIDDEN or top.startswith(HIDDEN_PREFIXES)):
            origin = spec.origin or next(iter(spec.submodule_search_locations or []), "")
            if not str(origin).startswith(ALLOW):  # an empty ALLOW allows nothing
                return None
        return spec


sys.meta_path[:] = [_Hiding(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
