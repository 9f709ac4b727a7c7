"""Out-of-memory inside a step: split the micro-batch, keep the global batch (``train.on_oom``).

transformers' ``auto_find_batch_size`` halves the batch and restarts the loop from step 0 with the same
accumulation, so the global batch halves. Here the dataloader, the sampler, the accumulation and the
scheduler stay as the recipe set them; what changes is how a micro-batch is computed. Once split in
``parts``, every micro-batch the Trainer hands to ``training_step`` runs as ``parts`` sequential chunks
of its rows, each forward and backward, with the step's ``num_items_in_batch`` unchanged (transformers 5
passes the step's trained-token count to the loss), so the gradient is the same sum over the same
tokens: a micro-batch of 8 split in two is what micro-batch 4 with twice the accumulation computes, and
its chunks are cut to their own longest row, as that run's batches are padded.

When a micro-batch raises ``torch.OutOfMemoryError`` (in forward, or in backward and a checkpointed
layer's recompute), the exception and its frames are dropped (they hold the failed attempt's
activations), the cached blocks are released, the gradients of the step in progress are set to None
and the random state is put back to where the step began; then the step's micro-batches so far are
redone in twice the parts. The logged loss is corrected by what the redo recomputed. The number of
parts is written into every checkpoint (``micro_batch_split.json``) and a ``--resume`` reads it back:
the resumed run is the one that was never interrupted. A micro-batch that cannot be split further
(one row per part) stops the run with one line: the batch's tokens, the planner's prediction, the
recipe's levers, and the checkpoint kept.

Several processes (DDP): an out-of-memory error on one must not leave the others in a collective. Every
process passes the same points of each part in the same order — the end of the model's forward pass
(a hook inside DDP's forward, before DDP's own end of forward) and the end of the backward pass — and
all-reduces a one-byte flag at each; a process that fails joins the flag of the point it failed at
(between the two no collective runs: the loss of SFT reduces nothing, and no backward pass all-reduces,
below). So all of them drop the attempt at the same point and split together. The trainer's loss calls
none of this: the forward's flag is a hook set on the model only under several processes. No backward
pass all-reduces: every part runs under DDP's ``no_sync``, also the step's last (where DDP's hooks
would start the gradient all-reduce inside the backward pass, and a process that failed there would
leave its peers in it), and once every process has passed the flag after the step's last backward
pass, the gradients are averaged in one all-reduce, as DDP's would. For LoRA the gradients are small;
what is lost is DDP's overlap of that all-reduce with the backward pass (tests/e2e/test_oom.py: two
processes over gloo, one failing in the forward pass, one in the last backward pass's recompute).
FSDP's gathers run inside the forward and backward passes, where no flag can stand between them: under
FSDP an out-of-memory error stops the run (``oom_policy``), and the process that failed enters no
collective; it exits with the line, and the launcher ends the others.

Evaluation splits its own batch the same way (``eval_parts``); training's is untouched. The worst-batch
probe (``train.probe_worst_batch``) runs the longest micro-batch before step 1 through the same path.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from qlora_kit.errors import TrainingGuardError
from qlora_kit.registries import metric_keys as keys
from qlora_kit.training.distributed import over_ranks
from qlora_kit.training.step.oom.autocast_state import autocast_kept
from qlora_kit.training.step.oom.failure import (
    Failure,
    held_after_release,
    memory_figures,
    release_memory,
    split_record,
    stop_message,
)
from qlora_kit.training.step.oom.policy import OomPolicy
from qlora_kit.training.step.oom.random_state import rng_state, set_rng_state
from qlora_kit.training.step.oom.rows import concat, rows_of, split_rows, tokens_of
from qlora_kit.training.step.oom.split_file import read_generation_parts, read_split, write_split

if TYPE_CHECKING:
    from transformers import Trainer

log = logging.getLogger(__name__)

# One part's forward and backward (the library's Trainer.training_step): (model, part, num_items) -> loss
ForwardBackward = Callable[[Any, dict[str, Any], Any], torch.Tensor]


class PeerOutOfMemory(RuntimeError):
    """Another process of the run ran out of memory: this one drops its attempt too, at the same point."""


class OomRecovery:
    """Out-of-memory recovery for one trainer, an object its step calls (training/step/trainer.py):
    ``step_started`` keeps the step's micro-batches and random state, ``train`` runs a micro-batch in
    ``parts`` and recovers (under DDP the processes agree after each part's model forward pass, through
    a hook it sets on the model, and after its backward), ``evaluate`` splits evaluation's batch,
    ``probe_running`` surrounds the worst-batch probe the trainer runs. The step calls it, in one
    direction: it runs the work it is handed (``forward_backward``, ``predict``), reads the trainer's
    arguments, accelerator and state, and calls none of the trainer's methods (tests/test_step.py) and
    writes none of its attributes."""

    def __init__(self, trainer: Trainer, policy: OomPolicy, probe: bool) -> None:
        self.trainer = trainer
        self.policy = policy
        self.parts = 1  # chunks each training micro-batch runs in
        self.eval_parts = 1  # chunks each evaluation batch runs in
        self.generation_parts = 1  # GRPO: generate calls each process's rollouts run in (grpo/oom.py)
        self.in_parts: dict[str, Any] | None = None  # the micro-batch whose parts are running
        self.probe_pending = probe
        self.probing = False  # the probe's tokens are not training's (throughput)
        self.step_batches: list[dict[str, Any]] = []
        self._step_losses: list[torch.Tensor] = []  # what each micro-batch added to the Trainer's loss
        self.step_rng: dict[str, Any] | None = None
        self._phase: str | None = None  # forward or backward of the part in progress (multi-process flags)
        self._watching = False

    def step_started(self, batches: list[dict[str, Any]]) -> None:
        """The Trainer drew the step's micro-batches: kept, with the random state, for a redo."""
        self.step_batches, self._step_losses = batches, []
        self.step_rng = rng_state() if self.policy.on_oom == "split" else None

    def train(self, model, inputs, num_items_in_batch, forward_backward: ForwardBackward):
        """The micro-batch's forward and backward passes, in ``parts`` chunks, each through
        ``forward_backward``; on an out-of-memory error the step's micro-batches so far again, in twice
        the parts."""
        started = time.perf_counter()
        loss, failure = self._attempt(model, [inputs], num_items_in_batch, forward_backward)
        if failure is None:
            self._step_losses.append(loss)
            return loss
        index = next((i for i, batch in enumerate(self.step_batches) if batch is inputs), None)
        if index is None:  # the probe: no step in progress
            index, batches = 0, [inputs]
            self._step_losses = []
        else:
            batches = self.step_batches[: index + 1]
        while failure is not None:
            failure.lost_s = time.perf_counter() - started
            self._split_or_stop(model, inputs, num_items_in_batch, failure, index)
            started = time.perf_counter()
            loss, failure = self._attempt(model, batches, num_items_in_batch, forward_backward)
        # The Trainer has already added the first attempt's losses of the earlier micro-batches
        loss = loss - sum(self._step_losses[:index]) if index else loss
        self._step_losses = [*self._step_losses[:index], loss]
        return loss

    def _attempt(self, model, batches, num_items_in_batch, forward_backward):
        """(the summed loss, None), or (None, the failure) with every reference to the attempt dropped."""
        try:
            total = None
            with (
                autocast_kept()
            ):  # an error inside accelerate's autocast leaves it on (oom/autocast_state.py)
                for batch in batches:
                    loss = self._run_in_parts(model, batch, num_items_in_batch, forward_backward)
                    total = loss if total is None else total + loss
        except (torch.OutOfMemoryError, PeerOutOfMemory) as error:
            # Text only: the error's traceback holds the frames, and they the activations; Python drops
            # ``error`` at the end of this clause, and with it all of them.
            failure = Failure(str(error).splitlines()[0][:300], memory_figures())
            own = isinstance(error, torch.OutOfMemoryError)
        else:
            if self._defers_sync(model) and self.trainer.accelerator.sync_gradients:
                self._synchronise_gradients(model)  # every process passed the last backward's flag
            return total, None
        release_memory()
        # What the retry starts from, as the allocator counts it: the failed attempt's bytes must be gone
        failure.figures += f"; after the release {held_after_release()}"
        if own and self._phase is not None and not self.trainer.is_fsdp_enabled:
            self.agree(failed=True)  # the other processes wait at this point's flag: tell them
        self._phase = None
        return None, failure

    def _run_in_parts(self, model, inputs, num_items_in_batch, forward_backward):
        chunks = split_rows(inputs, self.parts, trim=True)
        self.in_parts = inputs
        self._watch_model_forward(model)
        total = None
        for chunk in chunks:
            self._phase = "forward"
            # No backward pass all-reduces under DDP (the module docstring): _attempt does, once
            no_sync = self.trainer.accelerator.no_sync(model) if self._defers_sync(model) else None
            with no_sync or contextlib.nullcontext():
                loss = forward_backward(model, chunk, num_items_in_batch)
            self._phase = "backward"
            self._check_peers()  # every process finished this part's backward
            self._phase = None
            total = loss if total is None else total + loss
        return total

    def _defers_sync(self, model) -> bool:
        """DDP: the step's gradients are all-reduced after its last backward pass, not inside it."""
        return (
            self.trainer.args.world_size > 1
            and not self.trainer.is_fsdp_enabled
            and hasattr(model, "no_sync")
        )

    def _synchronise_gradients(self, model) -> None:
        """The gradients averaged over the processes, as DDP's all-reduce in the last backward pass would
        have left them: one all-reduce of them all, through accelerate (DDP has no call that all-reduces
        outside a backward pass)."""
        params = [p for p in model.parameters() if p.requires_grad]
        for param in params:
            if param.grad is None:  # the same layout on every process
                param.grad = torch.zeros_like(param)
        grads = [p.grad for p in params]
        flat = self.trainer.accelerator.reduce(torch.cat([g.reshape(-1) for g in grads]), reduction="mean")
        for grad, value in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(value.view_as(grad))

    def _watch_model_forward(self, model) -> None:
        # Under DDP the flag after the model's forward comes before DDP's own end of forward, which a
        # process that ran out of memory inside the model never reaches: every process passes it, or
        # none. A hook on the wrapped module runs there.
        inner = getattr(model, "module", None)
        if self.trainer.args.world_size > 1 and inner is not None and not self._watching:
            inner.register_forward_hook(lambda *_: self._model_forward_done())
            self._watching = True

    def _model_forward_done(self) -> None:
        if self._phase == "forward" and torch.is_grad_enabled():
            self._check_peers()
            self._phase = "loss"

    def _check_peers(self) -> None:
        if self.agree(failed=False):
            raise PeerOutOfMemory("another process of the run ran out of memory")

    def agree(self, failed: bool) -> bool:
        """Whether any process failed at this point: one all-reduce of a flag (none in a single process).
        Every process passes the same points (each part's forward and backward) in the same order, so
        a process that fails joins the flag its peers wait at, and none is left blocked in a collective."""
        args = self.trainer.args
        if args.world_size <= 1 or self.trainer.is_fsdp_enabled:  # FSDP: no flags (the module docstring)
            return failed
        flag = torch.tensor([int(failed)], dtype=torch.uint8, device=args.device)
        return bool(over_ranks(flag, dist.ReduceOp.MAX).item())

    def _split_or_stop(self, model, inputs, num_items_in_batch, failure: Failure, index: int) -> None:
        """Split the step's micro-batches in twice the parts and clear the step, or stop with one line."""
        from qlora_kit.training.step.guards import kept

        args = self.trainer.args
        step = self.trainer.state.global_step + 1
        where = "the worst-batch probe" if self.probing else f"micro-batch {index + 1} of the step"
        if self.policy.on_oom == "stop" or not self.can_split(inputs, num_items_in_batch):
            part = max(split_rows(inputs, self.parts, trim=True), key=tokens_of)  # the one that failed
            raise TrainingGuardError(
                stop_message(step, where, part, self.policy, failure, kept(args.output_dir))
            )
        self.parts *= 2
        model.zero_grad(set_to_none=True)  # the step's partial gradients, from every micro-batch so far
        if self.step_rng is not None:  # dropout draws as the split run's would from here
            set_rng_state(self.step_rng)
        record = split_record(step, "train", args.per_device_train_batch_size, self.parts, failure)
        self.announce(step, where, record, failure)

    def can_split(self, inputs, num_items_in_batch) -> bool:
        # The parts' losses add up to the micro-batch's through the step's token count (module docstring)
        return self.parts < rows_of(inputs) and num_items_in_batch is not None

    def announce(self, step: int, where: str, record: dict[str, Any], failure: Failure) -> None:
        """The split in the run's log and, on the main process, in its metrics file."""
        split = record[keys.OOM_SPLIT]
        log.warning(
            "step %d: out of memory in %s (%s; %s): %s micro-batch %d -> %d (%d parts, accumulation x%d), "
            "the same examples and global batch; %s",
            step,
            where,
            failure.message,
            failure.figures,
            "evaluation" if split["phase"] == "eval" else "training",
            split[keys.MICRO_BATCH_BEFORE],
            split[keys.MICRO_BATCH],
            split[keys.MICRO_BATCH_PARTS],
            self.trainer.args.gradient_accumulation_steps * split[keys.MICRO_BATCH_PARTS],
            "evaluation's batch only" if split["phase"] == "eval" else "the step is redone",
        )
        self.record(record)

    def record(self, record: dict[str, Any]) -> None:
        if self.trainer.state.is_world_process_zero:
            self.trainer.metrics_log.record(record)

    def evaluate(self, model, inputs, prediction_loss_only, ignore_keys, predict):
        """Evaluation's batch through ``predict`` (the library's prediction_step), in ``eval_parts``;
        doubled and redone on an out-of-memory error, or a stop with one line."""
        from qlora_kit.training.step.guards import kept

        while True:
            result, failure = self._predict_attempt(model, inputs, prediction_loss_only, ignore_keys, predict)
            if failure is None:
                return result
            step = self.trainer.state.global_step
            args = self.trainer.args
            if self.policy.on_oom == "stop" or not self.can_split_eval(inputs):
                message = stop_message(
                    step, "evaluation", inputs, self.policy, failure, kept(args.output_dir)
                )
                raise TrainingGuardError(message)
            self.eval_parts *= 2
            size = args.per_device_eval_batch_size
            self.announce(
                step, "evaluation", split_record(step, "eval", size, self.eval_parts, failure), failure
            )

    def can_split_eval(self, inputs) -> bool:
        return self.eval_parts < rows_of(inputs)

    def _predict_attempt(self, model, inputs, prediction_loss_only, ignore_keys, predict):
        try:
            with autocast_kept():
                if self.eval_parts == 1:
                    return predict(model, inputs, prediction_loss_only, ignore_keys), None
                return self._predict_in_parts(model, inputs, prediction_loss_only, ignore_keys, predict), None
        except torch.OutOfMemoryError as error:
            failure = Failure(str(error).splitlines()[0][:300], memory_figures())
        release_memory()
        return None, failure

    def _predict_in_parts(self, model, inputs, prediction_loss_only, ignore_keys, predict):
        """The batch's loss as one pass gives it: each part's mean over its labelled tokens, weighted by
        them; logits and labels put back together in row order."""
        results, weights = [], []
        for chunk in split_rows(inputs, self.eval_parts, trim=False):
            results.append(predict(model, chunk, prediction_loss_only, ignore_keys))
            weights.append((chunk["labels"][..., 1:] != -100).sum().float())
        losses = [r[0] for r in results]
        loss = None
        if all(x is not None for x in losses):
            w = torch.stack(weights).to(losses[0].device)
            loss = (torch.stack(losses) * w).sum() / w.sum().clamp(min=1)
        if prediction_loss_only:
            return loss, None, None
        return loss, concat([r[1] for r in results]), concat([r[2] for r in results])

    @contextlib.contextmanager
    def probe_running(self):
        """Around the worst-batch probe the trainer runs (``GuardedTrainer.probe_worst_batch``): its tokens
        are not training's, an out-of-memory error in it is met as in training (split, or stop), and
        every random state is put back after it, so training is bit-identical to a run without it."""
        state = rng_state()
        self.probing = True
        try:
            yield
        finally:
            self.probing = False
            set_rng_state(state)

    def save_split(self, checkpoint: Path) -> None:
        if self.parts > 1 or self.eval_parts > 1 or self.generation_parts > 1:
            write_split(checkpoint, self.parts, self.eval_parts, self.generation_parts)

    def load_split(self, checkpoint: Path) -> None:
        self.parts, self.eval_parts = read_split(checkpoint)
        self.generation_parts = read_generation_parts(checkpoint)
        if self.parts > 1 or self.eval_parts > 1 or self.generation_parts > 1:
            log.info(
                "resumed with the micro-batch split of %s: training in %d part(s), evaluation in %d, "
                "generation in %d",
                checkpoint.name,
                self.parts,
                self.eval_parts,
                self.generation_parts,
            )
