"""GRPO's out-of-memory recovery without training (training/objectives/grpo/oom.py): a rollout measured and split
like a micro-batch, the parts' losses adding up for TRL's loss types, the generation cap of the fault
injector, the split file's generation parts (tests/e2e/test_grpo_oom.py trains)."""

from types import SimpleNamespace

import pytest
import torch

from qlora_kit.testing import oom_faults
from qlora_kit.training.objectives.grpo.oom import MEAN_OVER, GrpoOomRecovery
from qlora_kit.training.step.oom.failure import Failure, stop_message
from qlora_kit.training.step.oom.policy import OomPolicy
from qlora_kit.training.step.oom.rows import rows_of, split_rows, tokens_of, width_of
from qlora_kit.training.step.oom.split_file import read_generation_parts, read_split, write_split


def rollout() -> dict:
    """What TRL's _generate_and_score_completions hands the policy step: 8 completions, prompts left-padded
    to 4 tokens, completions right-padded to 3."""
    prompt_lengths, completion_lengths = [4, 2, 3, 4, 1, 4, 2, 3], [3, 1, 2, 3, 3, 2, 1, 3]
    prompt_mask = torch.tensor([[0] * (4 - n) + [1] * n for n in prompt_lengths])
    completion_mask = torch.tensor([[1] * n + [0] * (3 - n) for n in completion_lengths])
    return {
        "prompt_ids": torch.arange(32).reshape(8, 4) * prompt_mask,
        "prompt_mask": prompt_mask,
        "completion_ids": torch.arange(24).reshape(8, 3) * completion_mask,
        "completion_mask": completion_mask,
        "advantages": torch.linspace(-1, 1, 8),
        "num_items_in_batch": completion_mask.sum(),
    }


def test_a_rollout_is_measured_and_split_like_a_micro_batch():
    # GRPO's out-of-memory error used to end in AttributeError here (tokens_of was handed prompt rows)
    batch = rollout()
    assert rows_of(batch) == 8 and width_of(batch) == 7
    assert tokens_of(batch) == 23 + 18
    first, second = split_rows(batch, 2, trim=True)
    assert torch.equal(torch.cat([first["advantages"], second["advantages"]]), batch["advantages"])
    assert first["num_items_in_batch"] is batch["num_items_in_batch"]  # the whole batch's, in every part
    assert tokens_of(first) + tokens_of(second) == tokens_of(batch)
    line = stop_message(
        3, "micro-batch 1 of the step", first, OomPolicy(levers="LEVERS"), Failure("e", "f"), "K"
    )
    assert "a micro-batch of 4 rows, " in line and "(4 x 7)" in line and "LEVERS" in line


def trl_loss(
    loss_type: str, per_token: torch.Tensor, mask: torch.Tensor, num_items: torch.Tensor
) -> torch.Tensor:
    """TRL 1.16's GRPOTrainer._compute_loss reductions (one process, accumulation 1)."""
    if loss_type in ("grpo", "sapo"):
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * per_token.size(1))
    if loss_type == "luspo":
        return (per_token * mask).sum(-1).mean()
    return (per_token * mask).sum() / num_items.clamp(min=1.0)  # dapo, cispo, vespo


@pytest.mark.parametrize("loss_type", [*MEAN_OVER, "dapo", "cispo", "vespo"])
def test_the_parts_losses_weighted_by_their_share_add_up_to_the_micro_batchs(loss_type):
    batch = rollout()
    per_token = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    batch["per_token"] = per_token
    whole = trl_loss(loss_type, per_token, batch["completion_mask"], batch["num_items_in_batch"])
    recovery = GrpoOomRecovery(SimpleNamespace(loss_type=loss_type), OomPolicy(), probe=False)
    recovery.in_parts, recovery.parts = batch, 4
    total = sum(
        recovery.part_share(part)
        * trl_loss(loss_type, part["per_token"], part["completion_mask"], part["num_items_in_batch"])
        for part in split_rows(batch, 4, trim=True)
    )
    assert total == pytest.approx(float(whole), rel=1e-6)


def test_the_generation_cap_raises_a_real_out_of_memory_error_as_the_cache_grows(monkeypatch):
    monkeypatch.setenv(oom_faults.GENERATION_ENV, str(40 * 1024))
    injector = oom_faults.reload_cap()
    weight = torch.randn(64, 64)
    injector.watch(torch.nn.Linear(1, 1))
    cache = torch.zeros(8, 0, 64)
    with torch.no_grad(), pytest.raises(torch.OutOfMemoryError, match="generation"), injector.generation():
        for _ in range(100):  # a KV cache one token longer each step: 2 KiB more per step
            token = torch.randn(8, 1, 64) @ weight
            cache = torch.cat([cache, token], dim=1)
    assert 40 * 1024 < injector.generation_peaks[-1] < 60 * 1024
    monkeypatch.delenv(oom_faults.GENERATION_ENV)
    assert oom_faults.reload_cap().generation_cap is None
    with injector.generation():  # unset: nothing counted, nothing raised
        torch.cat([torch.zeros(10**6), torch.zeros(10**6)])


def test_the_generation_split_is_written_into_a_checkpoint_and_read_back(tmp_path):
    assert read_generation_parts(tmp_path) == 1
    write_split(tmp_path, 1, 1, generation_parts=4)
    assert read_generation_parts(tmp_path) == 4 and read_split(tmp_path) == (1, 1)
    write_split(tmp_path, 2, 1)  # SFT's file, as before
    assert read_generation_parts(tmp_path) == 1 and read_split(tmp_path) == (2, 1)


@pytest.mark.slow  # plans (traces) the tiny model twice: seconds
def test_the_plan_names_grpos_two_peaks_and_which_sets_the_step_peak():
    from qlora_kit import Recipe
    from qlora_kit.memory import planner

    def line(grad_accum: int) -> str:
        values = {
            "data": {"max_seq_len": 64},
            "memory": {"checkpointing": "none"},
            "train": {"objective": "grpo", "micro_batch_size": 8, "grad_accum": grad_accum},
            "grpo": {"num_generations": 4, "max_completion_length": 5, "rewards": [{"name": "exact_match"}]},
        }
        recipe = Recipe.from_dict(values)
        the_plan = planner.plan(recipe, device="cpu")
        return the_plan.grpo_peaks(the_plan.chosen(recipe))

    # one generation batch of 8 sequences: the policy step's activations and logits are the larger peak;
    # of 8 x 64 sequences: the rollouts' KV cache and per-sequence logits are
    assert line(1).endswith("the policy step sets the peak") and "rollouts" in line(1)
    assert line(64).endswith("the rollouts set the peak")
