"""The training family: a run from recipe to saved adapter, and everything that watches it.

- ``pipeline``: ``build(recipe)`` sets a run up stage by stage, ``run(recipe)`` trains and saves;
- ``resolved``: what a recipe leaves to the machine, data or launch (precision, layout, checkpointing
  auto, the objective, the launch), resolved once into one object every later stage reads;
  ``layout_costs``: ``data.packing: auto``'s real tokens a second per layout, timed on the run's own data;
- ``sample_prompts``: the validation prompts a run answers before and after training;
- ``objectives``: ``train.objective`` -> the Trainer that runs it, with qlora_kit's callbacks;
- ``step``: one training step in the order it runs (the micro-batch's code) and every callback, in order;
  ``private_hooks``: the private Trainer and TRL methods overridden, why, and a check at import;
- each objective's module (the objective table's, registries/objectives.py: its data, arguments, Trainer):
  ``sft`` on ``GuardedTrainer`` (``trainer``: it and the Trainer's arguments); ``dpo``: TRL's DPOTrainer with the same;
  ``grpo``: TRL's GRPOTrainer with the same (its reward functions: data/rewards.py; ``reward_checks``
  them as TRL calls them), ``grpo_explain`` what it says, ``row_sampling`` each row of a generate call
  drawn from its own seed; ``kto``: TRL's KTOTrainer with the same;
- ``guards``: stop a run that trains nothing or on garbage; ``interrupts``: a signal -> a checkpoint;
- ``oom_recovery``: an out-of-memory error in a step splits the micro-batch and keeps the global batch;
  ``micro_batches``: its parts that need no Trainer (a micro-batch cut in parts, the split file, messages);
  ``grpo_oom``: the same for GRPO's two peaks, the rollouts and the policy step, and its worst batch first;
- ``throughput``: tokens/s, trained tokens and MFU; ``trackers``: tensorboard, W&B, MLflow, trackio;
  ``expert_load``: a mixture of experts' routing (tokens per expert, the auxiliary loss, starved experts);
- ``distributed``: what one process of several does differently (DDP, FSDP2);
- ``outputs``: the output folder's policy and atomic checkpoints; ``manifest``: what produced an adapter;
- ``run_log``, ``run_console``, ``run_record``: what a run says, what a person watching sees, and
  a run read back from its folder.

Modules are imported by path (``from qlora_kit.training import pipeline``); this file imports nothing.
"""
