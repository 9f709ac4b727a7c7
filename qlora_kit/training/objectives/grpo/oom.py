"""GRPO at the memory edge: out-of-memory in the rollouts or in the policy step, and the worst batch first.

A GRPO step has two peaks: the rollouts (``generate`` under no grad: the KV cache of every sequence of
the call, and each new token's logits) and the policy step (forward and backward on prompt + completion).
``GrpoOomRecovery``, the ``OomRecovery`` of ``GuardedGRPOTrainer`` (training/step/oom_recovery.py), splits
each where it runs out of memory:

- **Generation**: the process's rollouts run in ``generation_parts`` generate calls of consecutive prompt
  copies (the same prompts, the same completions per prompt); an out-of-memory error doubles the calls and
  redoes the generation from the random state it began with. Under ``grpo.seed_each_completion`` each row
  is drawn from a seed of its own (row_sampling.py), so the split generation samples exactly the
  completions one call would, and the rewards are the same. Without it TRL draws the whole batch from one
  random stream, so a split generation samples other (equally distributed) completions than an unsplit
  one would.
- **The policy step**: TRL's ``_prepare_inputs`` turns the prompt rows into the rollout (completions,
  rewards and advantages, computed over each whole group before anything is split), and the rollout is
  what ``OomRecovery.train`` splits and redoes like SFT's micro-batch. The parts' losses add up to the
  micro-batch's: TRL's dapo, cispo and vespo divide by the generation batch's token count
  already; its per-sequence or per-batch means (grpo, sapo, dr_grpo, luspo: rows; bnpo: tokens) are
  weighted by the part's share.

Several processes agree before splitting: after each generation a one-byte flag is all-reduced (TRL
gathers completion lengths right after, where a process that failed must not be missing), and the policy
step's flags are OomRecovery's, plus one after the policy's log-probabilities, before TRL's metric
all-reduces in the loss.

The worst batch first (``train.probe_worst_batch``: ``GuardedGRPOTrainer.probe_worst_batch``, grpo.py,
inside ``OomRecovery.probe_running``): before step 1 the longest prompts of the data
(one generation batch of them, each ``num_generations`` times) are sampled to ``max_completion_length``
(end of sequence suppressed), then the policy step runs on the first micro-batch of that rollout; the
gradients, metrics and random states are put back, so training is what it would be without the probe.
The sizes a split reached are written into every checkpoint (``micro_batch_split.json``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from qlora_kit.errors import TrainingGuardError
from qlora_kit.registries import metric_keys as keys
from qlora_kit.training.step.oom.autocast_state import autocast_kept
from qlora_kit.training.step.oom.failure import Failure, memory_figures, release_memory
from qlora_kit.training.step.oom.random_state import rng_state, set_rng_state
from qlora_kit.training.step.oom.rows import rows_of
from qlora_kit.training.step.oom_recovery import OomRecovery

log = logging.getLogger(__name__)

# TRL 1.16's loss types whose loss is a mean over the micro-batch's rows or tokens (GRPOTrainer._compute_loss):
# a part's loss is weighted by its share so the parts add up to the micro-batch's loss
MEAN_OVER = {"grpo": "rows", "sapo": "rows", "dr_grpo": "rows", "luspo": "rows", "bnpo": "tokens"}


class GrpoOomRecovery(OomRecovery):
    """``OomRecovery`` for a GRPO trainer: the generation split too, the policy step's parts weighted by
    their share, and the worst batch's rollouts first (see the module docstring)."""

    def rollout_sampled(self, inputs: dict[str, Any], rollout: dict[str, Any]) -> None:
        """The step's micro-batch ``inputs`` (prompt rows) became ``rollout``: a redo finds it among the
        step's batches, and redraws from after the step's rollouts."""
        if self.step_rng is not None and self.step_batches and self.step_batches[0] is inputs:
            # a redone policy step draws (dropout) from where it began, after the step's rollouts: not
            # from before them, which would sample the next step's rollouts from this one's state again
            self.step_rng = rng_state()
        self.step_batches = [rollout if batch is inputs else batch for batch in self.step_batches]

    def can_split(self, inputs, num_items_in_batch) -> bool:
        # TRL's loss is normalised inside it (MEAN_OVER), not by the Trainer's item count
        return self.parts < rows_of(inputs)

    def can_split_eval(self, inputs) -> bool:
        # The rollouts' generation splits as training's; the loss forward is not split (TRL's evaluation
        # loss of a part is not a share of the batch's for every loss type): it stops.
        return False

    def part_share(self, part: dict[str, Any]) -> float:
        """The share of the micro-batch in parts that ``part`` is, as the loss type weighs it."""
        whole, over = self.in_parts, MEAN_OVER.get(self.trainer.loss_type)
        if self.parts == 1 or whole is None or over is None or part is whole:
            return 1.0
        if over == "rows":
            return rows_of(part) / rows_of(whole)
        return float(part["completion_mask"].sum()) / max(float(whole["completion_mask"].sum()), 1.0)

    def policy_logps_done(self) -> None:
        """After the policy's forward and log-probabilities of a training part, before TRL's loss (whose
        metrics all-reduce): every process got there, or all drop the attempt (training/step/oom_recovery.py)."""
        if self.trainer.model.training and torch.is_grad_enabled() and self._phase in ("forward", "loss"):
            self._check_peers()
            self._phase = "backward"

    # ---- generation -------------------------------------------------------------------------------
    def generate_in_parts(self, prompt_ids: list[list[int]], generate_rows) -> tuple[list, list | None]:
        """``generate_rows(ids, first)`` -> (completions, logprobs) of ``prompt_ids[first:first + len(ids)]``,
        called in ``generation_parts`` consecutive slices; doubled and redone on out-of-memory."""
        state = rng_state()
        while True:
            started = time.perf_counter()
            size = -(-len(prompt_ids) // self.generation_parts)
            completions: list = []
            logprobs: list = []
            failure = None
            try:
                for first in range(0, len(prompt_ids), size):
                    with autocast_kept():  # autocast as it was if the call fails
                        one, one_logprobs = generate_rows(prompt_ids[first : first + size], first)
                    completions += one
                    logprobs += one_logprobs or []
            except torch.OutOfMemoryError as error:  # text only: the frames hold the KV cache
                failure = Failure(str(error).splitlines()[0][:300], memory_figures())
            if failure is not None:
                release_memory()
            if not self.agree(failed=failure is not None):  # every process: none failed
                return completions, logprobs or None
            failure = failure or Failure("another process of the run ran out of memory", memory_figures())
            failure.lost_s = time.perf_counter() - started
            self._split_generation(prompt_ids, size, failure)
            set_rng_state(state)  # the redo draws from where the generation began

    def _split_generation(self, prompt_ids: list[list[int]], size: int, failure: Failure) -> None:
        from qlora_kit.training.step.guards import kept

        trainer = self.trainer
        step = trainer.state.global_step + 1
        where = "the worst-batch probe's rollouts" if self.probing else "generation"
        if self.policy.on_oom == "stop" or size <= 1:
            longest = max(len(ids) for ids in prompt_ids)
            why = f"{size} sequence{'s' if size != 1 else ''} per generate call"
            raise TrainingGuardError(
                f"step {step}: out of memory in {where} ({failure.message}; {failure.figures}): {why}, "
                f"prompts of up to {longest} tokens + {trainer.max_completion_length} completion tokens. "
                f"To fit it: {self.policy.levers}; {kept(trainer.args.output_dir)}"
            )
        self.generation_parts *= 2
        after = -(-len(prompt_ids) // self.generation_parts)
        log.warning(
            "step %d: out of memory in %s (%s; %s): generation %d -> %d sequences per generate call (%d calls), "
            "the same prompts and %d completions per prompt; the generation is redone",
            step,
            where,
            failure.message,
            failure.figures,
            size,
            after,
            -(-len(prompt_ids) // after),
            trainer.num_generations,
        )
        self.record(
            {
                "step": step,
                keys.OOM_SPLIT: {
                    "phase": "generation",
                    keys.MICRO_BATCH_BEFORE: size,
                    keys.MICRO_BATCH: after,
                    keys.MICRO_BATCH_PARTS: self.generation_parts,
                    "error": failure.message,
                    "memory": failure.figures,
                    keys.LOST_SECONDS: round(failure.lost_s, 3),
                },
            }
        )
