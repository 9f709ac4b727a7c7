"""Memory accounting: saved-bytes counting on a module with a known answer, and the paged-state report."""

import torch

from qlora_kit.accounting import (
    OUTSIDE,
    PAGEABLE_MIN_ELEMENTS,
    SavedTensors,
    optimizer_state_report,
    state_bytes,
)


class TwoLayers(torch.nn.Module):
    """x -> relu(x @ W1) -> (. @ W2): saves x (for W1's grad), the relu output (for W2's grad and its own
    backward; one storage), and nothing for the parameters themselves."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 16, bias=False)
        self.second = torch.nn.Linear(16, 4, bias=False)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def test_counter_excludes_parameters_and_counts_shared_storage_once():
    module = TwoLayers()
    x = torch.randn(5, 8)
    counter = SavedTensors(module)
    with counter.counting():
        out = module(x).sum()
    out.backward()
    saved = counter.result()
    # x (5x8 fp32) and relu's output (5x16 fp32), which relu and the second matmul both save
    assert saved.total == 5 * 8 * 4 + 5 * 16 * 4
    assert saved.per_layer == {OUTSIDE: saved.total}


def test_counter_sees_a_view_through_its_whole_storage():
    weight = torch.nn.Parameter(torch.randn(4, 4))
    base = torch.randn(10, 4)
    module = torch.nn.Module()
    module.weight = weight
    counter = SavedTensors(module)
    with counter.counting():
        out = (base[:2] @ weight).sum() + (base[2:] @ weight).sum()
    out.backward()
    assert counter.result().total == base.nbytes  # two views, one storage


def test_pageable_report_follows_the_100k_element_rule():
    small = [torch.nn.Parameter(torch.zeros(16, 4096)) for _ in range(4)]  # 65,536: never paged
    large = [torch.nn.Parameter(torch.zeros(64, 4096)) for _ in range(2)]  # 262,144: paged
    report = optimizer_state_report(small + large, "paged_adamw_8bit")
    assert report.pageable_tensors == 2
    assert report.pageable_bytes == 2 * state_bytes(64 * 4096, eight_bit=True)
    assert report.resident_bytes == 4 * state_bytes(16 * 4096, eight_bit=True)
    assert optimizer_state_report(small, "paged_adamw_8bit").pageable_bytes == 0
    assert optimizer_state_report(large, "adamw_8bit").pageable_bytes == 0  # not a paged optimizer
    assert PAGEABLE_MIN_ELEMENTS == 100_000


def test_state_bytes_matches_bitsandbytes():
    import bitsandbytes as bnb

    for shape, eight_bit in [((64, 4096), True), ((16, 128), True), ((64, 4096), False)]:
        param = torch.nn.Parameter(torch.randn(*shape))
        optimizer = (bnb.optim.AdamW8bit if eight_bit else bnb.optim.AdamW32bit)([param], lr=1e-3)
        param.grad = torch.randn_like(param)
        optimizer.step()
        held = sum(
            t.nbytes for t in optimizer.state[param].values() if isinstance(t, torch.Tensor) and t.dim() > 0
        )
        assert held == state_bytes(param.numel(), eight_bit), shape
