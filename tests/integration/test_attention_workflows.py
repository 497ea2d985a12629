"""SetAttentionBackend in a real ComfyUI 0.3.75, on the tiny Wan models.

Runs on a second server started with --use-pytorch-cross-attention: on CPU
ComfyUI's own default is sub-quadratic attention (SDPA only on GPUs), and the
`sdpa` backend can only reproduce a baseline that also ran SDPA. On CPU every
other backend falls back to SDPA too, so every value must reproduce the
baseline exactly, with one warning per fallback reason.
"""
import re

import pytest
import torch

from comfy_harness import ComfyServer, PromptError, combo_options
from graphs import chain_id, wan_t2v_graph
from report_events import ReportEvents

pytestmark = pytest.mark.integration

NODE = "SetAttentionBackend"


def sdpa_server(comfy, tiny_wan, tiny_wan2, folder, env=None):
    server = ComfyServer(folder, comfy.host, extra_args=["--use-pytorch-cross-attention"], env=env)
    for sub, name in (("diffusion_models", tiny_wan["unet_name"]), ("diffusion_models", tiny_wan2["unet_name"]),
                      ("vae", tiny_wan["vae_name"])):
        (server.models_dir / sub / name).symlink_to(comfy.models_dir / sub / name)
    return server


@pytest.fixture(scope="module")
def comfy_sdpa(comfy, tiny_wan, tiny_wan2, tmp_path_factory):
    server = sdpa_server(comfy, tiny_wan, tiny_wan2, tmp_path_factory.mktemp("comfy_sdpa"))
    yield server
    server.stop()


def run(server, tiny, chain=(), seed=5):
    """(latent, the log this prompt wrote)."""
    start = len(server.log_text())
    history = server.run(wan_t2v_graph(tiny["unet_name"], tiny["vae_name"], model_chain=list(chain), seed=seed))
    return server.latent(history, "save_latent"), server.log_text()[start:]


def node(backend, **inputs):
    return (NODE, {"backend": backend, **inputs})


def summary(log):
    (line,) = re.findall(r"Set Attention Backend \(.*\): ran .*", log)
    return line


@pytest.fixture(scope="module")
def baseline(comfy_sdpa, tiny_wan):
    return run(comfy_sdpa, tiny_wan)[0]


def test_object_info_lists_the_node(comfy):
    info = comfy.object_info()[NODE]
    assert info["category"] == "model/patch" and info["output"] == ["MODEL"]
    assert info["description"]
    required, optional = info["input"]["required"], info["input"]["optional"]
    assert combo_options(required["backend"]) == ["auto", "sdpa", "kitchen_int8", "flash", "sage", "fa3_fp8", "sol"]
    assert combo_options(optional["dense_backend"]) == ["auto", "sdpa", "kitchen_int8", "flash", "sage", "fa3_fp8"]
    assert optional["sol_tau"][0] == "FLOAT" and optional["sol_tau"][1]["default"] == 1.0
    assert optional["dense_steps"][0] == "INT" and optional["dense_steps"][1]["default"] == 0
    assert optional["dense_layers"][0] == "STRING" and optional["dense_layers"][1]["default"] == ""
    for spec in (*required.values(), *optional.values()):
        assert spec[1].get("tooltip"), spec


# backend -> the fallback reasons it must warn about on CPU (once each)
CPU_FALLBACKS = {
    "auto": [],
    "sdpa": [],
    "flash": ["needs cuda, got a cpu tensor"],
    "sage": ["needs cuda, got a cpu tensor"],
    "kitchen_int8": ["needs cuda, got a cpu tensor"],
    "fa3_fp8": ["needs cuda, got a cpu tensor"],
    "sol": ["fewer than 12288 tokens", "query and key lengths differ (cross-attention)"],
}
# Sol's self-attention reason where the host's comfy-kitchen (0.33.0 pins 0.2.31) has no sol_attn
NO_KITCHEN_SOL = "has no sol_attn (a newer comfy-kitchen has it"


def cpu_fallbacks(host, backend):
    reasons = CPU_FALLBACKS[backend]
    if backend == "sol" and not host.features()["kitchen_sol"]:
        reasons = [NO_KITCHEN_SOL if r.startswith("fewer than") else r for r in reasons]
    return reasons


