"""The dense schedule: which calls run the dense backend instead of Sol."""
import logging
import time

import pytest
import torch
import torch.nn.functional as F

from bigdit.attention import CallOptions, Router
from bigdit.attention.schedule import DenseSchedule, block_count, check_layers, parse_layers
from probes import snapshot

SIGMAS = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])


@pytest.mark.parametrize("text, blocks", [
    ("", set()), ("0,1", {0, 1}), (" 0, 1 ,47-49", {0, 1, 47, 48, 49}), ("5-3", {3, 4, 5}), ("2 7", {2, 7}),
    ("3-5, 4-9, 10", set(range(3, 11))),
])
def test_parse_layers(text, blocks):
    parsed = parse_layers(text)
    assert {b for b in range(64) if b in parsed} == blocks
    assert bool(parsed) == bool(blocks)


def test_parse_layers_keeps_huge_ranges_as_ranges():
    """A range is two numbers however wide: no 10^12 indices are built."""
    start = time.perf_counter()
    parsed = parse_layers("0-1000000000000, 7")
    assert time.perf_counter() - start < 0.1
    assert parsed.ranges == ((0, 1000000000000),)
    assert 0 in parsed and 10 ** 12 in parsed and 10 ** 12 + 1 not in parsed
    assert str(parse_layers("9, 0, 1, 47-49")) == "[0-1, 9, 47-49]"


@pytest.mark.parametrize("text, words", [
    ("a", "not a block index"), ("1.5", "not a block index"), ("-2", "not a block index"),
    ("1,,x", "not a block index"), ("1" * 19, "more than 18 digits"), (",".join(["1"] * 1025), "more than 1024"),
])
def test_parse_layers_rejects(text, words):
    with pytest.raises(ValueError, match=f"dense_layers: .*{words}"):
        parse_layers(text)


@pytest.mark.parametrize("sigma, step", [(1.0, 0), (0.75, 1), (0.6, 1), (0.25, 3), (0.7500001, 1)])
def test_step_from_sigmas(sigma, step):
    schedule = DenseSchedule(dense_steps=1)
    options = CallOptions(sigmas=torch.tensor([sigma, sigma]), sample_sigmas=SIGMAS)
    assert schedule.step(options) == step


@pytest.mark.parametrize("sigma", [1.0, 0.75, 0.6, 0.25, 0.7500001, 0.74999, 0.0, 2.0])
@pytest.mark.parametrize("dense_steps", [1, 2, 4])
def test_dense_step_tensor_agrees_with_step(sigma, dense_steps):
    """The step as torch.compile reads it (tensor arithmetic, no host sync) decides as the eager one does."""
    schedule = DenseSchedule(dense_steps=dense_steps)
    options = CallOptions(sigmas=torch.tensor([sigma, sigma]), sample_sigmas=SIGMAS)
    dense = schedule.dense_step(options)
    assert dense.dtype == torch.bool and dense.dim() == 0
    assert bool(dense) == (schedule.step(options) < dense_steps)


def qkv(t=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 2, t, 128, generator=g) for _ in range(3))


def sample(router, steps=4, blocks=3, cross=False):
    """Drive `router` like a sampler: per step one forward over `blocks`
    blocks of self-attention (and cross-attention to 64 text tokens).
    Returns {(step, block, kind): ran SDPA exactly?}."""
    q, k, v = qkv()
    text_k, text_v = qkv(t=64, seed=1)[:2]
    dense_self = F.scaled_dot_product_attention(q, k, v)
    ran_dense = {}
    for step in range(steps):
        router.begin_forward()
        options = CallOptions(sigmas=SIGMAS[step:step + 1], sample_sigmas=SIGMAS)
        for block in range(blocks):
            out = router(q, k, v, options=options)
            ran_dense[step, block, "self"] = torch.equal(out, dense_self)
            if cross:
                router(q, text_k, text_v, options=options)
    return ran_dense


@pytest.mark.kitchen_feature("sol_attn")
def test_dense_steps_and_layers_route_to_the_dense_backend():
    router = Router("sol", dense_backend="sdpa", sol_tau=2.0, dense_steps=2, dense_layers="1",
                    sol_min_tokens=0)
    ran_dense = sample(router, cross=True)
    for (step, block, _), dense in ran_dense.items():
        assert dense == (step < 2 or block == 1), (step, block)
    stats = snapshot(router.stats)
    # block 1 by layer every step (self + cross); blocks 0 and 2 by step in steps 0-1
    assert stats["scheduled_dense"] == {"layer": 8, "step": 8}
    assert stats["calls"] == {"sol": 4, "sdpa": 20}
    # the remaining cross-attention calls fall back, Sol takes no cross-attention
    assert sum(stats["fallbacks"].values()) == 4


