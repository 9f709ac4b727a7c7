"""The data preflight: checks of the tokenized data that stop a run which would train on nothing, or
teach the model never to stop, before any weight is loaded (``pipeline.build``); ``qlora-kit data``
shows every result. Thresholds are ``data.preflight``'s. The silent failures peers' trackers are full of:

- untrained examples: no token of an example is trained once it is cut to ``data.max_seq_len`` (its
  response was cut away); such examples are left out, and above ``max_untrained_share`` the run stops;
- the end token: an untruncated example must train the tokenizer's EOS or the template's end-of-turn
  token, or the model never learns to stop (at least ``min_end_token_share`` of them);
- a double BOS: an example starts with two BOS tokens (the template and the tokenizer both add one);
- padding that hides the end token: with pad = EOS (or end of turn), a collator that masks pad tokens
  masks the trained EOS too; a batch of real examples is collated and its trained end tokens counted;
- the chat template's prefix: for a sample of chat rows, the prompt rendered for each assistant turn
  (the conversation so far with the generation prompt, what inference feeds the model) must be the
  start of the whole conversation's rendering, which is what training feeds it (a template that only
  moves the system prompt, as Mistral's does, passes with a warning: the family's own rendering).

Every check reads per-example facts written while tokenizing (``row_tokens.FACTS``), so it costs one pass
over small columns, never over the tokens of data that may be bigger than memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qlora_kit.data.chat import PROMPTS_DIFFER, SYSTEM_PLACED
from qlora_kit.data.formats import IGNORE_INDEX
from qlora_kit.errors import DataError

if TYPE_CHECKING:
    from qlora_kit.data.prepare import PreparedData
    from qlora_kit.recipe.data import DataSection

log = logging.getLogger(__name__)

COLLATED_EXAMPLES = 8  # examples collated for the padding check


@dataclass
class Check:
    name: str
    passed: bool
    detail: str  # what was measured
    fix: str = ""  # what to do about a failure
    warning: bool = False  # passed, but with something the user should know (logged at the run's start)

    def line(self) -> str:
        return f"data preflight: {self.name}: {self.detail}" + (f"; {self.fix}" if self.fix else "")


def run_checks(prepared: PreparedData, data: DataSection, tokenizer, collator) -> list[Check]:
    """Every check's result on the prepared training set (see the module docstring); ``collator`` is
    None for preference pairs."""
    from qlora_kit.data.row_tokens import end_token_ids

    limits, facts = data.preflight, prepared.checks
    ends = end_token_ids(tokenizer)
    rows = sum(r.rows - r.dropped for r in prepared.train_reports)
    untrained = sum(r.untrainable for r in prepared.train_reports)
    checks = [
        Check(
            "untrained examples",
            untrained <= limits.max_untrained_share * rows,
            f"{untrained} of {rows} examples keep no trained token after truncation to {data.max_seq_len} tokens",
            "set data.overlong: drop, or raise data.max_seq_len (data.preflight.max_untrained_share allows some)",
        )
    ]
    whole = [
        end
        for end, full in zip(facts["trains_end"], facts["full_length"], strict=True)
        if full <= data.max_seq_len
    ]
    share = sum(whole) / len(whole) if whole else 1.0
    names = ", ".join(sorted(tokenizer.convert_ids_to_tokens(sorted(ends)))) or "none"
    checks.append(
        Check(
            "end token trained",
            share >= limits.min_end_token_share,
            f"{share:.1%} of {len(whole)} untruncated examples train an end token ({names})",
            "the model would never learn to stop: make the response or the chat template's reply end with "
            "the tokenizer's EOS or end-of-turn token",
        )
    )
    doubled = sum(facts["double_bos"])
    checks.append(
        Check(
            "single BOS",
            doubled == 0,
            f"{doubled} examples start with two BOS tokens ({tokenizer.bos_token})",
            "the text already starts with BOS and the tokenizer adds another: remove it from the data "
            "or the chat template",
        )
    )
    checks.append(_padding_check(prepared, tokenizer, collator, ends))
    checks.append(_prefix_check([ok for ok in facts["prefix_ok"] if ok >= 0]))
    return checks


def _prefix_check(checked: list[int]) -> Check:
    """A turn's prompt must render as the same turn inside the whole conversation. Where the only
    difference is the system prompt's place (Mistral v0.3's template: in the last user turn only), it is
    the family's own rendering, which its users train and serve with: a warning saying which turns it
    affects, not a refusal."""
    name = "chat template prefix"
    if not checked:
        return Check(name, True, "no chat rows")
    differ, placed = checked.count(PROMPTS_DIFFER), checked.count(SYSTEM_PLACED)
    if differ:
        return Check(
            name,
            False,
            f"{differ} of {len(checked)} chat rows checked render a turn's prompt differently from the "
            "same turn inside the whole conversation",
            "inference would see a context training never showed: fix the chat template (or data.system_prompt_mode)",
        )
    if placed:
        return Check(
            name,
            True,
            f"{placed} of {len(checked)} chat rows checked have a system prompt the template puts into the "
            "last user turn only (as Mistral's does): their earlier assistant turns train without it, and a "
            "multi-turn chat asks them with it. That is the family's own rendering; data.system_prompt_mode: "
            "merge_into_first_user keeps it in every turn, drop leaves it out of training and asking alike",
            warning=True,
        )
    return Check(name, True, f"{len(checked)} chat rows checked render each turn's prompt as trained")


def _padding_check(prepared: PreparedData, tokenizer, collator, ends: set[int]) -> Check:
    name = "end token kept by padding"
    pad = tokenizer.pad_token_id
    if collator is None:
        return Check(name, True, "preference pairs: their answers are marked by a mask, never by the pad id")
    if pad not in ends:
        return Check(name, True, f"pad token {tokenizer.pad_token!r} is not an end token")
    rows = [prepared.train[i] for i in range(min(COLLATED_EXAMPLES, len(prepared.train)))]
    before = sum(1 for row in rows for t in row["labels"] if t in ends)
    batch = collator([dict(row) for row in rows])
    after = sum(1 for t in batch["labels"].flatten().tolist() if t != IGNORE_INDEX and t in ends)
    return Check(
        name,
        after >= before,
        f"pad = {tokenizer.pad_token!r}, an end token; {after} of {before} trained end tokens keep their "
        "label after collating",
        "the collator masks pad tokens and with them the trained EOS: give the tokenizer its own pad token",
    )


def enforce(checks: list[Check]) -> None:
    """Stop with the first failed check's line (a DataError: one line, exit code 2)."""
    for check in checks:
        if check.passed and check.warning:
            log.warning("data preflight: %s: %s", check.name, check.detail)
    failed = next((c for c in checks if not c.passed), None)
    if failed is not None:
        raise DataError(failed.line())