@pytest.mark.parametrize("backend", list(CPU_FALLBACKS))
def test_every_backend_runs_the_tiny_wan(comfy_sdpa, tiny_wan, baseline, backend):
    latent, log = run(comfy_sdpa, tiny_wan, [node(backend)])
    assert torch.equal(latent, baseline)
    line = summary(log)
    # 2 steps at cfg 1: one forward each, one self- and one cross-attention
    ran = "ran sdpa x4" if backend == "sdpa" else "ran auto:sdpa x4"
    assert ran in line, line
    warnings = re.findall(rf"\[BigDiT\] attention: {backend} cannot take this call \((.*)\); running", log)
    expected = cpu_fallbacks(comfy_sdpa.host, backend)
    assert len(warnings) == len(expected), warnings
    for reason in expected:
        assert sum(reason in w for w in warnings) == 1, (reason, warnings)


def test_sdpa_is_close_to_comfyui_cpu_default(comfy, tiny_wan):
    # the default server runs ComfyUI's sub-quadratic attention on CPU
    base = comfy.latent(comfy.run(wan_t2v_graph(tiny_wan["unet_name"], tiny_wan["vae_name"], seed=5)), "save_latent")
    ours = comfy.latent(comfy.run(wan_t2v_graph(tiny_wan["unet_name"], tiny_wan["vae_name"], seed=5,
                                                model_chain=[node("sdpa")])), "save_latent")
    torch.testing.assert_close(ours, base, atol=1e-4, rtol=0)  # measured 1.7e-6


def test_dense_schedule_in_a_real_model(comfy_sdpa, tiny_wan2):
    # 2 blocks, Wan reports no block index: blocks are counted per forward.
    # step 0: all 4 calls dense (block 0 by step, block 1 by layer);
    # step 1: block 1 by layer, block 0 tries sage and falls back on CPU.
    latent, log = run(comfy_sdpa, tiny_wan2, [node("sage", dense_steps=1, dense_layers="1")])
    assert torch.isfinite(latent).all()
    line = summary(log)
    assert "ran auto:sdpa x8" in line, line
    assert "scheduled dense layer x4, step x2" in line, line
    assert re.search(r"sage -> auto:sdpa: needs cuda, got a cpu tensor x2", line), line


def test_a_second_node_replaces_the_first(comfy_sdpa, tiny_wan, baseline):
    latent, log = run(comfy_sdpa, tiny_wan, [node("sage"), node("sdpa")])
    assert torch.equal(latent, baseline)
    assert "replaced an earlier Set Attention Backend" in log
    assert "ran sdpa x4" in summary(log)
    assert "sage cannot take this call" not in log  # the first one never runs


def test_bad_dense_layers_is_a_node_error(comfy_sdpa, tiny_wan):
    with pytest.raises(PromptError, match="dense_layers"):
        run(comfy_sdpa, tiny_wan, [node("sol", dense_layers="first")])


@pytest.mark.parametrize("layers, beyond", [("999", "999"), ("0-1000000000000", "2-1000000000000")])
def test_dense_layers_beyond_the_model_is_refused(comfy_sdpa, tiny_wan2, layers, beyond):
    """The block count is known once the node has the model: the node's run fails naming the input.
    '0-1000000000000' costs two numbers, not 10^12 indices."""
    graph = wan_t2v_graph(tiny_wan2["unet_name"], tiny_wan2["vae_name"], seed=5,
                          model_chain=[node("sage", dense_backend="sdpa", dense_layers=layers)])
    with pytest.raises(PromptError) as info:
        comfy_sdpa.run(graph, timeout=60)
    assert info.value.node_type == NODE
    assert (f"dense_layers: {beyond} out of range; this model has 2 transformer blocks (blocks 0-1)"
            in info.value.message), info.value.message


@pytest.mark.parametrize("tau", [float("nan"), 4.5])
def test_bad_sol_tau_is_a_validation_error(comfy_sdpa, tiny_wan, tau):
    """NaN passes ComfyUI's min/max check; the node's own validation names it before anything runs."""
    graph = wan_t2v_graph(tiny_wan["unet_name"], tiny_wan["vae_name"], model_chain=[node("sol", sol_tau=tau)])
    with pytest.raises(PromptError) as info:
        comfy_sdpa.run(graph)
    assert "sol_tau must be a number from 0 to 4" in info.value.message, info.value.message
    assert info.value.node_errors and not info.value.node_type  # refused at validation, not while running


def test_choice_is_shown_on_the_node(comfy_sdpa, tiny_wan):
    graph = wan_t2v_graph(tiny_wan["unet_name"], tiny_wan["vae_name"],
                          model_chain=[node("sol", dense_backend="sdpa", dense_steps=1, dense_layers="0")])
    text = comfy_sdpa.run(graph)["outputs"]["m0"]["text"][0]
    assert text == "attention: backend sol, tau 1, dense sdpa, dense step 0, dense blocks [0]"


