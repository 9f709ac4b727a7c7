"""A model's mode around inference (model/modes.py): eval for the block, the mode it had after, even when
the block raises."""

import pytest
import torch

from qlora_kit.model.modes import in_eval_mode


@pytest.mark.parametrize("training", [True, False])
def test_the_block_runs_in_eval_mode_and_the_module_gets_its_mode_back(training):
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).train(training)
    with in_eval_mode(module) as inside:
        assert inside is module
        assert not module.training and not module[1].training
    assert module.training is training and module[1].training is training


def test_the_mode_comes_back_when_the_block_raises():
    module = torch.nn.Dropout(0.5).train()
    with pytest.raises(RuntimeError, match="boom"), in_eval_mode(module):
        raise RuntimeError("boom")
    assert module.training
