"""Composition of our attention override with one already installed."""
import copy
import importlib.util

import torch
import torch.nn.functional as F

from bigdit.attention import Router
from bigdit.host import attention as override_module
from bigdit.host.attention import install, is_ours
from probes import snapshot

KEY = "optimized_attention_override"
HEADS = 2


def comfy_qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 16, HEADS * 64, generator=g) for _ in range(3))


def comfy_sdpa(q, k, v, heads, mask=None, **kwargs):
    """ComfyUI's attention_pytorch for (B, S, heads*D) without a mask."""
    b, _, inner = q.shape
    d = inner // heads
    q, k, v = (t.view(b, -1, heads, d).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, heads * d)


def call(options, *args, **kwargs):
    """What ComfyUI's wrap_attn does with an installed override."""
    return options[KEY](comfy_sdpa, *args, heads=HEADS, transformer_options=options, **kwargs)


class Foreign:
    """Another pack's override: runs its own attention on even calls and
    ComfyUI's (`func`) on odd ones, like per-step patches do."""

    def __init__(self):
        self.calls = 0
        self.funcs = []

    def __call__(self, func, q, k, v, heads, **kwargs):
        self.calls += 1
        self.funcs.append(func)
        if self.calls % 2:
            return func(q, k, v, heads, **kwargs)
        return comfy_sdpa(q, k, v, heads) * 0  # visibly its own


def test_install_on_an_empty_hook():
    options = {}
    router = Router("sdpa")
    hook, how = install(options, router)
    assert how == "installed" and options[KEY] is hook and hook.previous is None
    q, k, v = comfy_qkv()
    out = call(options, q, k, v)
    assert torch.equal(out, comfy_sdpa(q, k, v, HEADS))
    assert snapshot(router.stats)["calls"] == {"sdpa": 1}


def test_a_second_node_replaces_the_first_never_stacks():
    options = {}
    first, second = Router("sage"), Router("sdpa")
    install(options, first)
    hook, how = install(options, second)
    assert how == "replaced" and hook.previous is None
    call(options, *comfy_qkv())
    assert snapshot(first.stats)["calls"] == {}
    assert snapshot(second.stats)["calls"] == {"sdpa": 1}


def test_a_foreign_override_is_wrapped_and_keeps_deciding():
    foreign = Foreign()
    options = {KEY: foreign}
    router = Router("sdpa")
    hook, how = install(options, router)
    assert how == "wrapped" and hook.previous is foreign
    q, k, v = comfy_qkv()
    first, second = call(options, q, k, v), call(options, q, k, v)
    assert foreign.calls == 2
    assert foreign.funcs[0] == hook.attention  # its fallback is now our backend
    assert torch.equal(first, comfy_sdpa(q, k, v, HEADS))  # odd call: through us
    assert torch.equal(second, torch.zeros_like(second))  # even call: its own
    assert snapshot(router.stats)["calls"] == {"sdpa": 1}


def test_replacing_ours_keeps_the_foreign_override_it_wrapped():
    foreign = Foreign()
    options = {KEY: foreign}
    install(options, Router("sage"))
    router = Router("sdpa")
    hook, how = install(options, router)
    assert how == "replaced" and hook.previous is foreign
    call(options, *comfy_qkv())
    assert foreign.calls == 1 and snapshot(router.stats)["calls"] == {"sdpa": 1}


def test_clones_share_the_override():
    # ModelPatcher.clone deep-copies model_options
    options = {}
    hook, _ = install(options, Router("sdpa"))
    model_options = {"transformer_options": options}
    clone = copy.deepcopy(model_options)
    assert clone["transformer_options"][KEY] is hook


def test_the_router_reads_transformer_options_through_the_hook():
    """host/attention.py hands the router the keys of transformer_options it uses (the attention/ core reads
    none): the block a model reports and the sampler's step decide the dense schedule."""
    router = Router("sdpa", dense_backend="sdpa", dense_steps=1, dense_layers="7")
    options = {}
    install(options, router)
    sigmas = torch.tensor([1.0, 0.5, 0.0])
    q, k, v = comfy_qkv()
    for block, sigma in ((7, 0.5), (3, 1.0), (3, 0.5)):
        call(dict(options, block_index=block, sigmas=sigma * torch.ones(1), sample_sigmas=sigmas), q, k, v)
    assert snapshot(router.stats)["scheduled_dense"] == {"layer": 1, "step": 1}


def test_our_override_is_recognised_across_two_imports_of_the_pack():
    # ComfyUI imports the pack under its folder name, tests as `bigdit`: two module copies
    spec = importlib.util.spec_from_file_location(f"{override_module.__package__}.other_copy_override",
                                                  override_module.__file__)
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    options = {}
    theirs, _ = other.install(options, Router("sage"))
    assert type(theirs) is not override_module.AttentionOverride and is_ours(theirs)
    hook, how = install(options, Router("sdpa"))
    assert how == "replaced" and hook.previous is None
    assert not is_ours(Foreign())


def test_why_no_call_reached_the_override():
    """The `last run:` line of a sampling whose attention calls never reached our override."""
    def kj_like(func, *args, **kwargs):  # KJNodes' Sage patch: a new override that ignores `func`
        return comfy_sdpa(*args)

    options = {}
    hook, _ = install(options, Router("sage"))
    assert override_module.not_reached(kj_like, hook) == (
        "another node replaced this attention override "
        "(test_why_no_call_reached_the_override.<locals>.kj_like); its kernels did not run")
    assert override_module.not_reached(None, hook) == (
        "another node removed this attention override; its kernels did not run")
    assert override_module.not_reached(hook, hook) == (
        "no attention call reached this override (attention patched another way); its kernels did not run")
    wrapping, _ = install({KEY: Foreign()}, Router("sage"))
    assert override_module.not_reached(wrapping, wrapping) == (
        "the override it wraps (Foreign) never called it; its kernels did not run")
