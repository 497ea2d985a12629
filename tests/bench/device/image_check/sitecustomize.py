"""Checking the device path here: hide the packages the GPU machine's image lacks (tests/bench/device/README.md).

With this folder on PYTHONPATH, importing one of HIDDEN finds nothing unless it comes from a folder
in $E2E_ALLOW (colon separated: the unpacked bundle's site/ and the stubs).
"""
import os
import sys

HIDDEN = {"comfyui_frontend_package", "comfyui_workflow_templates", "comfyui_workflow_templates_core",
          "comfyui_embedded_docs", "alembic", "sqlalchemy", "mako", "av", "kornia", "kornia_rs", "spandrel",
          "pydantic", "pydantic_core", "pydantic_settings", "torchsde", "trampoline", "comfy_kitchen",
          "fa3_fwd_interface", "fa3_fwd", "fa3_fwd_config", "sageattention"}
ALLOW = tuple(p for p in os.environ.get("E2E_ALLOW", "").split(":") if p)


class _Hiding:
    def __init__(self, finder):
        self.finder = finder

    def __getattr__(self, name):
        return getattr(self.finder, name)

    def find_spec(self, name, path=None, target=None):
        spec = self.finder.find_spec(name, path, target)
        if spec is not None and name.split(".")[0] in HIDDEN:
            origin = spec.origin or next(iter(spec.submodule_search_locations or []), "")
            if not str(origin).startswith(ALLOW):  # an empty ALLOW allows nothing
                return None
        return spec


sys.meta_path[:] = [_Hiding(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