def test_sol_really_runs_in_the_tiny_wan(comfy, tiny_wan, tiny_wan2, baseline, tmp_path):
    """With Sol's minimum length lowered, its self-attention runs on comfy-kitchen's eager reference
    (dense on CPU: close to SDPA, not bit-identical); cross-attention, which Sol cannot take, falls back.
    Where the host's comfy-kitchen has no sol_attn, every call falls back to SDPA, saying why."""
    server = sdpa_server(comfy, tiny_wan, tiny_wan2, tmp_path, env={"BIGDIT_SOL_MIN_TOKENS": "0"})
    try:
        latent, log = run(server, tiny_wan, [node("sol", dense_backend="sdpa")])
    finally:
        server.stop()
    line = summary(log)
    if not comfy.host.features()["kitchen_sol"]:
        assert "ran sdpa x4" in line, line
        warnings = re.findall(r"\[BigDiT\] attention: sol cannot take this call \((.*)\); running", log)
        assert len(warnings) == 2 and NO_KITCHEN_SOL in warnings[0], warnings
        assert warnings[1] == "query and key lengths differ (cross-attention)", warnings
        assert torch.equal(latent, baseline)
        return
    assert "ran sol x2, sdpa x2" in line, line
    assert "fewer than" not in log
    warnings = re.findall(r"\[BigDiT\] attention: sol cannot take this call \((.*)\); running", log)
    assert warnings == ["query and key lengths differ (cross-attention)"], warnings
    assert not torch.equal(latent, baseline)
    assert ((latent - baseline).norm() / baseline.norm()).item() < 1e-3


# ---- the `last run:` line when another node takes the attention over --------------

REPLACE = ("BigditReplaceAttention", {})  # as KJNodes' Sage patch: a new override that ignores `func`
REPLACEMENT = "BigditReplaceAttention.patch.<locals>.attention_override_replacement"
# Each test below gives sol_tau (unused by sage) its own value: ComfyUI then runs the node afresh
# instead of reusing another test's output, so its router has warned about nothing yet.


@pytest.fixture
def events(comfy_sdpa):
    with ReportEvents(comfy_sdpa.url) as listener:
        yield listener


def last_run(events, text_start, index=0):
    """The `last run:` line the SetAttentionBackend at model_chain[index] sent, after its report's text."""
    text = events.wait_for(chain_id(index), "last run:")
    assert text.startswith(text_start), text
    return text.split("\nlast run: ", 1)[1]


def test_last_run_line_reports_the_kernels_that_ran(comfy_sdpa, tiny_wan, events):
    run(comfy_sdpa, tiny_wan, [node("sage", dense_backend="sdpa", sol_tau=0.5)], seed=6)
    line = last_run(events, "attention: backend sage, dense sdpa")
    assert line == "ran sdpa x4; fallbacks sage -> sdpa: needs cuda, got a cpu tensor x4; scheduled dense none", line


def test_an_override_installed_after_the_node_is_reported_not_counted(comfy_sdpa, tiny_wan, baseline, events):
    latent, log = run(comfy_sdpa, tiny_wan, [node("sage", dense_backend="sdpa", sol_tau=0.75), REPLACE])
    assert torch.equal(latent, baseline)  # the replacement ran ComfyUI's SDPA, as the baseline did
    line = last_run(events, "attention: backend sage, dense sdpa")
    assert line == f"another node replaced this attention override ({REPLACEMENT}); its kernels did not run", line
    assert "sage cannot take this call" not in log  # never called, so no fallback either
    assert not re.findall(r"Set Attention Backend \(.*\): ran ", log)
    assert "Set Attention Backend (backend sage, dense sdpa): another node replaced" in log


def test_a_wrapped_override_that_never_falls_back_is_reported(comfy_sdpa, tiny_wan, baseline, events):
    """Installed after the other override, the node wraps it; an override that ignores its `func` decides
    every call, so none reaches this node's kernels."""
    latent, log = run(comfy_sdpa, tiny_wan, [REPLACE, node("sage", dense_backend="sdpa", sol_tau=1.25)])
    assert torch.equal(latent, baseline)
    line = last_run(events, "attention: backend sage, dense sdpa; wrapping the existing override", index=1)
    assert line == f"the override it wraps ({REPLACEMENT}) never called it; its kernels did not run", line
    assert "sage cannot take this call" not in log
