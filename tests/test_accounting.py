"""Memory accounting: saved-bytes counting on a module with a known answer."""

import torch

from qlora_kit.memory.accounting import OUTSIDE, SavedTensors


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
