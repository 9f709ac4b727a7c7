"""``train.objective: grpo``: TRL's GRPOTrainer with everything ``GuardedTrainer`` adds to a run.

``GuardedGRPOTrainer`` is ``GuardedTrainer`` on top of TRL's ``GRPOTrainer`` (one class each, nothing
copied): the guards, the memory and throughput accounting, atomic checkpoints, the adapter-only save and
a resumed paged optimizer come from GuardedTrainer; the rollouts, the rewards, the group advantages, the
clipped policy loss, the KL penalty and their metrics from TRL.

Rollouts are transformers' ``generate`` on the training model itself (TRL's path without vLLM), with a
KV cache: transformers' checkpointed layers keep their cache when no gradient is taken (generation runs
under ``torch.no_grad``), and the forward runs under the Trainer's autocast as training does. The
reference policy (``grpo.beta`` > 0) is never a second copy of the 4-bit base: TRL copies the trained
adapter into a frozen second adapter named "ref" on the same base (with ``model.adapter`` that is the SFT
adapter; without it the fresh adapter, B = 0, i.e. the base itself).

What this module changes in TRL's behaviour, and why:
- TRL casts a quantized model's trainable parameters to bf16; QLoRA keeps LoRA weights and the
  optimizer in fp32 (bf16 weights lose small updates to rounding), so the policy gets its fp32 values
  back (the same tensors, bit-exact).
- TRL turns checkpointing off and on around each generation with transformers' defaults, which would
  replace the recipe's policy (every_n) by "every layer"; without gradients checkpointing saves nothing
  and keeps the KV cache, so it is left alone.
- The dead-gradient guard waits for a step with a reward signal: when every group's completions got the
  same reward and beta is 0, every gradient is exactly zero in a healthy run (``RewardGuard``).
- TRL's telemetry ping at construction is not sent.
- ``grpo.seed_each_completion`` (off by default) samples each row of the batched call from a seed of its
  own, so the rollouts do not depend on how the prompts are split across processes or generate calls
  (``row_sampling.py``).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate import PartialState
from trl import GRPOConfig, GRPOTrainer

from qlora_kit.data.rewards import reward_functions
from qlora_kit.errors import RecipeError
from qlora_kit.training.objectives.grpo.explain import GrpoExplainer
from qlora_kit.training.objectives.grpo.oom import GrpoOomRecovery
from qlora_kit.training.objectives.grpo.reward_checks import checked
from qlora_kit.training.objectives.grpo.row_sampling import rows_seeded
from qlora_kit.training.objectives.reference_adapter import describe_reference
from qlora_kit.training.step import private_hooks
from qlora_kit.training.step.arguments import training_settings
from qlora_kit.training.step.guards import TrainingGuard, all_zero
from qlora_kit.training.step.oom.rows import rows_of
from qlora_kit.training.step.trainer import GuardedTrainer

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe

log = logging.getLogger(__name__)


def grpo_arguments(recipe: Recipe, output_dir: Path, has_eval: bool, precision: str) -> GRPOConfig:
    """TRL's GRPOConfig: the Trainer's arguments from the recipe plus the grpo section."""
    grpo, train = recipe.grpo, recipe.train
    check_batch(recipe, PartialState().num_processes)
    return GRPOConfig(
        **training_settings(recipe, output_dir, has_eval, precision),
        num_generations=grpo.num_generations,
        max_completion_length=grpo.max_completion_length,
        temperature=grpo.temperature,
        beta=grpo.beta,
        loss_type=grpo.loss_type,
        scale_rewards=grpo.scale_rewards,
        num_iterations=grpo.num_iterations,
        epsilon=grpo.epsilon,
        reward_weights=[reward.weight for reward in grpo.rewards],
        # micro_batch_size counts completions; one generation batch per optimizer step (TRL's default)
        steps_per_generation=train.grad_accum,
        # the recipe's checkpointing policy is applied to the base before peft wraps it (checkpointing.py)
        activation_checkpointing=False,
        log_completions=False,
    )


def trainer_extras(recipe: Recipe) -> dict:
    """What GRPOTrainer takes besides the Trainer's arguments: the reward functions, in recipe order."""
    return {
        "reward_funcs": [
            checked(f, f"grpo.rewards[{i}]") for i, f in enumerate(reward_functions(recipe.grpo.rewards))
        ],
        "seed_each_completion": recipe.grpo.seed_each_completion,
    }


def check_batch(recipe: Recipe, processes: int) -> None:
    """TRL samples num_generations completions of each prompt within one optimizer step's batch."""
    train, generations = recipe.train, recipe.grpo.num_generations
    completions = train.micro_batch_size * train.grad_accum * processes
    if completions % generations:
        raise RecipeError(
            f"train.micro_batch_size: the completions of one optimizer step (micro_batch_size {train.micro_batch_size} "
            f"x grad_accum {train.grad_accum} x {processes} processes = {completions}) must be a multiple of "
            f"grpo.num_generations ({generations}): each prompt's group is sampled within one step"
        )
    if train.eval_steps and (train.micro_batch_size * processes) % generations:
        raise RecipeError(
            f"train.micro_batch_size: evaluation samples grpo.num_generations ({generations}) completions of a "
            f"prompt per batch; micro_batch_size x processes ({train.micro_batch_size * processes}) must be a multiple"
        )


