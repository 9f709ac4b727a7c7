"""The parts of out-of-memory recovery that need no training: splitting a micro-batch, the fault
injector's real error, the checkpoint's split file and how ``qlora-kit show`` reports a split
(tests/e2e/test_oom.py trains)."""

import contextlib
import gc
import logging
import sys
import weakref

import pytest
import torch

from qlora_kit import Recipe
from qlora_kit.memory.accounting import SavedTensors
from qlora_kit.registries import metric_keys as keys
from qlora_kit.testing import oom_faults
from qlora_kit.training.run_folder.run_record import oom_rows
from qlora_kit.training.step.oom.autocast_state import AutocastState, autocast_kept
from qlora_kit.training.step.oom.policy import oom_policy
from qlora_kit.training.step.oom.rows import split_rows, tokens_of
from qlora_kit.training.step.oom.split_file import read_split, write_split


def padded_batch() -> dict:
    lengths = [3, 5, 2, 7, 4, 4, 6, 1]
    mask = torch.tensor([[1] * n + [0] * (7 - n) for n in lengths])
    ids = torch.arange(8 * 7).reshape(8, 7) * mask
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "return_loss": True}


def test_a_split_keeps_every_row_in_order_and_cuts_each_part_to_its_longest_row():
    batch = padded_batch()
    first, second = split_rows(batch, 2, trim=True)
    assert first["input_ids"].shape == (4, 7) and second["input_ids"].shape == (4, 6)
    assert torch.equal(second["labels"], batch["labels"][4:, :6])
    assert first["return_loss"] is second["return_loss"] is True  # what is not per row goes to every part
    assert sum(tokens_of(p) for p in (first, second)) == tokens_of(batch)
    untrimmed = split_rows(batch, 4, trim=False)
    assert torch.equal(torch.cat([p["input_ids"] for p in untrimmed]), batch["input_ids"])
    assert len(split_rows(batch, 16, trim=False)) == 8  # never an empty part


def test_the_fault_injector_raises_a_real_out_of_memory_error_past_its_cap(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    x = torch.randn(32, 16)
    monkeypatch.setenv(oom_faults.ENV, str(10**12))
    oom_faults.reload_cap()
    counter = SavedTensors(model, step=True)
    with counter.counting():
        model(x).sum()
    saved = counter.result().total
    monkeypatch.setenv(oom_faults.ENV, str(saved - 1))
    oom_faults.reload_cap()
    with (
        pytest.raises(torch.OutOfMemoryError, match="forward"),
        SavedTensors(model, step=True).counting(),
    ):
        model(x).sum()
    with SavedTensors(model).counting():  # the planner's and measurements' counts never raise
        model(x).sum()
    monkeypatch.delenv(oom_faults.ENV)
    oom_faults.reload_cap()


def test_the_split_is_written_into_a_checkpoint_and_read_back(tmp_path):
    assert read_split(tmp_path) == (1, 1)  # a checkpoint of a run never split has no file
    write_split(tmp_path, 4, 2)
    assert read_split(tmp_path) == (4, 2)


def test_show_says_where_the_micro_batch_was_split():
    metrics = [
        {"step": 3, "loss": 1.0},
        {"step": 4, keys.OOM_SPLIT: {"phase": "train", keys.MICRO_BATCH_BEFORE: 8, keys.MICRO_BATCH: 4,
                                    keys.MICRO_BATCH_PARTS: 2}},
    ]  # fmt: skip
    assert oom_rows(metrics) == [
        ("out of memory", "step 4: micro-batch 8 -> 4 (2 parts), the same global batch")
    ]


def test_under_fsdp_split_falls_back_to_stop_with_one_warning(caplog):
    # FSDP's gathers run inside the passes: the processes cannot agree on a split (oom_recovery.py)
    fsdp = {
        "train": {"fsdp": True},
        "optimizer": {"name": "adamw_torch"},
        "quant": {"quant_storage": "bfloat16"},
    }
    with caplog.at_level(logging.WARNING, logger="qlora_kit.training.step.oom.policy"):
        assert oom_policy(Recipe.from_dict(fsdp)).on_oom == "stop"
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("train.on_oom: split is not available under FSDP")
    assert oom_policy(Recipe.from_dict({})).on_oom == "split"  # one process, DDP: the default stays
    with caplog.at_level(logging.WARNING, logger="qlora_kit.training.step.oom.policy"):
        caplog.clear()
        stop = fsdp | {"train": {"fsdp": True, "on_oom": "stop"}}
        assert (
            oom_policy(Recipe.from_dict(stop)).on_oom == "stop" and not caplog.records
        )  # asked for: no warning


def test_a_forward_pass_dropped_before_backward_frees_what_it_saved():
    """The H200's unrecovered out-of-memory error: ``SavedTensors`` held each saved tensor with its
    autograd node, and a saved output (exp, sigmoid, rsqrt save theirs) then forms a cycle through C++
    that only a backward pass breaks. A forward pass stopped by an error kept its whole graph alive."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Sigmoid(), torch.nn.Linear(64, 16))
    x = torch.randn(32, 16)

    def forward_without_backward() -> weakref.ref:
        with SavedTensors(model).counting():
            hidden = model[1](model[0](x))  # sigmoid saves its output for backward
            model[2](hidden).exp().sum()
        return weakref.ref(hidden)

    kept = forward_without_backward()
    gc.collect()
    assert kept() is None


@contextlib.contextmanager
def autocast_without_finally():
    """accelerate 1.10.1's ``Accelerator.autocast`` as shipped (our floor; TRL's GRPO, DPO and KTO losses
    run under it): torch's autocast entered before the ``yield`` and left after it, with no ``finally``."""
    context = torch.autocast("cpu", dtype=torch.bfloat16)
    context.__enter__()
    yield
    context.__exit__(*sys.exc_info())


def test_an_error_inside_a_leaking_autocast_leaves_autocast_and_its_casts_as_they_were():
    """An attempt that fails inside such a context left autocast on and one deep for the rest of the
    process, so its cache of casts was never emptied: every later forward pass ran on the 16-bit copy of
    a LoRA weight cast before the error, whatever the optimizer wrote since (CI's floors stage, torch
    2.7: the guard found every LoRA A without a gradient at step 3)."""
    before = AutocastState.now()
    weight = torch.zeros(4, 4, requires_grad=True)  # a LoRA B before its first step

    def forward() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (torch.ones(2, 4) @ weight).sum()

    with pytest.raises(torch.OutOfMemoryError), autocast_kept(), autocast_without_finally():
        forward()  # the weight cast (zeros), then the attempt fails inside accelerate's context
        raise torch.OutOfMemoryError("the attempt's allocation")
    assert AutocastState.now() == before
    with torch.no_grad():
        weight += 1  # the optimizer's step
    assert forward().item() == 32, "the forward pass ran on the weight cast before the step"
