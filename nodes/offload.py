"""SetOffload: the offload of host/offload.py on a clone of a MODEL."""
from __future__ import annotations

from comfy_api.latest import io

from ..host import categories
from ..host.offload import install_offload
from ..host.options import OFFLOAD_MODES
from ..host.report import node_output, show_on_node


class SetOffload(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="SetOffload",
            display_name="Set Offload",
            category=categories.MODEL_PATCHES,
            description=(
                "Plans the diffusion model's GPU memory for each run and streams the transformer blocks that do not "
                "fit from host memory, one block ahead of the compute, on a copy of the MODEL. Works on models from "
                "any loader. Where ComfyUI's dynamic VRAM already manages the weights, it only plans and reports."
            ),
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model. It is cloned, never changed."),
                io.Combo.Input(
                    "mode", options=list(OFFLOAD_MODES.values), default="auto",
                    tooltip="auto: keep everything on the GPU when it fits, else stream the blocks that do "
                            "not fit, one block ahead of the compute. none: everything on the GPU; fails with "
                            "the plan if it cannot fit."),
                io.Float.Input(
                    "reserve_gib", default=-1.0, min=-1.0, max=1024.0, step=0.1,
                    tooltip="GPU memory (GiB) to leave free for other programs. -1: ComfyUI's own reserve "
                            "(--reserve-vram)."),
                io.Float.Input(
                    "vram_gib", default=0.0, min=0.0, max=1024.0, step=0.5, optional=True,
                    tooltip="Plan as if the GPU had only this much memory (GiB), e.g. to share it or to try a "
                            "24 GB plan on a bigger card. 0: the memory ComfyUI reports free."),
            ],
            outputs=[
                io.Model.Output(display_name="model", tooltip="The model with offload installed (a clone)."),
                io.String.Output(display_name="report", tooltip="The memory plan: blocks resident and streamed, "
                                                                "the estimated peak against the budget."),
            ],
            hidden=[io.Hidden.unique_id],
        )

    # Naming an input here replaces ComfyUI's own min/max (or list) check of it, so it is checked here too (`mode`
    # is named so that an old value of a saved workflow still loads); NaN would pass every comparison.
    _RANGES = {"reserve_gib": (-1.0, 1024.0), "vram_gib": (0.0, 1024.0)}

    @classmethod
    def validate_inputs(cls, mode="auto", reserve_gib=-1.0, vram_gib=0.0):
        checks = (OFFLOAD_MODES.problem(mode), cls._out_of_range("reserve_gib", reserve_gib),
                  cls._out_of_range("vram_gib", vram_gib))
        return "; ".join(problem for problem in checks if problem) or True

    @classmethod
    def _out_of_range(cls, name, value):
        low, high = cls._RANGES[name]
        if not isinstance(value, (int, float)) or not low <= value <= high:  # False for NaN
            return f"{name} must be a number from {low:g} to {high:g}, got {value!r}"
        return None

    @classmethod
    def execute(cls, model, mode, reserve_gib, vram_gib=0.0):
        unique_id = cls.hidden.unique_id
        problem = cls._out_of_range("reserve_gib", reserve_gib) or cls._out_of_range("vram_gib", vram_gib)
        if problem:  # a value linked from another node is only known here
            raise ValueError(f"SetOffload: {problem}")
        patched = model.clone()
        report = install_offload(patched, mode, None if reserve_gib < 0 else reserve_gib, vram_gib=vram_gib or None,
                                 on_run=lambda line: show_on_node(unique_id, f"{report.brief}\nlast run: {line}"))
        return node_output("SetOffload", report.brief, report.full, (patched, report.full))


NODES = (SetOffload,)