@private_hooks.checked
class GuardedGRPOTrainer(GuardedTrainer, GRPOTrainer):
    """GRPOTrainer with qlora_kit's guards, accounting and checkpoint layout (see the module docstring)."""

    def __init__(self, *args, model, seed_each_completion: bool = False, **kwargs) -> None:
        fp32 = {name: p.data for name, p in model.named_parameters() if p.requires_grad}
        super().__init__(*args, model=model, **kwargs)
        self.seed_each_completion = seed_each_completion
        self.policy_restored = 0
        for name, parameter in self.model.named_parameters():
            if name in fp32 and parameter.dtype != fp32[name].dtype:
                parameter.data = fp32[name]
                self.policy_restored += 1
        # TRL's generation toggles checkpointing when this says True (see the module docstring)
        self.model.is_gradient_checkpointing = False

    oom_recovery = GrpoOomRecovery  # the generation splits too (grpo/oom.py)
    # GRPOTrainer.training_step receives prompt rows and samples the rollouts inside it: the throughput
    # counts the rollout the loss is computed on, in compute_loss, not the rows the step was handed.
    counts_in_step = False
    rollout_ready = False  # _prepare_inputs hands a rollout on as it is (the policy step's parts)

    # ---- one step: the rollouts, then the policy step as GuardedTrainer's micro-batch ------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.rollout_ready:  # already a rollout
            return super().training_step(model, inputs, num_items_in_batch)
        # the rollouts first (their generation split on out-of-memory: grpo/oom.py), or TRL's buffer
        rollout = self._prepare_inputs(inputs)
        self.oom.rollout_sampled(inputs, rollout)  # what a redo of the step's micro-batches runs
        step = self._step  # TRL counts micro-batches; the parts and redone attempts are not new ones
        loss = self.policy_step(model, rollout, num_items_in_batch)
        self._step = step + 1
        return loss

    def policy_step(self, model, rollout, num_items_in_batch):
        """GuardedTrainer's step on a sampled rollout: in parts, recovered, counted and guarded."""
        self.rollout_ready = True
        try:
            return super().training_step(model, rollout, num_items_in_batch)
        finally:
            self.rollout_ready = False

    def _prepare_inputs(self, inputs):
        return inputs if self.rollout_ready else super()._prepare_inputs(inputs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # The throughput counts input positions from input_ids; a rollout's are its prompt and completion.
        counted = {**inputs, "input_ids": torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)}
        if model.training:
            self.throughput.count(counted)
        loss = super().compute_loss(model, counted, return_outputs, num_items_in_batch)
        share = self.oom.part_share(inputs) if model.training else 1.0  # a split policy step (grpo/oom.py)
        return loss * share if share != 1.0 else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # The rollouts first (their generation splits as training's), then evaluation's loss on them
        rollout = self._prepare_inputs(inputs)
        self.rollout_ready = True
        try:
            return super().prediction_step(model, rollout, prediction_loss_only, ignore_keys)
        finally:
            self.rollout_ready = False

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        result = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        self.oom.policy_logps_done()  # several processes agree before TRL's loss all-reduces (grpo/oom.py)
        return result

    # ---- the worst batch first ------------------------------------------------------------------
    def probe_worst_batch(self, model) -> None:
        """The longest prompts sampled to max_completion_length, then the policy step on them, inside
        ``OomRecovery.probe_running``; then TRL's step count, metrics and logs put back (grpo/oom.py's
        module docstring)."""
        step, metrics = self._step, self._metrics
        seen, logs = self.state.num_input_tokens_seen, self._logs
        self._metrics = {"train": _Discard(), "eval": _Discard()}
        self._logs = {name: _Discard() for name in ("images", "prompt", "completion", "advantages")}
        self._logs["rewards"], self._logs["extra"] = _Discard(), _Discard()
        sync = self.accelerator.sync_gradients
        self.generation_config.min_new_tokens = self.max_completion_length  # no early end of sequence
        with self.oom.probe_running():
            try:
                rollout = self._generate_and_score_completions(self._longest_prompts())
                size = self.args.per_device_train_batch_size
                first = {k: v[:size] if _per_row(v, rollout) else v for k, v in rollout.items()}
                self.accelerator.gradient_state._set_sync_gradients(False)
                with self.accelerator.no_sync(model):  # nothing is reduced: the gradients are dropped
                    self.policy_step(model, first, None)
                model.zero_grad(set_to_none=True)
            finally:
                self.generation_config.min_new_tokens = None
                self.accelerator.gradient_state._set_sync_gradients(sync)
                self._step, self._metrics, self._logs = step, metrics, logs
                self.state.num_input_tokens_seen = seen
        log.info(
            "worst-batch probe: %d completions of %d tokens of the longest prompts fit (generation in %d "
            "call(s), the policy step in %d part(s))",
            rows_of(rollout),
            self.max_completion_length,
            self.oom.generation_parts,
            self.oom.parts,
        )

    def _longest_prompts(self) -> list[dict[str, Any]]:
        """One process's generation batch of the longest prompts, each num_generations times (the sampler's
        layout: a prompt's copies adjacent)."""
        dataset = self.train_dataset
        prompt_ids, _, _ = self._tokenize_prompts([row["prompt"] for row in dataset])
        args = self.args
        prompts = args.per_device_train_batch_size * args.steps_per_generation // self.num_generations
        order = sorted(range(len(prompt_ids)), key=lambda i: -len(prompt_ids[i]))[: max(prompts, 1)]
        return [dataset[i] for i in order for _ in range(self.num_generations)]

    def _send_telemetry(self) -> None:
        pass

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        """With ``grpo.seed_each_completion``: each row of the ``generate`` call sampled under its own seed.

        TRL samples a process's whole batch in one call after seeding each process differently
        (``set_seed(seed, device_specific=True)`` in ``GRPOTrainer.__init__``), so a completion's random
        draws depend on the process and on the rows sampled beside it. Drawn from a seed of what the row is
        (``rollout_seed``, ``row_sampling.rows_seeded``), a completion is the same on one process or
        several and in one call or in the parts of a split generation, and the call stays batched. Text
        prompts only (qlora_kit's formats have no images).
        """
        # This process holds rows [start, start + len) of the step's batch: accelerate hands each
        # process consecutive slices of the sampler's order, where a prompt's num_generations copies
        # are adjacent, so a row's copy index within its group is its global position modulo the group.
        start = self.accelerator.process_index * len(prompt_ids)
        whole = super()._generate_single_turn

        def generate_rows(rows: list[list[int]], first: int):
            # one call for the slice (all of it unless split: grpo/oom.py)
            if not self.seed_each_completion:
                if len(rows) == len(prompt_ids):
                    return whole(rows, images, multimodal_fields, num_generations, has_tool_images)
                return whole(rows, None, {}, num_generations)
            seeds = [
                rollout_seed(
                    self.args.seed, self.state.global_step, ids, (start + first + offset) % num_generations
                )
                for offset, ids in enumerate(rows)
            ]
            with rows_seeded(
                self.accelerator.unwrap_model(self.model_wrapped), seeds, self.accelerator.device
            ):
                return whole(rows, None, {}, num_generations)

        return self.oom.generate_in_parts(prompt_ids, generate_rows)

    def reference_description(self, adapter: str | None) -> str:
        if self.beta == 0:
            return "not used (grpo.beta is 0: no KL penalty, no reference forward)"
        return describe_reference(adapter)


