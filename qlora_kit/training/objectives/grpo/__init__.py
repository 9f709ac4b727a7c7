"""``train.objective: grpo``: TRL's GRPOTrainer and the parts of it that are GRPO's alone.

- ``grpo``: ``GuardedGRPOTrainer``, its arguments and ``RewardGuard`` (its reward functions:
  data/rewards.py);
- ``explain``: what a GRPO run says about its rollouts and rewards while it trains;
- ``oom``: out-of-memory recovery for GRPO's two peaks, the rollouts and the policy step, and its worst
  batch first;
- ``row_sampling``: each row of a generate call drawn from its own seed;
- ``reward_checks``: the reward functions checked as TRL calls them.

Modules are imported by path (``from qlora_kit.training.objectives.grpo import grpo``); this file imports
nothing.
"""
