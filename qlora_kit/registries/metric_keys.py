"""The names of the figures a run logs, writes to ``metrics.jsonl`` and reads back: one module spells them.

In the Trainer's log (what the console and the trackers see) qlora_kit's figures carry their family's
prefix (``memory/saved_mib``, ``throughput/tokens_per_s``); ``metrics.jsonl`` and the run's summary drop
it (``saved_mib``, ``tokens_per_s``). The Trainer's own keys are renamed once (``learning_rate`` -> ``lr``).
Writers (the memory monitor, throughput, the metrics log) and readers (the console, the summary, ``qlora-kit
show``, ``doctor``) use these names, never a spelling of their own.
"""

from __future__ import annotations

MEMORY = "memory/"  # the memory monitor's family prefix in the log
THROUGHPUT = "throughput/"  # throughput's
EXPERTS = "experts/"  # a mixture of experts' routing (training/watch/expert_load.py)

SAVED_MIB = "saved_mib"  # bytes saved for backward by the largest forward pass, MiB
SAVED_MIB_HEAD = "saved_mib_head"  # of which outside the decoder layers (the loss head)
SAVED_MIB_LAYER = "saved_mib_layer_"  # + the layer's index (three digits), in the log
SAVED_MIB_LAYERS = "saved_mib_layers"  # the per-layer list, in metrics.jsonl and the summary
PEAK_FORWARD = "peak_forward_gib"  # CUDA: peak allocated memory per phase of a step
PEAK_BACKWARD = "peak_backward_gib"
PEAK_OPTIMIZER = "peak_optimizer_gib"
PEAK_KEYS = (PEAK_FORWARD, PEAK_BACKWARD, PEAK_OPTIMIZER)
DEVICE_USED = "device_used_gib"  # CUDA: the device's own used memory (paged optimizer state included)
TRAIN_SECONDS = "train_seconds"  # first forward to last backward

OOM_SPLIT = "oom_split"  # a metrics.jsonl row of its own: an out-of-memory error split the micro-batch
MICRO_BATCH_BEFORE = "micro_batch_before"  # in it: rows per forward pass until then
MICRO_BATCH = "micro_batch_after"  # in it: rows per forward pass from then on
MICRO_BATCH_PARTS = "parts"  # in it: the chunks each of the recipe's micro-batches now runs in
LOST_SECONDS = "lost_s"  # in it: seconds from the failed attempt's start to the error

TOKENS_PER_S = "tokens_per_s"  # input positions per second over all processes, one logging window
TRAINED_TOKENS = "trained_tokens"  # trained (labelled) tokens so far, over all processes
MFU = "mfu"  # model FLOPs utilisation per device

AUX_LOSS = "aux_loss"  # the auxiliary load-balancing loss, mean over the window (when the config computes it)
MAX_LOAD = "max_load"  # the busiest expert's tokens over the mean expert's, worst layer; 1.0 is balanced
IDLE = "idle"  # experts (over all layers) that got no token in the window
TOKENS_PER_EXPERT = "tokens_per_expert"  # in metrics.jsonl: tokens routed to each expert, one list per layer

# the Trainer's per-step keys -> their names in metrics.jsonl
TRAINER_KEYS = {"loss": "loss", "eval_loss": "eval_loss", "learning_rate": "lr", "grad_norm": "grad_norm"}
# train.objective dpo: TRL's reward and log-probability metrics, kept under their own names (eval_ too)
REWARD_MARGINS = "rewards/margins"  # the chosen (desirable) answers' mean reward minus the others'
PREFERENCE_KEYS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    REWARD_MARGINS,
    "logps/chosen",
    "logps/rejected",
)
EVAL_PREFIX = "eval_"  # the Trainer's prefix of a figure measured on the validation set
EVAL_PREFERENCE_ACCURACY = EVAL_PREFIX + "rewards/accuracies"  # held-out preference accuracy
# train.objective grpo: TRL's figures of each batch of rollouts, kept under their own names (eval_ too)
REWARD = "reward"  # the weighted sum of the rewards, mean over the completions
REWARD_STD = "reward_std"
FRAC_REWARD_ZERO_STD = "frac_reward_zero_std"  # share of prompts whose completions all got the same reward
COMPLETION_LENGTH = "completions/mean_length"  # tokens
COMPLETION_CLIPPED = "completions/clipped_ratio"  # share cut at grpo.max_completion_length
KL = "kl"  # to the reference policy (logged with grpo.beta > 0)
GRPO_KEYS = (REWARD, REWARD_STD, FRAC_REWARD_ZERO_STD, COMPLETION_LENGTH, COMPLETION_CLIPPED, KL, "entropy")
REWARDS = "rewards/"  # + a reward function's name + MEAN or STD: TRL's per-function figures
MEAN, STD = "/mean", "/std"


def reward_key(name: str, statistic: str = MEAN) -> str:
    """TRL's key of one reward function's figure: ``rewards/exact_match/mean``."""
    return f"{REWARDS}{name}{statistic}"


def is_reward_key(key: str) -> bool:
    """A per-function reward figure (``rewards/<name>/mean|std``), with or without ``eval_``."""
    key = key.removeprefix("eval_")
    return key.startswith(REWARDS) and key.endswith((MEAN, STD))
