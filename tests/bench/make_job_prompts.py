"""Write the whole-job benchmark's API prompts (tests/bench/job_prompts/), as ComfyUI's front end queues them.

    python tests/bench/make_job_prompts.py

Comfy-Org's MiniMax-H3 text-to-video template (tests/fixtures/comfy_templates/video_minimax_h3_t2v.json) and the
pack's version of it (example_workflows/bigdit-minimax-h3-t2v.json), each with its subgraph's `turbo_mode` off
(the template's default: 20 steps, no LoRA) and on (`turbo_steps` 8 with the 8-step turbo LoRA), are loaded into
upstream ComfyUI 0.33.0's own front end in headless Chromium (tests/workflow_ui.py) as a user's drag-and-drop
would, and graphToPrompt gives the API prompt: <template|pack>_<default|turbo>.json. Everything else stays as
the workflows have it (resolution 864x480 from the Resolution Selector's 0.4 MP, 5 s = 124 frames, the seed).
Needs /usr/bin/chromium and the 0.33.0 host of .ci/setup_env.sh.
"""
import copy
import json
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

import template_workflows  # noqa: E402
from browser import Browser  # noqa: E402
from comfy_harness import HOSTS, ComfyServer  # noqa: E402
from make_example_workflows import placeholder_template_files  # noqa: E402
from workflow_ui import load_ui_workflow, open_comfy  # noqa: E402

OUT = BENCH / "job_prompts"
WORKFLOWS = {"template": template_workflows.TEMPLATES / "video_minimax_h3_t2v.json",
             "pack": BENCH.parents[1] / "example_workflows" / "bigdit-minimax-h3-t2v.json"}
SETTINGS = {"default": False, "turbo": True}
TURBO_INPUT = "value"  # the subgraph input shown as `turbo_mode`


def with_turbo(workflow: dict, on: bool) -> dict:
    """The workflow with its subgraph node's `turbo_mode` widget set, as a user's click leaves it saved."""
    workflow = copy.deepcopy(workflow)
    graph = template_workflows.the_graph(workflow)
    names = [entry["name"] for entry in template_workflows.promoted_inputs(graph.subgraph)]
    instance = template_workflows.instance_of(workflow, graph.subgraph)
    instance["widgets_values"][names.index(TURBO_INPUT)] = on
    if "widgets_values_named" in instance:
        instance["widgets_values_named"][TURBO_INPUT] = on
    return workflow


def main():
    host = next(h for h in HOSTS if h.version == "0.33.0")
    OUT.mkdir(exist_ok=True)
    workflows = {name: json.loads(path.read_text()) for name, path in WORKFLOWS.items()}
    with tempfile.TemporaryDirectory(prefix="bigdit-job-prompts-") as base:
        placeholder_template_files(Path(base), workflows.values())
        with ComfyServer(base, host) as server, Browser(width=1600, height=1000, timeout=60) as browser:
            open_comfy(browser, server.url)
            for name, workflow in workflows.items():
                for setting, on in SETTINGS.items():
                    prompt = load_ui_workflow(browser, with_turbo(workflow, on))
                    path = OUT / f"{name}_{setting}.json"
                    path.write_text(json.dumps(prompt, indent=1) + "\n")
                    print(f"wrote {path.relative_to(BENCH.parents[1])}: {len(prompt)} nodes")


if __name__ == "__main__":
    main()
