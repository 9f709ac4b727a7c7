"""The optimizer registry: each entry's state size against the real optimizer, the paged-state report,
and re-paging after a resume."""

import pytest
import torch

from qlora_kit.memory.optimizers import (
    optimizer_class_and_kwargs,
    optimizer_state_report,
    repage_optimizer_state,
)
from qlora_kit.recipe.recipe import OptimizerSection
from qlora_kit.registries.optimizers import OPTIMIZERS, PAGEABLE_MIN_ELEMENTS


def test_pageable_report_follows_the_100k_element_rule():
    small = [torch.nn.Parameter(torch.zeros(16, 4096)) for _ in range(4)]  # 65,536: never paged
    large = [torch.nn.Parameter(torch.zeros(64, 4096)) for _ in range(2)]  # 262,144: paged
    report = optimizer_state_report(small + large, "paged_adamw_8bit")
    assert report.pageable_tensors == 2
    assert report.pageable_bytes == 2 * OPTIMIZERS["paged_adamw_8bit"].state_bytes(64 * 4096)
    assert report.resident_bytes == 4 * OPTIMIZERS["paged_adamw_8bit"].state_bytes(16 * 4096)
    assert optimizer_state_report(small, "paged_adamw_8bit").pageable_bytes == 0
    assert optimizer_state_report(large, "adamw_8bit").pageable_bytes == 0  # not a paged optimizer
    assert PAGEABLE_MIN_ELEMENTS == 100_000


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_registered_optimizer_holds_the_state_its_spec_predicts(name):
    """The registry's state bytes are what the real optimizer allocates (what the planner, the state
    report and the free-space check use), for a tensor kept 32-bit (< 4,096 elements) and an 8-bit one."""
    spec = OPTIMIZERS[name]
    optimizer_class, kwargs = optimizer_class_and_kwargs(
        OptimizerSection(name=name)
    )  # as the Trainer gets it
    for shape in [(64, 4096), (16, 128)]:
        param = torch.nn.Parameter(torch.randn(*shape))
        optimizer = optimizer_class([param], **kwargs)
        param.grad = torch.randn_like(param)
        optimizer.step()
        held = sum(
            t.nbytes for t in optimizer.state[param].values() if isinstance(t, torch.Tensor) and t.dim() > 0
        )
        assert held == spec.state_bytes(param.numel()), (name, shape)


def test_the_recipe_offers_exactly_the_registered_optimizers():
    from typing import get_args

    assert get_args(OptimizerSection.model_fields["name"].annotation) == tuple(OPTIMIZERS)
    assert {spec.paged for spec in OPTIMIZERS.values()} == {True, False}


def test_repaging_a_cpu_optimizer_changes_nothing():
    """On a CPU bitsandbytes pages nothing (get_state_buffer returns ordinary tensors): the resumed state
    stays as loaded. (On CUDA the same call moves it into paged memory: the GPU check counts it.)"""
    import bitsandbytes as bnb

    param = torch.nn.Parameter(torch.randn(512, 256))
    optimizer = bnb.optim.PagedAdamW8bit([param], lr=1e-3)
    param.grad = torch.randn_like(param)
    optimizer.step()
    before = {k: v.clone() for k, v in optimizer.state[param].items() if isinstance(v, torch.Tensor)}
    assert repage_optimizer_state(optimizer) == 0
    assert all(torch.equal(optimizer.state[param][k], v) for k, v in before.items())
