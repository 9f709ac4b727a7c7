"""Objectives: one ``ObjectiveSpec`` per ``train.objective``, naming its traits.

Everything outside an objective's own module asks the table for a trait and never compares
``train.objective`` with a name (tests/test_objectives.py greps for that): the recipe's rules, data preparation and its report, the
planner, the loss head, the out-of-memory policy, the console, the metrics file, ``show`` and ``eval``.
Its module (``training/objectives/<name>.py``, imported by ``training/objective_trainer.py``'s ``MODULES``:
this table is standard library only, and the recipe, which reads it, sits below training) builds the
objective's data, its Trainer's arguments and the Trainer:

- ``prepare(recipe, tokenizer) -> PreparedData``: the training and validation rows;
- ``trainer_parts(recipe, tokenizer, output_dir, has_eval, precision) -> Parts``: the Trainer class, its
  arguments, the guard class and the extra keyword arguments the Trainer takes.

An objective's own figures in ``qlora-kit eval`` are ``after/evaluate.py``'s ``OBJECTIVE_METRICS``.
Adding an objective is one entry here, one line each in those two tables, its module and its tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from qlora_kit.registries import metric_keys as keys

# What one data row is: a sequence with trained tokens (SFT), a preference pair, a prompt the model
# answers in training, or one answer with a thumbs-up or -down label
SEQUENCES, PAIRS, PROMPTS, UNPAIRED = "sequences", "pairs", "prompts", "unpaired"


@dataclass(frozen=True)
class ObjectiveSpec:
    name: str
    rows: str  # SEQUENCES, PAIRS, PROMPTS or UNPAIRED
    trainer: str  # TRL's (or transformers') Trainer class it runs on, for messages
    packs: bool = False  # rows may be packed or grouped by length (TRL pads pairs and rollouts itself)
    chunked_head: bool = False  # qlora_kit's chunked loss head (TRL's heads keep no whole logits already)
    splits_on_oom: bool = True  # an out-of-memory error may split its micro-batch and redo it
    probes_worst_batch: bool = False  # it can try its worst batch before the first step
    preflight: bool = True  # its rows carry trained tokens the preflight can check before the weights
    sequences_per_row: int = 1  # sequences one row runs as in the forward pass (the planner's batch)
    rollouts: bool = False  # samples completions in training (the planner's rollout term)
    reference: bool = False  # a frozen reference policy: a second adapter on the same base
    disables_dropout: bool = False  # TRL turns dropout off (policy and reference score alike)
    section: str | None = None  # the recipe section that applies to it alone
    metric_keys: tuple[str, ...] = ()  # TRL's figures kept in metrics.jsonl (and their eval_ twins)
    console: tuple[tuple[str, str], ...] = ()  # (log key, label) shown beside the loss while it trains
    eval_line: tuple[tuple[str, str], ...] = ()  # (log key, label) added to the console's eval line
    summary: tuple[tuple[str, str], ...] = ()  # (metrics.jsonl key, label): show's "first -> last" rows


PREFERENCE_CONSOLE = ((keys.EVAL_PREFERENCE_ACCURACY, "eval acc"),)
# what DPO and ORPO show of their pairs: TRL's reward figures, the held-out preference accuracy
PAIR_FIGURES = {
    "metric_keys": keys.PREFERENCE_KEYS,
    "console": PREFERENCE_CONSOLE,
    "eval_line": ((keys.EVAL_PREFERENCE_ACCURACY, "preference accuracy"),),
    "summary": ((keys.EVAL_PREFERENCE_ACCURACY, "eval preference accuracy"),),
}

OBJECTIVES: dict[str, ObjectiveSpec] = {
    spec.name: spec
    for spec in (
        ObjectiveSpec(
            "sft",
            SEQUENCES,
            "Trainer",
            packs=True,
            chunked_head=True,
            probes_worst_batch=True,
        ),
        ObjectiveSpec(
            "dpo",
            PAIRS,
            "DPOTrainer",
            sequences_per_row=2,  # chosen and rejected in one forward pass
            reference=True,
            disables_dropout=True,
            section="preference",
            **PAIR_FIGURES,
        ),
        ObjectiveSpec(
            "orpo",
            PAIRS,
            "ORPOTrainer",
            sequences_per_row=2,  # chosen and rejected in one forward pass; no reference policy
            disables_dropout=True,
            section="preference",
            **PAIR_FIGURES,
        ),
        ObjectiveSpec(
            "grpo",
            PROMPTS,
            "GRPOTrainer",
            # an out-of-memory error splits the generation batch or the policy step (grpo/oom.py), and the
            # probe tries the longest prompts at max_completion_length first
            probes_worst_batch=True,
            preflight=False,  # it trains on no labelled token: the completions are sampled
            rollouts=True,
            reference=True,
            section="grpo",
            metric_keys=keys.GRPO_KEYS,
            console=((keys.REWARD, "reward"),),  # the rollouts' mean summed reward (the loss reads ~0)
            summary=((keys.REWARD, "reward"),),
        ),
        ObjectiveSpec(
            "kto",
            UNPAIRED,
            "KTOTrainer",
            splits_on_oom=False,  # not yet proven on its KL rows: an out-of-memory error stops with the line
            preflight=False,  # TRL tokenizes the texts: there are no token rows to check before it
            sequences_per_row=2,  # each answer, and the mismatched answer of the KL baseline
            reference=True,
            disables_dropout=True,
            section="preference",
            metric_keys=(*keys.PREFERENCE_KEYS, keys.KL),
            console=((keys.REWARD_MARGINS, "margin"),),
            eval_line=((keys.EVAL_PREFIX + keys.REWARD_MARGINS, "reward margin"),),
            summary=((keys.REWARD_MARGINS, "reward margin"), (keys.KL, "kl")),
        ),
    )
}


def objective(name: str) -> ObjectiveSpec:
    """The table's entry for ``train.objective`` ``name``."""
    return OBJECTIVES[name]


def of(recipe) -> ObjectiveSpec:
    """The entry of ``recipe.train.objective``."""
    return OBJECTIVES[recipe.train.objective]


def with_section(section: str) -> list[str]:
    """The objectives a recipe section applies to (``preference``: dpo), by name."""
    return [name for name, spec in OBJECTIVES.items() if spec.section == section]


def logged_keys() -> list[str]:
    """Every objective's TRL figures, once each, in table order (the metrics file keeps them)."""
    return list(dict.fromkeys(k for spec in OBJECTIVES.values() for k in spec.metric_keys))


def lines(facet: str) -> list[tuple[str, str]]:
    """Every objective's (key, label) pairs of one facet (console, eval_line, summary), once each."""
    return list(dict.fromkeys(pair for spec in OBJECTIVES.values() for pair in getattr(spec, facet)))