@pytest.mark.kitchen_feature("sol_attn")
def test_block_counting_restarts_with_each_forward():
    router = Router("sol", dense_backend="sdpa", sol_tau=2.0, dense_layers="1", sol_min_tokens=0)
    ran_dense = sample(router, steps=2, cross=True)
    assert [ran_dense[s, b, "self"] for s in range(2) for b in range(3)] == [False, True, False] * 2
    router = Router("sol", dense_backend="sdpa", sol_tau=2.0, dense_layers="1", sol_min_tokens=0)
    router.schedule.begin_forward = lambda: None  # without the per-forward reset, blocks count on
    ran_dense = sample(router, steps=2)
    assert [ran_dense[s, b, "self"] for s in range(2) for b in range(3)] == [False, True] + [False] * 4


@pytest.mark.kitchen_feature("sol_attn")
def test_block_index_reported_by_the_model_wins():
    router = Router("sol", dense_backend="sdpa", sol_tau=2.0, dense_layers="7", sol_min_tokens=0)
    q, k, v = qkv()
    dense = F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(router(q, k, v, options=CallOptions(block_index=7)), dense)
    assert not torch.equal(router(q, k, v, options=CallOptions(block_index=0)), dense)
    assert snapshot(router.stats)["scheduled_dense"] == {"layer": 1}


@pytest.mark.kitchen_feature("sol_attn")
def test_no_step_information_warns_once_and_runs_sol(caplog):
    router = Router("sol", dense_backend="sdpa", sol_tau=2.0, dense_steps=3, sol_min_tokens=0)
    q, k, v = qkv()
    with caplog.at_level(logging.WARNING, logger="bigdit.attention.schedule"):
        for _ in range(3):
            router(q, k, v, options=CallOptions())
    assert len([r for r in caplog.records if "dense_steps is not applied" in r.getMessage()]) == 1
    assert snapshot(router.stats)["calls"] == {"sol": 3}


def test_schedule_applies_to_any_backend():
    router = Router("sage", dense_backend="sdpa", dense_steps=1)
    ran_dense = sample(router, steps=2, blocks=1)
    assert all(ran_dense.values())  # on CPU sage falls back; SDPA either way
    stats = snapshot(router.stats)
    assert stats["scheduled_dense"] == {"step": 1}
    assert sum(stats["fallbacks"].values()) == 1  # only the step-1 call tried sage


def test_negative_dense_steps_rejected():
    with pytest.raises(ValueError, match="dense_steps"):
        Router("sol", dense_steps=-1)


@pytest.mark.parametrize("dense_steps, text", [(0, "dense steps none"), (1, "dense step 0"), (3, "dense steps 0-2")])
def test_dense_steps_read_as_counted(dense_steps, text):
    described = Router("sol", "sdpa", dense_steps=dense_steps).describe()
    assert described == f"backend sol, tau 1, dense sdpa, {text}"
    # other backends name their dense steps only when there are some
    assert (text in Router("sage", "sdpa", dense_steps=dense_steps).describe()) == (dense_steps > 0)


@pytest.mark.parametrize("text, count, message", [
    ("999", 2, "dense_layers: 999 out of range; this model has 2 transformer blocks (blocks 0-1)"),
    ("0, 1-1000000000000", 2, "dense_layers: 2-1000000000000 out of range; this model has 2 transformer blocks"),
    ("0", 0, "dense_layers: 0 out of range; this model has 0 transformer blocks (no blocks)"),
])
def test_check_layers_refuses_blocks_the_model_lacks(text, count, message):
    with pytest.raises(ValueError) as info:
        check_layers(parse_layers(text), count)
    assert str(info.value).startswith(message)


def test_check_layers_accepts_blocks_the_model_has():
    for text in ("", "0", "0-1", "1, 0"):
        check_layers(parse_layers(text), 2)


def test_block_count_reads_the_top_level_block_lists():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.double_blocks = torch.nn.ModuleList(torch.nn.Linear(1, 1) for _ in range(3))
            self.single_blocks = torch.nn.ModuleList(torch.nn.Linear(1, 1) for _ in range(5))
            self.refiner = torch.nn.Module()
            self.refiner.blocks = torch.nn.ModuleList(torch.nn.Linear(1, 1) for _ in range(9))  # not top level
            self.layers = torch.nn.ModuleList(torch.nn.Linear(1, 1) for _ in range(7))  # not named blocks
    assert block_count(Model()) == 5
    assert block_count(torch.nn.Linear(1, 1)) is None


@pytest.mark.parametrize("tau", [float("nan"), float("inf"), "1"])
def test_router_refuses_a_tau_that_is_no_finite_number(tau):
    with pytest.raises(ValueError, match="sol_tau must be a finite number"):
        Router("sol", sol_tau=tau)
