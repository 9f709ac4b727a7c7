"""The objectives: one module per ``train.objective``, each building its data, arguments and Trainer.

The objective table (registries/objectives.py) holds each one's traits; ``training/objective_trainer``
imports its module. Each module has ``prepare(recipe, tokenizer)`` and ``trainer_parts(recipe, ...)``.

- ``sft``: supervised fine-tuning on ``GuardedTrainer``;
- ``dpo``: TRL's DPOTrainer with the same additions;
- ``kto``: TRL's KTOTrainer with the same, on unpaired feedback;
- ``orpo``: TRL's ORPOTrainer with the same, on pairs with no reference policy;
- ``reference_adapter``: what DPO and KTO share: TRL's frozen "ref" adapter as the reference policy,
  the policy's fp32 LoRA weights given back, checkpointing left alone, no telemetry;
- ``grpo/``: TRL's GRPOTrainer with the same (its rollouts, out-of-memory splits and explanations).

Modules are imported by path (``from qlora_kit.training.objectives import sft``); this file imports nothing.
"""
