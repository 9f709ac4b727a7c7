"""The recipe's data section: where rows come from (one path, or a weighted mixture of sources), their
format and field names, the length policy, batching, and the preflight checks' thresholds."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from qlora_kit.recipe.base import Section, looks_local
from qlora_kit.registries.formats import FORMATS

FormatName = Literal[tuple(FORMATS)]  # type: ignore[valid-type]


class SourceSection(Section):
    """One dataset of a mixture (``data.sources``)."""

    path: str
    """A file, a folder of files or a save_to_disk folder, a hub dataset, or builtin:demo-facts."""
    config_name: str | None = None
    """A hub dataset's configuration (subset) name."""
    format: FormatName | None = None
    """This source's row format (default: data.format)."""
    fields: dict[str, str] = Field(default_factory=dict)
    """Column names of this source for its format's fields."""
    weight: float | None = Field(None, gt=0)
    """Share of the weighted sources' rows taken from this one (rows are sampled, seeded)."""
    rows: int | None = Field(None, gt=0)
    """Exactly this many rows from this source (sampled, seeded; repeated when it has fewer)."""


class PreflightSection(Section):
    """Checks of the tokenized data before training (``qlora-kit data`` shows each one's result)."""

    enabled: bool = True
    """Run the checks at the start of every run; off trains on whatever the data holds."""
    max_untrained_share: float = Field(0.0, ge=0, le=1)
    """Share of examples allowed to keep no trained token after truncation (they are left out)."""
    min_end_token_share: float = Field(0.95, ge=0, le=1)
    """Share of untruncated examples that must train an end token (EOS or the template's end of turn)."""
    sample_rows: int = Field(1000, gt=0)
    """Chat rows checked for a template that renders a conversation's start differently (slowest check)."""


DEMO_DATA = "builtin:demo-facts"