def rollout_seed(seed: int, step: int, prompt_ids: list[int], copy: int) -> int:
    """A seed from what a completion is, not where it is sampled: train.seed, the optimizer step the
    rollout is for, the prompt's tokens and the copy's index in its group (a stable hash: Python's
    ``hash`` of a str differs per process). A prompt that occurs twice in one step's batch (a duplicate
    row in the data) draws the same completions for both of its groups."""
    key = f"{seed}|{step}|{copy}|{','.join(map(str, prompt_ids))}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & (2**63 - 1)


class RewardGuard(TrainingGuard):
    """The training guard for GRPO: a step whose LoRA gradients are all exactly zero had no reward signal
    (every group's completions scored alike, beta 0), which says nothing about gradients reaching the
    adapter; the dead-gradient check waits for a step that has one."""

    def _check_dead(self, step: int) -> None:
        if all(all_zero({name: p.grad for name, p in self.lora.items()}).values()):
            return
        super()._check_dead(step)


def prepare(recipe: Recipe, tokenizer):
    """Prompts and references as text: TRL samples and tokenizes the completions (the objective table's
    builder, registries/objectives.py)."""
    from qlora_kit.data import prompts

    return prompts.prepare_prompts(
        recipe.data, tokenizer, recipe.train.seed, recipe.grpo.max_completion_length
    )


def trainer_parts(recipe: Recipe, tokenizer, output_dir: Path, has_eval: bool, precision: str):
    """(Trainer class, its arguments, the guard class, extra Trainer keyword arguments: the reward
    functions and the explaining callback; TRL collates nothing)."""
    args = grpo_arguments(recipe, output_dir, has_eval, precision)
    extras = trainer_extras(recipe)
    # the names TRL gives function rewards in its logs (GRPOTrainer.reward_func_names)
    names = [function.__name__ for function in extras["reward_funcs"]]
    explainer = GrpoExplainer(names, args.beta, args.num_iterations, args.num_generations)
    return GuardedGRPOTrainer, args, RewardGuard, {**extras, "callbacks": [explainer]}


def _per_row(value: Any, rollout: dict[str, Any]) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows_of(rollout)


class _Discard:
    """A stand-in for TRL's metric and log stores while the probe runs: whatever is put in is dropped."""

    def __getitem__(self, key):
        return self

    def __getattr__(self, name):
        return lambda *args, **kwargs: None

    def __setitem__(self, key, value) -> None:
        pass

    def __len__(self) -> int:
        return 0

    def __iter__(self):
        return iter(())