class DataSection(Section):
    path: str | None = None
    """Training data: a .jsonl/.json/.csv/.parquet file, a folder of such files (shards), a save_to_disk folder, a hub dataset, or builtin:demo-facts (the default when data.sources is empty too)."""
    config_name: str | None = None
    """A hub dataset's configuration (subset) name, for datasets that have several."""
    format: FormatName = "alpaca"
    """Row format: alpaca (instruction/input/output), chat (messages, optional tools), sharegpt (conversations of from/value), completion (prompt/completion) or text; for train.objective dpo, preference (prompt/chosen/rejected texts) or preference_chat (a conversation and two assistant replies)."""
    fields: dict[str, str] = Field(default_factory=dict)
    """Column names of your data for the format's fields, e.g. {instruction: question, output: answer}."""
    sources: list[SourceSection] = Field(default_factory=list)
    """Several datasets mixed into one training set, each with its own path, format, fields and weight or rows (instead of data.path)."""
    dedup: bool = False
    """Leave out examples whose tokens repeat an earlier example's (across all sources)."""
    roles: dict[str, str] = Field(default_factory=dict)
    """ShareGPT speaker names (a turn's 'from') mapped to chat roles, on top of human/user, gpt/assistant, system, tool/observation."""
    system_prompt: str | None = None
    """A system prompt for rows without one: a system message in chat and sharegpt rows, text before the prompt in alpaca and completion rows."""
    val_path: str | None = None
    """Validation data in the same format; builtin datasets bring their own."""
    val_fraction: float = Field(0.0, ge=0, lt=1)
    """Hold out this fraction of the training rows (seeded) when there is no val_path."""
    max_seq_len: int = Field(512, gt=0)
    """Tokens per example."""
    overlong: Literal["truncate", "drop"] = "truncate"
    """What to do with an example longer than max_seq_len: cut its end off, or leave it out."""
    system_prompt_mode: Literal["keep", "merge_into_first_user", "drop"] = "keep"
    """Chat rows' system prompts: keep them, merge them into the first user message (templates without a system role), or drop them."""
    train_reasoning: bool = False
    """Chat rows: train an assistant message's reasoning (its 'thinking' field, gpt-oss's harmony analysis channel) where the template renders it. Off: only the final answer trains; the reasoning is context."""
    train_on_inputs: bool = False
    """Train on prompt tokens too. Off: loss only on the response / assistant turns (the QLoRA paper's)."""
    packing: bool | Literal["auto"] = "auto"
    """Pack examples into rows of up to max_seq_len tokens (restarting position ids: no cross-attention); auto: padding, group_by_length or packing, whichever trains the most real tokens a second on a few of this data's batches (timed and logged at the start of a run; the least padding where they cannot be timed)."""
    group_by_length: bool = False
    """Batch examples of similar length (less padding without packing; its order drawn from the seed, so a resume reproduces it)."""
    preflight: PreflightSection = PreflightSection()
    """Checks that stop a run whose data trains on nothing (thresholds)."""

    @property
    def packs(self) -> bool:
        """Packing is on for certain (``auto`` is resolved at the start of a run, data/layout.py)."""
        return self.packing is True

    def source_list(self) -> list[SourceSection]:
        """The training sources: data.sources, or data.path as the one source."""
        if self.sources:
            return self.sources
        path = DEMO_DATA if self.path is None else self.path
        return [SourceSection(path=path, config_name=self.config_name, fields=self.fields)]

    def format_of(self, source: SourceSection) -> str:
        return source.format or self.format

    def formats_by_field(self) -> list[tuple[str, str]]:
        """(the field that sets it, format) for every format the rows are read with: each source's own
        (data.sources[i].format, else data.format), and data.format for data.val_path's rows."""
        named = [
            (f"data.sources[{number}].format" if source.format else "data.format", self.format_of(source))
            for number, source in enumerate(self.source_list())
        ]
        return named + ([("data.format", self.format)] if self.val_path is not None else [])

    def formats_used(self) -> set[str]:
        return {fmt for _, fmt in self.formats_by_field()}

    @model_validator(mode="after")
    def _check_fields(self) -> DataSection:
        # decided from values, not from which fields were set: a run's recipe.yaml holds every field, and it
        # must load back as the same recipe (data.path stays None under a mixture)
        if self.sources and self.path is not None:
            raise ValueError("data.sources: give either data.path or data.sources, not both")
        for number, source in enumerate(self.source_list()):
            name = f"data.sources[{number}]." if self.sources else "data."
            _check_source(source, self.format_of(source), name)
        chat_like = self.formats_used() & {"chat", "sharegpt"}
        if self.system_prompt_mode != "keep" and not chat_like:
            raise ValueError(
                f"data.system_prompt_mode: only applies to formats chat and sharegpt (data.format is {self.format})"
            )
        if self.train_reasoning and not chat_like:
            raise ValueError(
                f"data.train_reasoning: only applies to formats chat and sharegpt (data.format is {self.format})"
            )
        if self.roles and "sharegpt" not in self.formats_used():
            raise ValueError("data.roles: only applies to format sharegpt")
        if self.system_prompt is not None and "text" in self.formats_used():
            raise ValueError("data.system_prompt: format text has no prompt to put it before")
        if self.packing is True and self.group_by_length:
            raise ValueError(
                "data.group_by_length: pointless with data.packing (packed batches have no padding)"
            )
        return self


def _check_source(source: SourceSection, fmt: str, name: str) -> None:
    known = FORMATS[fmt].fields
    for field in source.fields:
        if field not in known:
            raise ValueError(f"{name}fields: {field!r} is not a field of format {fmt} ({', '.join(known)})")
    if source.config_name is not None and (source.path.startswith("builtin:") or looks_local(source.path)):
        raise ValueError(f"{name}config_name: only for a hub dataset ({name}path is {source.path})")
    if source.weight is not None and source.rows is not None:
        raise ValueError(f"{name}weight: give a weight or a number of rows, not both")
